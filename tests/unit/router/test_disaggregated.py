"""A disaggregated service behind the router, against in-process stand-ins for
its guards: each request is prefilled on a prefill replica (one token, not
streamed, vLLM's remote-decode parameters), then sent as the client sent it
to a decode replica with what the prefill returned, and decode's answer
streams to the client. A prefill that is missing, refused, unreachable,
failing or slow is skipped (decode computes the prompt), never waited on."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gpufleet_router.policy.handoff import PREFILL_PARAMS
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route
from gpufleet_router.server import RouterSettings
from tests.support.waiting import wait_for
from tests.unit.router.test_server import MODEL, FakeGuard, Harness, completion, wait_held

HANDED = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p1",
          "remote_block_ids": [4, 5, 6], "remote_host": "10.0.0.7", "remote_port": 5600}


class FakePrefill(FakeGuard):
    """A prefill replica's guard: answers whole, with the hand-off it was told to return."""

    def __init__(self, name: str, params: dict | None = HANDED):
        super().__init__(name)
        self.params = params
        self.fail_with: int | None = None       # answer this status (not a refusal)
        self.hang = False                       # never answer (until the request is cancelled)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        if self.refuse_with:
            status, retry_after = self.refuse_with
            return web.json_response({"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                                "code": "kv_watermark"}}, status=status,
                                     headers={"Retry-After": str(retry_after)})
        if self.fail_with:
            return web.json_response({"error": {"message": "engine failed", "type": "server_error",
                                                "param": None, "code": None}}, status=self.fail_with)
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        answer = {"id": "cmpl-p", "object": "text_completion", "model": MODEL,
                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                  "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}}
        if self.params is not None:
            answer["kv_transfer_params"] = self.params
        return web.json_response(answer)


class PD:
    """Two prefill and two decode replicas of one service behind a router."""

    def __init__(self, harness: Harness, prefill: list[FakePrefill], decode: list[FakeGuard]):
        self.h = harness
        self.prefill = {g.name: g for g in prefill}
        self.decode = {g.name: g for g in decode}

    def route(self, prefill: list[str] | None = None, decode: list[str] | None = None,
              unified: tuple[Replica, ...] = (), serving: dict[str, bool] | None = None) -> Route:
        def pool(guards: dict, names: list[str] | None) -> tuple[Replica, ...]:
            return tuple(Replica(n, guards[n].address, (serving or {}).get(n, True))
                         for n in (guards if names is None else names))
        return Route(namespace="ml", service=MODEL, model=MODEL, block_size=16, min_replicas=1, max_replicas=2,
                     replicas=unified, prefill=pool(self.prefill, prefill), decode=pool(self.decode, decode))

    def publish(self, route: Route) -> None:
        self.h.publish([route])

    def sent(self, guards: dict) -> list[dict]:
        return [b for g in guards.values() for b in g.bodies]

    def count(self, name: str, **labels) -> float:
        return self.h.count(name, **labels)


@pytest.fixture
async def pd():
    prefill = [await FakePrefill(n).start() for n in ("p1", "p2")]
    decode = [await FakeGuard(n).start() for n in ("d1", "d2")]
    h = Harness(prefill + decode, RouterSettings(prefix_blocks=4, prefill_timeout=5.0))
    await h.server.start_server()
    setup = PD(h, prefill, decode)
    setup.publish(setup.route())
    await h.fleet.read_once(h.http)
    yield setup
    await h.client.close()
    await h.http.close()
    await h.server.close()
    for g in prefill + decode:
        g.release.set()
        await g.server.close()


async def test_a_request_is_prefilled_then_decoded_with_the_hand_off(pd):
    payload = completion("Tell me a story. " * 10, stream=True, stream_options={"include_usage": True})
    async with pd.h.post(payload, headers={"Authorization": "Bearer t"}) as r:
        assert r.status == 200 and r.headers["X-Replica"] in pd.decode
        assert await r.read() == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    [prefilled] = pd.sent(pd.prefill)
    assert prefilled == {**{k: v for k, v in payload.items() if k != "stream_options"}, "max_tokens": 1,
                         "min_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    [decoded] = pd.sent(pd.decode)
    # Streamed as asked, with vLLM's per-chunk usage (how resumption counts the tokens sent; resume.py).
    assert decoded == {**payload, "kv_transfer_params": HANDED,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    prefill_guard = next(g for g in pd.prefill.values() if g.bodies)
    assert prefill_guard.headers[0]["Authorization"] == "Bearer t"
    assert prefill_guard.headers[0]["Accept-Encoding"] == "identity"
    assert pd.decode[r.headers["X-Replica"]].headers[0]["Authorization"] == "Bearer t"
    assert pd.count("gpufleet_router_handoffs_total", model=MODEL, transfer_params="returned") == 1
    assert pd.count("gpufleet_router_prefill_seconds_count", model=MODEL) == 1
    assert pd.count("gpufleet_router_picks_total", model=MODEL, role="prefill", reason="prefix_placed") == 1
    assert pd.count("gpufleet_router_picks_total", model=MODEL, role="decode", reason="kv_free") == 1
    assert pd.count("gpufleet_router_requests_total", model=MODEL, outcome="ok") == 1
    assert pd.count("gpufleet_router_replicas", model=MODEL, role="prefill") == 2
    assert pd.count("gpufleet_router_replicas", model=MODEL, role="decode") == 2


async def test_without_returned_params_decode_gets_the_clients_request_with_null_params(pd):
    # The shared-storage connector returns none: it finds the KV by the prompt.
    for g in pd.prefill.values():
        g.params = None
    payload = {"model": MODEL, "max_completion_tokens": 12, "messages": [{"role": "user", "content": "Hi"}]}
    async with pd.h.post(payload, route="/v1/chat/completions") as r:
        assert r.status == 200
        await r.read()
    [prefilled] = pd.sent(pd.prefill)
    assert (prefilled["max_tokens"], prefilled["max_completion_tokens"], prefilled["min_tokens"]) == (1, 1, 1)
    # null, as vllm-router sends it: the decode pod's guard admits it as a hand-off.
    assert pd.sent(pd.decode) == [{**payload, "kv_transfer_params": None}]
    assert pd.count("gpufleet_router_handoffs_total", model=MODEL, transfer_params="none") == 1
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="error") == 0


async def test_decodes_stream_reaches_the_client_chunk_by_chunk(pd):
    for g in pd.decode.values():
        g.release.clear()
    async with pd.h.post(completion(stream=True)) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        # The decode replica holds its second chunk until told: the first must already be here.
        assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5) == b'data: {"n": 1}\n\n'
        pd.decode[r.headers["X-Replica"]].release.set()
        assert await r.read() == b'data: {"n": 2}\n\ndata: [DONE]\n\n'


async def test_the_prefill_replica_follows_the_prompts_prefix_and_decode_the_free_kv(pd):
    pd.decode["d1"].free, pd.decode["d2"].free = 10, 90
    await pd.h.fleet.read_once(pd.h.http)
    system = "You are a terse assistant for the billing team. " * 10
    for i in range(5):
        async with pd.h.post({"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]},
                route="/v1/chat/completions") as r:
            assert r.status == 200 and r.headers["X-Replica"] == "d2"
            await r.read()
    assert sorted(len(g.bodies) for g in pd.prefill.values()) == [0, 5]
    assert pd.count("gpufleet_router_picks_total", model=MODEL, role="prefill", reason="prefix_affinity") == 4
    assert pd.count("gpufleet_router_prefix_affinity_hits_total", model=MODEL) == 4


async def test_a_refused_prefill_is_retried_on_the_other_prefill_replica(pd):
    # A prompt shorter than a block has no prefix: the prefill replica with more free KV is tried first.
    pd.prefill["p1"].free, pd.prefill["p2"].free = 90, 10
    pd.prefill["p1"].refuse_with = (429, 2)
    await pd.h.fleet.read_once(pd.h.http)
    async with pd.h.post(completion()) as r:
        assert r.status == 200
        await r.read()
    assert len(pd.prefill["p1"].bodies) == len(pd.prefill["p2"].bodies) == 1
    assert pd.sent(pd.decode) == [{**completion(), "kv_transfer_params": HANDED}]
    assert pd.count("gpufleet_router_retries_total", model=MODEL, role="prefill", reason="rejected") == 1
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="refused") == 0


async def test_prefill_refused_everywhere_falls_back_to_decode_without_a_hand_off(pd):
    for g in pd.prefill.values():
        g.refuse_with = (429, 2)
    async with pd.h.post(completion()) as r:
        assert r.status == 200
        await r.read()
    assert len(pd.sent(pd.prefill)) == 2
    assert pd.sent(pd.decode) == [completion()]
    assert pd.count("gpufleet_router_retries_total", model=MODEL, role="prefill", reason="rejected") == 1
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="refused") == 1
    assert pd.count("gpufleet_router_handoffs_total", model=MODEL, transfer_params="returned") == 0


async def test_a_prefill_that_answers_an_error_is_not_retried_and_decode_computes_the_prompt(pd):
    for g in pd.prefill.values():
        g.fail_with = 500
    async with pd.h.post(completion()) as r:
        assert r.status == 200
        await r.read()
    assert len(pd.sent(pd.prefill)) == 1 and pd.sent(pd.decode) == [completion()]
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="error") == 1


