"""A guard in a prefill or decode pod, in front of the scripted vLLM: the hand-off requests go
through unchanged, a prefill's answer is its first token, and every hand-off is counted by phase
and outcome; a pod that writes the shared-storage connector's files keeps them bounded."""
from __future__ import annotations

import asyncio
import os
import time

import aiohttp

from tests.support.waiting import wait_for
from tests.unit.engine.test_guard_proxy import metrics, sample
from tests.unit.engine.test_kv_handoff import PREFILL_PARAMS

PREFILL_BODY = {"prompt": " ".join(["w"] * 64), "max_tokens": 1, "min_tokens": 1, "stream": False,
                "kv_transfer_params": PREFILL_PARAMS}


async def until(check, what: str, timeout: float = 5):
    return await wait_for(check, timeout=timeout, interval=0.005, what=what)


def handoffs(text: str, phase: str, outcome: str) -> float:
    return sample(text, "gpufleet_guard_kv_handoffs_total", outcome=outcome, phase=phase)


async def test_a_prefill_pod_holds_the_prompt_only_and_times_its_answer_as_the_first_token(guard_factory,
                                                                                            fake_vllm):
    fake_vllm.hold = asyncio.Event()
    guard = await guard_factory(role="prefill")
    async with aiohttp.ClientSession() as s:
        async def prefill():
            async with s.post(guard.url + "/v1/completions", json=PREFILL_BODY) as r:
                return r.status, await r.json()

        sent = asyncio.create_task(prefill())
        await until(lambda: fake_vllm.running == 1, "the prefill to reach vLLM")
        assert guard.guard.admission.ledger.reserved_blocks == 2   # 64 prompt tokens, no answer held
        fake_vllm.hold.set()
        status, _ = await sent
        text = await metrics(s, guard)
    assert status == 200 and fake_vllm.seen_bodies == [PREFILL_BODY]
    assert sample(text, "gpufleet_guard_role_info", role="prefill") == 1
    assert handoffs(text, "prefill", "ok") == 1 and handoffs(text, "decode", "ok") == 0
    assert sample(text, "gpufleet_guard_ttft_seconds_count", **{"class": "standard"}) == 1
    # Judged against the TTFT objective, not the whole-request one.
    assert sample(text, "gpufleet_guard_sli_events_total", **{"class": "standard", "sli": "ttft"}) == 1
    assert sample(text, "gpufleet_guard_sli_events_total", **{"class": "standard", "sli": "latency"}) == 0
    # A prefill's one token says nothing of how long answers are.
    assert sample(text, "gpufleet_guard_output_tokens_count", **{"class": "standard", "route": "/v1/completions"}) == 0


async def test_a_decode_pod_counts_the_hand_offs_it_answers_and_those_vllm_failed(guard_factory, fake_vllm):
    guard = await guard_factory(role="decode")
    async with aiohttp.ClientSession() as s:
        body = {"prompt": "a b c", "max_tokens": 4, "stream": True, "kv_transfer_params": None}
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")
        # vLLM finishes a request whose KV it could not load with an error, under the fail policy.
        async with s.post(guard.url + "/v1/completions", json={**body, "model": "fail-500"}) as r:
            assert r.status == 500
        async with s.post(guard.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}) as r:
            assert r.status == 200
        text = await metrics(s, guard)
    assert fake_vllm.seen_bodies[0] == body   # kv_transfer_params reach vLLM as sent
    assert sample(text, "gpufleet_guard_role_info", role="decode") == 1
    assert handoffs(text, "decode", "ok") == 1 and handoffs(text, "decode", "error") == 1
    assert handoffs(text, "prefill", "ok") == 0   # the request without kv_transfer_params is no hand-off
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "ok"}) == 2


async def test_a_unified_pod_says_so(guard_factory):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_role_info", role="unified") == 1
    assert "\ngpufleet_guard_kv_storage_bytes " not in text   # nothing to bound here


async def test_a_producer_removes_the_oldest_prompts_past_the_limit(guard_factory, fake_vllm, tmp_path):
    old, young = tmp_path / f"{1:032x}", tmp_path / f"{2:032x}"
    now = time.time()
    for folder, age in ((old, 3600), (young, 0)):
        folder.mkdir()
        (folder / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"k" * 600)
        os.utime(folder, (now - age, now - age))
    engine = {"model": "m", "servedModelName": "m", "blockSize": 32, "port": 8000, "kvTransfer": {
        "connector": "ExampleConnector", "role": "kv_producer", "sharedStorageLimitBytes": 1000,
        "extraConfig": {"shared_storage_path": str(tmp_path)}}}
    guard = await guard_factory(role="prefill", engine=engine)
    await until(lambda: not old.exists(), "the guard to remove the old prompt's files")
    async with aiohttp.ClientSession() as s:
        text = await metrics(s, guard)
    assert young.exists()
    assert sample(text, "gpufleet_guard_kv_storage_removed_prompts_total") == 1
    assert sample(text, "gpufleet_guard_kv_storage_bytes") == 600
