"""The guard admits against the context vLLM really serves, read from its /v1/models."""
from __future__ import annotations

import aiohttp
import pytest

from gpufleet_api.guard import guard_config
from gpufleet_engine.serving.served_context import NoContextLength, NoMaxModelLen, served_max_model_len
from gpufleet_engine.serving.server import GuardServer
from tests.support.waiting import wait_for

LLAMA = {"object": "list", "data": [{"id": "chat", "object": "model", "max_model_len": 131072}]}


def test_the_served_models_context_is_read_from_its_card():
    assert served_max_model_len(LLAMA, "chat") == 131072


@pytest.mark.parametrize("document, problem", [
    ({"data": [{"id": "other", "max_model_len": 8}]}, "serves other, not 'chat'"),
    ({"data": [{"id": "chat"}]}, "set spec.model.maxModelLen"),
    ({"data": [{"id": "chat", "max_model_len": True}]}, "no max_model_len"),
    ({"object": "error"}, "no data list"),
])
def test_an_answer_without_a_usable_context_says_why(document, problem):
    with pytest.raises(NoContextLength, match=problem):
        served_max_model_len(document, "chat")


def test_a_card_without_max_model_len_is_its_own_kind_of_problem():
    with pytest.raises(NoMaxModelLen):
        served_max_model_len({"data": [{"id": "chat"}]}, "chat")


async def _guard(fake_vllm, tokenizer, **overrides) -> GuardServer:
    raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake_vllm.url, "listenHost": "127.0.0.1",
           "listenPort": 0, "metricsPollSeconds": 0.05, "kvWatermarkPercent": 15, **overrides}
    server = GuardServer(guard_config.parse(raw), tokenizer=tokenizer)
    await server.start()
    return server


async def test_without_a_configured_length_the_guard_admits_up_to_what_vllm_serves(fake_vllm, tokenizer):
    fake_vllm.max_model_len = 300
    guard = await _guard(fake_vllm, tokenizer)
    try:
        await guard.wait_ready(5)
        assert guard.guard.admission.limits.max_context_tokens == 300
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions", json={"prompt": "x " * 250, "max_tokens": 60}) as r:
                assert r.status == 400
                assert "the maximum context is 300 tokens" in (await r.json())["error"]["message"]
            async with s.post(guard.url + "/v1/completions", json={"prompt": "x " * 250, "max_tokens": 50}) as r:
                assert r.status == 200
    finally:
        await guard.stop()


async def test_a_configured_limit_above_what_vllm_serves_is_capped_to_it(fake_vllm, tokenizer):
    fake_vllm.max_model_len = 300
    guard = await _guard(fake_vllm, tokenizer, maxContextTokens=1000)
    try:
        await guard.wait_ready(5)
        limits = guard.guard.admission.limits
        assert limits.max_context_tokens == 300 and limits.max_model_len == 300
    finally:
        await guard.stop()


async def test_until_vllm_reports_its_context_the_guard_is_not_ready_and_refuses_with_503(fake_vllm, tokenizer):
    guard = await _guard(fake_vllm, tokenizer)  # fake vLLM's card has no max_model_len, none configured
    try:
        await wait_for(lambda: "no max_model_len" in guard.guard.context_problem, timeout=5,
                       what="the guard to read /v1/models")
        async with aiohttp.ClientSession() as s:
            async with s.get(guard.url + "/readyz") as r:
                assert r.status == 503
                reasons = (await r.json())["reasons"]
            async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}) as r:
                assert r.status == 503 and "spec.model.maxModelLen" in (await r.json())["error"]["message"]
        assert any("context length unknown" in x and "spec.model.maxModelLen" in x for x in reasons)
        assert fake_vllm.seen_bodies == []
    finally:
        await guard.stop()


async def test_an_engine_length_in_the_config_needs_no_read(fake_vllm, tokenizer):
    engine = {"model": "/m", "servedModelName": "m", "maxModelLen": 512}
    guard = await _guard(fake_vllm, tokenizer, engine=engine, blockSize=32)
    try:
        assert guard.guard.admission.limits is not None and guard.guard.admission.limits.max_context_tokens == 512
        await guard.wait_ready(5)
    finally:
        await guard.stop()
