"""Reservations sized to real answers, refusals that say what they mean, bad input: through the
guard's HTTP path in front of the scripted vLLM (conftest.FakeVllm)."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.unit.engine.test_guard_proxy import metrics, sample, until

CHAT = "/v1/chat/completions"


def chat(content: str = "hello there", **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def teach(s, guard, answers: int, body: dict, path: str = "/v1/completions") -> None:
    for _ in range(answers):
        async with s.post(guard.url + path, json=body) as r:
            assert r.status == 200
            await r.read()


async def test_after_learning_short_answers_a_request_reserves_its_prompt_and_the_learned_length(
        guard_factory, fake_vllm):
    guard = await guard_factory(blockSize=32, maxContextTokens=1000)
    fake_vllm.answer_tokens = 5                    # answers end at "EOS" after 5 tokens
    body = {"model": "m", "prompt": "x " * 40, "max_tokens": 900, "stream": True}
    async with aiohttp.ClientSession() as s:
        fake_vllm.hold = asyncio.Event()
        first = asyncio.create_task(s.post(guard.url + "/v1/completions", json=body))
        await until(lambda: fake_vllm.running == 1, "the first request at vLLM")
        assert guard.guard.admission.ledger.reserved_blocks == 30      # the prior: 40 + 900 tokens
        fake_vllm.hold.set()
        (await first).release()
        fake_vllm.hold = None
        await teach(s, guard, 16, body)
        fake_vllm.hold = asyncio.Event()
        later = asyncio.create_task(s.post(guard.url + "/v1/completions", json=body))
        await until(lambda: fake_vllm.running == 1, "a request after learning at vLLM")
        assert guard.guard.admission.ledger.reserved_blocks == 2       # 40 + 5 tokens (+ [DONE], counted as one)
        fake_vllm.hold.set()
        (await later).release()
        text = await metrics(s, guard)
    labels = {"class": "standard", "route": "/v1/completions"}
    assert sample(text, "gpufleet_guard_output_tokens_predicted", **labels) in (5, 6)
    assert sample(text, "gpufleet_guard_output_tokens_count", **labels) == 18


async def test_an_answer_that_outgrows_its_reservation_is_extended_as_it_streams(guard_factory, fake_vllm):
    guard = await guard_factory(blockSize=32, maxContextTokens=1000)
    fake_vllm.answer_tokens = 3
    body = {"model": "m", "prompt": "x " * 40, "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as s:
        await teach(s, guard, 16, body)
        fake_vllm.answer_tokens = 200
        fake_vllm.token_delay = 0.002
        seen: list[int] = []

        async def watch():
            while True:
                seen.append(guard.guard.admission.ledger.reserved_blocks)
                await asyncio.sleep(0.002)
        watcher = asyncio.create_task(watch())
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()
        watcher.cancel()
        text = await metrics(s, guard)
    assert min(v for v in seen if v) == 2 and max(seen) >= 8   # 40 + 200 tokens need 8 blocks
    assert sample(text, "gpufleet_guard_reservation_extensions_total", **{"class": "standard"}) >= 1
    assert guard.guard.admission.ledger.reserved_blocks == 0


async def test_full_budget_reserves_the_worst_case(guard_factory, fake_vllm):
    guard = await guard_factory(blockSize=32, maxContextTokens=1000, reservation="FullBudget")
    fake_vllm.answer_tokens = 5
    body = {"model": "m", "prompt": "x " * 40, "max_tokens": 900}
    async with aiohttp.ClientSession() as s:
        await teach(s, guard, 20, body)
        fake_vllm.hold = asyncio.Event()
        held = asyncio.create_task(s.post(guard.url + "/v1/completions", json=body))
        await until(lambda: fake_vllm.running == 1, "the request at vLLM")
        assert guard.guard.admission.ledger.reserved_blocks == 30
        fake_vllm.hold.set()
        (await held).release()


async def test_a_request_no_empty_replica_could_hold_gets_400_naming_its_size_not_429(guard_factory, fake_vllm):
    guard = await guard_factory(blockSize=32, maxContextTokens=1000, reservation="FullBudget")
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + CHAT, json=chat(n=5)) as r:   # 5 × the whole context
            assert r.status == 400 and "Retry-After" not in r.headers
            error = (await r.json())["error"]
        text = await metrics(s, guard)
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "5 sequences" in error["message"] and "a replica holds 63" in error["message"]
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "interactive", "reason": "exceeds_kv_pool"}) == 1
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "interactive", "reason": "kv_watermark"}) == 0
    assert fake_vllm.seen_bodies == []


async def test_predicted_reservations_admit_what_vllm_could_serve_even_if_its_budget_never_fits(
        guard_factory, fake_vllm):
    guard = await guard_factory(blockSize=32, maxContextTokens=1000)
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + CHAT, json=chat(n=5)) as r:
            assert r.status == 200
        assert fake_vllm.seen_bodies[-1] == chat(n=5)        # forwarded as sent: no max_tokens added


async def test_without_max_tokens_the_body_reaches_vllm_exactly_as_sent(guard_factory, fake_vllm):
    guard = await guard_factory()
    raw = b'{"model": "m", "prompt": "one two three",   "stream": false}'
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", data=raw,
                          headers={"content-type": "application/json"}) as r:
            assert r.status == 200
        async with s.post(guard.url + CHAT, json=chat()) as r:
            assert r.status == 200
    assert fake_vllm.seen_bodies == [{"model": "m", "prompt": "one two three", "stream": False}, chat()]


@pytest.mark.parametrize(("raw", "param", "message"), [
    (b'{"model": "m", "prompt": ', None, "not valid JSON"),
    (b'\xff\xfe{}', None, "not valid JSON"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens", "max_tokens must be a positive integer"),
    (b'{"model": "m", "prompt": "x", "max_tokens": "ten"}', "max_tokens", "positive integer"),
    (b'{"model": "m", "prompt": "x", "n": 99999}', "n", "n must be an integer from 1 to 16384"),
    (b'{"model": "m", "prompt": 42}', "prompt", "prompt (or input) must be"),
])
async def test_bad_input_is_a_400_in_vllms_format_counted_as_invalid(guard_factory, fake_vllm, raw, param,
                                                                     message):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", data=raw,
                          headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        text = await metrics(s, guard)
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert message in error["message"]
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "invalid"}) == 1
    assert fake_vllm.seen_bodies == []


async def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(guard_factory, fake_vllm):
    guard = await guard_factory(maxContextTokens=1000)       # limit: 1 MiB + 64 000 bytes
    limit = guard.guard.admission.max_body_bytes
    big = b'{"model": "m", "prompt": "' + b"x" * (limit + 10) + b'"}'

    async def chunked():
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    async with aiohttp.ClientSession() as s:
        for data in (big, chunked()):
            async with s.post(guard.url + "/v1/completions", data=data,
                              headers={"content-type": "application/json"}) as r:
                assert r.status == 413
                error = (await r.json())["error"]
                assert str(limit) in error["message"] and error["code"] == 413
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "standard", "reason": "request_too_large"}) == 2
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "invalid"}) == 2


def test_only_text_sends_a_body_to_a_tokenizer_thread():
    """Numbers are not tokenized: a burst of token-id prompts or long stop lists stays inline
    instead of starting worker threads; a long text prompt goes to a thread."""
    import json

    from gpufleet_engine.serving.send_ahead import INLINE_TOKENIZE_BYTES as _INLINE_TOKENIZE_BYTES
    from gpufleet_engine.serving.send_ahead import text_bytes
    ids = json.dumps({"prompt": list(range(10_000, 20_000)), "stop_token_ids": list(range(5000)),
                      "max_tokens": 16}).encode()
    assert len(ids) > 2 * _INLINE_TOKENIZE_BYTES and text_bytes(ids) < 100
    text = json.dumps({"messages": [{"role": "user", "content": "hello world " * 3000}]}).encode()
    assert text_bytes(text) > _INLINE_TOKENIZE_BYTES
    assert text_bytes(b'{"prompt": "hi"}') == len(b'{"prompt": "hi"}')
