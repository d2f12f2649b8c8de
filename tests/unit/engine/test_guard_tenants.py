"""Fair shares between tenants inside a queue class, at the guard: a saturated guard (one slot) in front of
the scripted vLLM, requests naming their tenant and weight in the headers the router sets."""
from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_api.tenants.usage import GUARD_TENANT_HEADER, GUARD_WEIGHT_HEADER
from gpufleet_engine.admission.tenant_keys import TenantKeys
from tests.support.waiting import wait_for


async def until(check, what: str, timeout: float = 5):
    """The fake vLLM and the guard share this event loop: polling every few milliseconds sees each
    state change within a scheduling round."""
    return await wait_for(check, timeout=timeout, interval=0.005, what=what)


def headers(tenant: str | None, weight: str | None = None) -> dict[str, str]:
    out = {}
    if tenant is not None:
        out[GUARD_TENANT_HEADER] = tenant
    if weight is not None:
        out[GUARD_WEIGHT_HEADER] = weight
    return out


async def served_order(guard, fake_vllm, queued: list[tuple[str, dict[str, str]]],
                       blocker: dict[str, str] | None = None) -> list[str]:
    """Hold the guard's only slot with one request, queue ``queued`` (prompt, headers) in that order,
    then let everything through: the prompts in the order vLLM was given them (one slot, so also
    the order they were served in), the blocker's left out. Each answer is 5 tokens of a one-token
    prompt."""
    fake_vllm.hold = asyncio.Event()
    queue = guard.guard.admission.queue
    async with aiohttp.ClientSession() as s:
        async def send(prompt: str, sent_headers: dict[str, str]) -> None:
            async with s.post(guard.url + "/v1/completions", headers=sent_headers,
                              json={"prompt": prompt, "max_tokens": 5}) as r:
                assert r.status == 200, await r.text()

        tasks = [asyncio.create_task(send("blocker", blocker or {}))]
        await until(lambda: guard.guard.admission.scheduler.running == 1, "the blocker dispatched")
        for i, (prompt, sent_headers) in enumerate(queued):
            tasks.append(asyncio.create_task(send(prompt, sent_headers)))
            await until(lambda n=i + 1: len(queue) == n, f"{i + 1} requests queued")  # arrival order fixed
        fake_vllm.hold.set()
        await asyncio.gather(*tasks)
    order = [b["prompt"] for b in fake_vllm.seen_bodies]
    assert order[0] == "blocker"
    return order[1:]


async def test_a_quiet_tenant_is_served_between_a_flooding_tenants_requests(guard_factory, fake_vllm):
    guard = await guard_factory(maxConcurrency=1)
    flood = [(f"a{i}", headers("flood")) for i in range(8)]
    quiet = [(f"b{i}", headers("quiet")) for i in range(2)]
    order = await served_order(guard, fake_vllm, flood + quiet, blocker=headers("flood"))
    # Equal service while both wait: the quiet tenant's two among the first four, not after the eight.
    assert {"b0", "b1"} <= set(order[:4]), order
    assert guard.guard.admission.tenants.tenants() == ["flood", "quiet"]


async def test_without_tenant_headers_a_class_is_first_come_first_served(guard_factory, fake_vllm):
    guard = await guard_factory(maxConcurrency=1)
    queued = [(f"a{i}", {}) for i in range(8)] + [(f"b{i}", {}) for i in range(2)]
    order = await served_order(guard, fake_vllm, queued)
    assert order == [prompt for prompt, _ in queued]
    assert len(guard.guard.admission.tenants) == 0       # everyone is the one unknown tenant


async def test_weights_two_to_one_are_served_two_to_one(guard_factory, fake_vllm):
    guard = await guard_factory(maxConcurrency=1)
    heavy = [(f"h{i}", headers("heavy", "2")) for i in range(6)]
    light = [(f"l{i}", headers("light", "1")) for i in range(6)]
    order = await served_order(guard, fake_vllm, heavy + light, blocker=headers("other"))
    # Each request costs the same (1 prompt token, 5 answer tokens): while both wait, heavy gets two for
    # light's one.
    assert Counter(p[0] for p in order[:9]) == {"h": 6, "l": 3}, order


async def test_an_invalid_weight_counts_as_one(guard_factory, fake_vllm):
    guard = await guard_factory(maxConcurrency=1)
    bogus = [(f"h{i}", headers("heavy", "lots")) for i in range(4)]
    light = [(f"l{i}", headers("light")) for i in range(4)]
    order = await served_order(guard, fake_vllm, bogus + light, blocker=headers("other"))
    assert Counter(p[0] for p in order[:4]) == {"h": 2, "l": 2}, order


async def test_a_flood_of_made_up_tenant_names_keeps_the_guards_state_bounded(guard_factory, fake_vllm):
    guard = await guard_factory(maxConcurrency=1)
    admission = guard.guard.admission
    admission.tenants = TenantKeys(admission.queue.weigh, admission.queue.forget, capacity=4)

    def kept() -> set[str]:
        return admission.queue.tenants() | set(admission.tenants.tenants())

    # Ten names at once while all wait: four keep their name, the rest share the unknown tenant's key.
    order = await served_order(guard, fake_vllm, [(f"r{i}", headers(f"made-up-{i}")) for i in range(10)])
    assert sorted(order) == sorted(f"r{i}" for i in range(10))   # every one served
    assert len(admission.tenants) == 4 and len(kept() - {UNKNOWN_TENANT}) <= 4
    # Later names take the places of idle ones: the state stays bounded however many names come.
    fake_vllm.seen_bodies.clear()
    await served_order(guard, fake_vllm, [(f"s{i}", headers(f"other-{i}")) for i in range(10)])
    assert admission.tenants.tenants() == [f"other-{i}" for i in range(4)]
    assert len(kept() - {UNKNOWN_TENANT}) <= 4, kept()