async def test_unreachable_prefill_replicas_fall_back_to_decode(pd):
    pd.publish(Route(namespace="ml", service=MODEL, model=MODEL, block_size=16, min_replicas=1, max_replicas=2,
                     replicas=(), prefill=(Replica("p-dead", "127.0.0.1:1"), Replica("p-dead2", "127.0.0.1:1")),
                     decode=(Replica("d1", pd.decode["d1"].address),)))
    async with pd.h.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "d1"
        await r.read()
    assert pd.count("gpufleet_router_retries_total", model=MODEL, role="prefill", reason="connect_failed") == 1
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="unreachable") == 1


async def test_a_slow_prefill_is_abandoned_at_the_timeout_and_its_request_cancelled(pd):
    pd.h.settings.prefill_timeout = 0.3
    for g in pd.prefill.values():
        g.hang = True
    async with pd.h.post(completion()) as r:
        assert r.status == 200
        await r.read()
    assert pd.sent(pd.decode) == [completion()]
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="timeout") == 1
    # The router closed the prefill's connection, which is what tells a guard (and vLLM) to stop.
    hung = next(g for g in pd.prefill.values() if g.bodies)
    await asyncio.wait_for(hung.cancelled.wait(), 30)
    assert pd.h.fleet.picker(MODEL, "prefill").in_flight == {}


