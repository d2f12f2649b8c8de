"""The router's pick follows what a real vLLM's prefix cache holds: the session engine's guard follows vLLM's
KV events (LocalEngine turns them on, as the operator does wherever the prefix cache is), the router reads its
feed and tokenizer (cache_feed.py) and places a prompt it never sent anywhere on the replica whose cache holds
it. A second guard in front of the same vLLM follows no events: it feeds nothing (404) and is placed by what
the router learned, as an older guard is."""
from __future__ import annotations

import json
import uuid

import aiohttp

from gpufleet_api.guard import kv_blocks
from gpufleet_router.fleet import Fleet
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.choice import Reason
from gpufleet_router.policy.placement import place
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.settings import RouterSettings
from tests.support.waiting import wait_for

MODEL = "tiny"
BLOCK_SIZE = 32
CHAT = "/v1/chat/completions"


def chat(system: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]}


def system_prompt() -> str:
    tag = uuid.uuid4().hex
    return " ".join(f"{tag[i % 32]}{i} is a rule to keep in mind" for i in range(60))


async def test_the_pick_follows_the_real_prefix_cache(engine, extra_guard):
    blind = await extra_guard()
    guards = {"cached": engine.guard_url.removeprefix("http://"), "blind": blind.url.removeprefix("http://")}
    fleet = Fleet(RouterSettings(prefix_blocks=4, hold_timeout=0.0), RouterMetrics())
    fleet.update(Table({MODEL: Route("local", MODEL, MODEL, BLOCK_SIZE, 1, 2, tuple(
        Replica(pod, address) for pod, address in guards.items()))}))
    async with aiohttp.ClientSession() as http:
        async def tokenizer_loaded() -> bool:
            await fleet.read_once(http)
            return MODEL in fleet.tokenizers

        await wait_for(tokenizer_loaded, timeout=60, what="the router loads the tokenizer from the session guard")
        picker = fleet.picker(MODEL)
        assert picker is not None and "blind" not in picker.cached   # no feed there: learned placement only

        system = system_prompt()
        body = chat(system)
        placement = place(json.dumps(body).encode(), CHAT, fleet.table, fleet.catalog, 4,
                          fleet.tokenize)
        prefix = placement.prefix
        assert prefix is not None and len(prefix.tokens) >= 8 and prefix.block_size == BLOCK_SIZE
        assert picker.match("cached", prefix) == 0

        # The prompt goes to vLLM without the router: the router learns nothing, only the cache can tell.
        async with http.post(engine.guard_url + CHAT, json=body) as r:
            assert r.status == 200, await r.text()

        async def cached_run() -> int:
            await fleet.read_once(http)
            view = picker.cached.get("cached")
            return view.match(prefix.tokens) if view is not None else 0

        # Every whole block of the prompt, named by the router's chain over its own tokenization: the router
        # renders the chat template and tokenizes as vLLM did, block for block.
        await wait_for(cached_run, timeout=60, what="the guard's feed shows the prompt's blocks",
                       describe=lambda: (len(picker.cached.get("cached") or ()), len(prefix.tokens)))
        assert await cached_run() == len(prefix.tokens)
        assert not picker.learned.get("cached") and not picker.learned.get("blind")

        pick = picker.pick(placement.cost, prefix)
        assert pick is not None and pick.replica.pod == "cached" and pick.reason == Reason.AFFINITY
        assert pick.affinity_hit

        # A prompt nobody sent is held nowhere: placed as a new prefix.
        other = place(json.dumps(chat(system_prompt())).encode(), CHAT, fleet.table, fleet.catalog,
                      4, fleet.tokenize)
        assert other.prefix is not None and picker.match("cached", other.prefix) == 0
        fresh = picker.pick(other.cost, other.prefix)
        assert fresh is not None and fresh.reason == Reason.NEW_PREFIX

        # The blind guard answers the feed's path with 404 (it follows no events).
        async with http.get(blind.url + kv_blocks.KV_BLOCKS_PATH) as r:
            assert r.status == 404