async def test_with_no_prefill_replica_ready_decode_takes_the_request_at_once(pd):
    pd.publish(pd.route(serving={"p1": False, "p2": False}))
    async with pd.h.post(completion()) as r:
        assert r.status == 200
        await r.read()
    assert pd.sent(pd.prefill) == [] and pd.sent(pd.decode) == [completion()]
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="no_prefill_replica") == 1
    assert pd.count("gpufleet_router_held_total", namespace="ml", service=MODEL) == 0


async def test_with_no_decode_replica_ready_the_request_is_held_then_prefilled_and_decoded(pd):
    pd.publish(pd.route(serving={"d1": False, "d2": False}))

    async def send() -> bytes:
        async with pd.h.post(completion("held")) as r:
            assert r.status == 200
            return await r.read()
    held = asyncio.create_task(send())
    await wait_held(pd.h, 1)
    assert pd.sent(pd.prefill) == []     # not prefilled while no decode replica could take it
    pd.publish(pd.route())
    await asyncio.wait_for(held, 10)
    assert len(pd.sent(pd.prefill)) == 1 and pd.sent(pd.decode)[0]["kv_transfer_params"] == HANDED
    assert pd.count("gpufleet_router_cold_start_seconds_count", namespace="ml", service=MODEL) == 1


async def test_a_refused_decode_is_retried_on_the_other_decode_replica_with_the_same_hand_off(pd):
    pd.decode["d1"].free, pd.decode["d2"].free = 90, 10
    pd.decode["d1"].refuse_with = (429, 3)
    await pd.h.fleet.read_once(pd.h.http)
    async with pd.h.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "d2"
        await r.read()
    assert pd.decode["d1"].bodies == pd.decode["d2"].bodies == [{**completion(), "kv_transfer_params": HANDED}]
    assert len(pd.sent(pd.prefill)) == 1
    assert pd.count("gpufleet_router_retries_total", model=MODEL, role="decode", reason="rejected") == 1


async def test_decode_refused_everywhere_at_max_replicas_passes_the_429_on(pd):
    for g in pd.decode.values():
        g.refuse_with = (429, 4)
    async with pd.h.post(completion()) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "4"
        await r.read()
    assert pd.count("gpufleet_router_requests_total", model=MODEL, outcome="rejected") == 1


async def test_while_a_service_turns_into_pools_its_unified_replicas_serve_until_a_decode_one_is_ready(pd):
    unified = await FakeGuard("u1").start()
    try:
        pd.publish(pd.route(unified=(Replica("u1", unified.address),), serving={"d1": False, "d2": False}))
        async with pd.h.post(completion()) as r:
            assert r.status == 200 and r.headers["X-Replica"] == "u1"
            await r.read()
        assert pd.sent(pd.prefill) == [] and unified.bodies == [completion()]
        pd.publish(pd.route(unified=(Replica("u1", unified.address),)))
        async with pd.h.post(completion()) as r:
            assert r.headers["X-Replica"] in pd.decode
            await r.read()
        assert len(pd.sent(pd.prefill)) == 1 and len(unified.bodies) == 1
    finally:
        await unified.server.close()


async def test_embeddings_of_a_disaggregated_service_go_to_decode_without_a_prefill(pd):
    payload = {"model": MODEL, "input": "some text"}
    async with pd.h.post(payload, route="/v1/embeddings") as r:
        assert r.status == 200
        await r.read()
    assert pd.sent(pd.prefill) == [] and pd.sent(pd.decode) == [payload]
    assert pd.count("gpufleet_router_prefill_fallbacks_total", model=MODEL, reason="no_prefill_replica") == 0


async def test_a_client_leaving_during_the_prefill_cancels_it_and_nothing_is_decoded(pd):
    for g in pd.prefill.values():
        g.hang = True
    r = asyncio.create_task(pd.h.post(completion()).__aenter__())
    await wait_for(lambda: pd.sent(pd.prefill), timeout=30, interval=0.01, what="the prefill sent")
    r.cancel()
    await asyncio.gather(r, return_exceptions=True)
    hung = next(g for g in pd.prefill.values() if g.bodies)
    await asyncio.wait_for(hung.cancelled.wait(), 30)
    await wait_for(lambda: pd.count("gpufleet_router_requests_total", model=MODEL, outcome="cancelled") >= 1,
                   timeout=30, interval=0.01, what="the cancelled request counted")
    assert pd.sent(pd.decode) == []
    assert pd.h.fleet.picker(MODEL, "prefill").in_flight == {}
