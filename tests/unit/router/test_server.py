"""The router's HTTP server against in-process stand-ins for guards: requests
go to the replica choice.py names, answers stream through chunk by chunk, a
refusal before any byte is retried once elsewhere, and bad requests get
OpenAI-format errors without reaching a replica."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.adapters import EMPTY, Catalog
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session
from tests.support.waiting import wait_for

MODEL = "tiny"


class FakeGuard:
    """A guard's surface: /metrics with its KV ledger, and the OpenAI routes."""

    def __init__(self, name: str):
        self.name = name
        self.free = 50
        self.ready = 1
        self.refuse_with: tuple[int, float] | None = None   # (status, Retry-After)
        self.refuse_code = "kv_watermark"                    # the error code of the refusal
        self.chunks = [b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n", b"data: [DONE]\n\n"]
        self.release = asyncio.Event()
        self.release.set()
        self.bodies: list[dict] = []
        self.peers: set = set()      # the router's connections that carried requests
        self.headers: list[dict] = []
        self.cancelled = asyncio.Event()
        self.server: TestServer | None = None
        self.adapters: dict[str, str] = {}   # LoRA adapter -> its state (gpufleet_guard_adapter_state)
        self.host = "127.0.0.1"

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"{self.host}:{self.server.port}"

    async def metrics(self, request: web.Request) -> web.Response:
        adapters = "".join(f'gpufleet_guard_adapter_state{{adapter="{name}",state="{state}"}} 1\n'
                           for name, state in self.adapters.items())
        return web.Response(text=f"gpufleet_guard_kv_free_blocks {self.free}\ngpufleet_guard_kv_reserved_blocks 0\n"
                                 f"gpufleet_guard_kv_total_blocks 100\ngpufleet_guard_kv_watermark_blocks 0\n"
                                 f"gpufleet_guard_ready {self.ready}\n{adapters}")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        self.peers.add(request.transport.get_extra_info("peername"))
        if self.refuse_with:
            status, retry_after = self.refuse_with
            return web.json_response({"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                                "code": self.refuse_code}}, status=status,
                                     headers={"Retry-After": str(retry_after)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Replica": self.name})
        await resp.prepare(request)
        try:
            for i, chunk in enumerate(self.chunks):
                await resp.write(chunk)
                if i == 0:
                    await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await resp.write_eof()
        return resp

    async def start(self, port: int | None = None, host: str = "127.0.0.1") -> FakeGuard:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        for route in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
            app.router.add_post(route, self.complete)
        self.host = host
        self.server = TestServer(app, host=host, port=port)
        await self.server.start_server()
        return self


class Harness:
    def __init__(self, guards: list[FakeGuard], settings: RouterSettings):
        self.guards = {g.name: g for g in guards}
        self.settings = settings
        self.metrics = RouterMetrics()
        self.fleet = Fleet(settings, self.metrics)
        self.http = client_session(settings)
        self.router = Router(self.fleet, self.http)
        self.server = TestServer(self.router.app(), host="127.0.0.1")
        self.client = aiohttp.ClientSession()

    def route(self, *replicas: Replica, model: str = MODEL) -> Route:
        return Route(namespace="ml", service=model, model=model, block_size=16, min_replicas=1, max_replicas=2,
                     replicas=replicas)

    def publish(self, routes: list[Route], adapters: Catalog = EMPTY) -> None:
        self.fleet.update(Table({r.model: r for r in routes}), adapters)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def post(self, payload, route: str = "/v1/completions", headers: dict | None = None):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.client.post(self.url + route, data=data,
                                headers={"Content-Type": "application/json", **(headers or {})})

    def count(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def harness():
    guards = [await FakeGuard(n).start() for n in ("a", "b")]
    h = Harness(guards, RouterSettings(prefix_blocks=4))
    await h.server.start_server()
    h.publish([h.route(*(Replica(g.name, g.address) for g in guards))])
    await h.fleet.read_once(h.http)
    yield h
    await h.client.close()
    await h.http.close()
    await h.server.close()
    for g in guards:
        g.release.set()
        await g.server.close()


def completion(prompt: str = "hello", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}


async def test_the_replica_with_more_free_kv_gets_the_request(harness):
    harness.guards["a"].free, harness.guards["b"].free = 10, 80
    await harness.fleet.read_once(harness.http)
    async with harness.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
        await r.read()
    assert harness.count("gpufleet_router_picks_total", model=MODEL, role="unified", reason="kv_free") == 1
    assert harness.count("gpufleet_router_requests_total", model=MODEL, outcome="ok") == 1


async def test_the_body_and_the_clients_headers_reach_the_replica_unchanged(harness):
    payload = completion(temperature=0.3, user="u1")
    async with harness.post(payload, headers={"X-Request-Class": "batch", "Authorization": "Bearer t"}) as r:
        await r.read()
    got = harness.guards[r.headers["X-Replica"]]
    assert got.bodies == [payload]
    assert got.headers[0]["X-Request-Class"] == "batch" and got.headers[0]["Authorization"] == "Bearer t"


async def test_a_stream_reaches_the_client_chunk_by_chunk(harness):
    for g in harness.guards.values():
        g.release.clear()
    async with harness.post(completion(stream=True)) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        # The replica holds its second chunk until told: the first must already be here.
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
        assert first == b'data: {"n": 1}\n\n'
        harness.guards[r.headers["X-Replica"]].release.set()
        rest = await r.read()
    assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'


async def test_a_client_that_leaves_mid_stream_cancels_the_replicas_request(harness):
    for g in harness.guards.values():
        g.release.clear()
    r = await harness.post(completion(stream=True))
    await r.content.readuntil(b"\n\n")
    guard = harness.guards[r.headers["X-Replica"]]
    r.close()
    await asyncio.wait_for(guard.cancelled.wait(), 30)
    # The router counts the cancelled request once its handler has unwound.
    await wait_for(lambda: harness.count("gpufleet_router_requests_total", model=MODEL, outcome="cancelled") >= 1,
                   timeout=30, interval=0.01, what="the cancelled request counted")
    assert harness.count("gpufleet_router_requests_total", model=MODEL, outcome="cancelled") == 1
    assert harness.fleet.picker(MODEL).in_flight == {}


async def test_a_429_is_retried_once_on_the_other_replica(harness):
    harness.guards["a"].free, harness.guards["b"].free = 90, 10
    harness.guards["a"].refuse_with = (429, 3)
    await harness.fleet.read_once(harness.http)
    async with harness.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
        await r.read()
    assert len(harness.guards["a"].bodies) == 1
    assert harness.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="rejected") == 1


@pytest.mark.parametrize("code", ["engine_down", "draining"])
async def test_a_replica_that_cannot_serve_is_not_the_answer_when_another_refused_for_capacity(harness, code):
    """A guard whose engine was just killed (or that is shutting down) answers 503 before the router's
    table knows: that says nothing about capacity, so the client gets the other replica's 429 (which it
    honours), not the 503 (an error), whichever replica was tried last."""
    harness.guards["a"].free, harness.guards["b"].free = 90, 10
    harness.guards["a"].refuse_with = (429, 2)
    harness.guards["b"].refuse_with = (503, 5)
    harness.guards["b"].refuse_code = code
    await harness.fleet.read_once(harness.http)
    async with harness.post(completion()) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "2"
        await r.read()
    assert len(harness.guards["a"].bodies) >= 1 and len(harness.guards["b"].bodies) >= 1


async def test_a_replica_whose_engine_is_down_passes_the_request_to_one_that_serves(harness):
    harness.guards["a"].free, harness.guards["b"].free = 90, 10
    harness.guards["a"].refuse_with = (503, 5)
    harness.guards["a"].refuse_code = "engine_down"
    await harness.fleet.read_once(harness.http)
    async with harness.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
        await r.read()
    assert harness.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="connect_failed") == 1


async def test_refused_by_every_replica_the_client_gets_429_with_the_earliest_hint(harness):
    harness.guards["a"].refuse_with = (429, 7)
    harness.guards["b"].refuse_with = (429, 2)
    async with harness.post(completion()) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "2"
        body = await r.json()
    assert body["error"]["code"] == "kv_watermark"
    assert len(harness.guards["a"].bodies) + len(harness.guards["b"].bodies) == 2
    assert harness.count("gpufleet_router_requests_total", model=MODEL, outcome="rejected") == 1


async def test_an_unreachable_replica_is_passed_over(harness):
    dead = Replica("a-dead", "127.0.0.1:1")
    harness.publish([harness.route(dead, Replica("b", harness.guards["b"].address))])
    harness.guards["b"].free = 1
    await harness.fleet.read_once(harness.http)   # the dead one's read fails: its room is unknown
    harness.fleet.picker(MODEL).observe("b", None)  # neither read: the first try goes by name order, to the dead one
    async with harness.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
        await r.read()
    assert harness.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="connect_failed") == 1
    assert harness.count("gpufleet_router_readings_failed_total", model=MODEL) == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_request_no_replica_answered_goes_out_again_until_one_listens(harness):
    """A replica that does not take connections for a moment (its pod starved of CPU, or between its
    engine's death and its unready probe) while it is the only one: nothing was admitted, so the
    request is sent again instead of failing."""
    port = _free_port()
    harness.publish([harness.route(Replica("late", f"127.0.0.1:{port}"))])
    answer = asyncio.create_task(harness.client.post(harness.url + "/v1/completions",
                                                     data=json.dumps(completion()).encode(),
                                                     headers={"Content-Type": "application/json"}))
    await wait_for(lambda: harness.count("gpufleet_router_retries_total", model=MODEL, role="unified",
                                         reason="connect_failed") >= 1, timeout=10, what="a try sent again")
    late = await FakeGuard("late").start(port)
    try:
        r = await answer
        assert r.status == 200 and r.headers["X-Replica"] == "late"
        await r.read()
        r.release()
    finally:
        await late.server.close()


async def test_a_request_no_replica_answers_fails_with_502_once_its_retry_time_is_spent():
    h = Harness([], RouterSettings(unreachable_retry_timeout=0.6))
    await h.server.start_server()
    h.publish([h.route(Replica("dead", f"127.0.0.1:{_free_port()}"))])
    try:
        async with h.post(completion()) as r:
            assert r.status == 502 and r.headers["Retry-After"]
            assert (await r.json())["error"]["code"] == "replica_unreachable"
        assert h.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="connect_failed") >= 1
    finally:
        await h.client.close()
        await h.http.close()
        await h.server.close()


class _StalledFirstTry:
    """The router's client session, its first request made during a stall of ``seconds`` of the router's
    loop (counted where the loop-lag watcher counts it)."""

    def __init__(self, http, lag, seconds: float):
        self.http, self.lag, self.seconds = http, lag, seconds

    def post(self, *args, **kwargs):
        if self.seconds:
            self.lag.stalled, self.seconds = self.lag.stalled + self.seconds, 0.0
        return self.http.post(*args, **kwargs)


async def test_the_time_the_router_itself_did_not_run_does_not_count_against_a_retry_window():
    """A starved router (no CPU for seconds) judges connections late; its loop-lag watcher counts those
    seconds (``fleet.lag``), and the retry window ends that much later: the request is still tried, and
    answered once the replica listens, where a 0.6 s window of wall-clock time would have given a 502."""
    h = Harness([], RouterSettings(unreachable_retry_timeout=0.6))
    await h.server.start_server()
    port = _free_port()
    h.publish([h.route(Replica("late", f"127.0.0.1:{port}"))])
    late = None
    try:
        # The first try is made while the router has no CPU for 30 s, as its loop-lag watcher then records.
        h.router.forwarder.http = _StalledFirstTry(h.http, h.fleet.lag, 30.0)
        started = time.monotonic()
        answer = asyncio.create_task(h.client.post(h.url + "/v1/completions", data=json.dumps(completion()).encode(),
                                                   headers={"Content-Type": "application/json"}))
        # Past the nominal window (which alone would have ended the request with a 502 by now).
        await wait_for(lambda: time.monotonic() - started > 1.2, timeout=10, what="the nominal window passed")
        assert not answer.done(), "the request ended inside the router's own stall"
        late = await FakeGuard("late").start(port)
        r = await answer
        assert r.status == 200 and r.headers["X-Replica"] == "late"
        await r.read()
        r.release()
    finally:
        if late is not None:
            await late.server.close()
        await h.client.close()
        await h.http.close()
        await h.server.close()


async def test_a_draining_replica_takes_nothing(harness):
    harness.guards["a"].ready = 0
    harness.guards["a"].free = 99
    await harness.fleet.read_once(harness.http)
    for i in range(4):
        async with harness.post(completion(f"prompt {i} " * 40)) as r:
            assert r.headers["X-Replica"] == "b"
            await r.read()
    assert harness.count("gpufleet_router_replicas", model=MODEL, role="unified") == 1


async def test_requests_sharing_a_long_prefix_reach_one_replica(harness):
    system = "You are a terse assistant for the billing team. " * 10
    seen = set()
    for i in range(6):
        async with harness.post({"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]},
                route="/v1/chat/completions") as r:
            assert r.status == 200
            await r.read()
            if i:
                seen.add(r.headers["X-Replica"])
    assert len(seen) == 1
    assert harness.count("gpufleet_router_prefix_affinity_hits_total", model=MODEL) >= 5


async def test_models_lists_every_served_model(harness):
    harness.publish([harness.route(Replica("a", harness.guards["a"].address)), harness.route(model="other")])
    async with harness.client.get(harness.url + "/v1/models") as r:
        doc = await r.json()
    assert doc["object"] == "list" and [m["id"] for m in doc["data"]] == ["other", MODEL]


async def test_an_unknown_model_gets_404_listing_the_served_ones(harness):
    async with harness.post({"model": "gpt-9", "prompt": "x"}) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    # vLLM's answer for a model it does not serve, then what is served here.
    assert err["type"] == "NotFoundError" and err["code"] == 404 and err["param"] == "model"
    assert err["message"] == f"The model `gpt-9` does not exist. Served here: {MODEL}."
    assert harness.count("gpufleet_router_requests_total", model="", outcome="invalid") == 1
    assert harness.count("gpufleet_router_unknown_model_requests_total") == 1
    assert not any(g.bodies for g in harness.guards.values())


@pytest.mark.parametrize("payload, status, fragment", [
    (b"{oops", 400, "not valid JSON"),
    (json.dumps({"prompt": "x"}).encode(), 400, "no `model`"),
    (json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode(), 413, "over the router's limit"),
])
async def test_bad_requests_get_a_clear_4xx_and_never_reach_a_replica(payload, status, fragment):
    guard = await FakeGuard("a").start()
    h = Harness([guard], RouterSettings(max_body_bytes=4096))
    await h.server.start_server()
    h.publish([h.route(Replica("a", guard.address))])
    try:
        async with h.post(payload) as r:
            assert r.status == status
            err = (await r.json())["error"]
        assert fragment in err["message"] and err["type"] == "invalid_request_error"
        assert guard.bodies == []
        assert h.count("gpufleet_router_requests_total", model="", outcome="invalid") == 1
    finally:
        await h.client.close()
        await h.http.close()
        await h.server.close()
        await guard.server.close()


async def test_a_request_for_a_service_without_a_ready_replica_is_held_until_one_is_ready(harness):
    starting = Replica("a", harness.guards["a"].address, serving=False)
    harness.publish([harness.route(starting)])
    order = []

    async def send(i: int) -> None:
        async with harness.post(completion(f"held {i}")) as r:
            assert r.status == 200
            await r.read()
            order.append(i)

    first = asyncio.create_task(send(0))
    await wait_held(harness, 1)
    second = asyncio.create_task(send(1))
    await wait_held(harness, 2)
    assert not first.done()
    harness.publish([harness.route(Replica("a", harness.guards["a"].address))])   # the replica is Ready
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert [b["prompt"] for b in harness.guards["a"].bodies] == ["held 0", "held 1"]   # arrival order
    assert harness.count("gpufleet_router_held_requests", namespace="ml", service=MODEL) == 0
    assert harness.count("gpufleet_router_held_total", namespace="ml", service=MODEL) == 2
    assert harness.count("gpufleet_router_cold_start_seconds_count", namespace="ml", service=MODEL) == 1


async def wait_held(harness, n: int) -> None:
    await wait_for(lambda: harness.count("gpufleet_router_held_requests", namespace="ml", service=MODEL) == n,
                   timeout=30, interval=0.01, what=f"{n} held")


async def test_a_held_request_times_out_with_503_and_the_measured_cold_start_as_retry_after(harness):
    harness.settings.hold_timeout = 0.3
    harness.fleet.cold(MODEL).record(40.0)
    harness.publish([harness.route(Replica("a", harness.guards["a"].address, serving=False))])
    async with harness.post(completion()) as r:
        assert r.status == 503
        assert int(r.headers["Retry-After"]) == 40        # 40 s measured, 0.3 s waited: rounded up
        err = (await r.json())["error"]
    assert err["code"] == "no_ready_replica" and "became ready" in err["message"]
    assert harness.count("gpufleet_router_requests_total", model=MODEL, outcome="unavailable") == 1
    assert harness.fleet.held_count(MODEL) == 0


async def test_past_the_hold_limit_a_request_is_refused_at_once(harness):
    harness.settings.hold_max_requests = 1
    harness.publish([harness.route(Replica("a", harness.guards["a"].address, serving=False))])
    held = asyncio.create_task(harness.post(completion()).__aenter__())
    await wait_held(harness, 1)
    async with harness.post(completion()) as r:
        assert r.status == 503 and (await r.json())["error"]["code"] == "hold_queue_full"
        assert int(r.headers["Retry-After"]) >= 1
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)


async def test_readiness_waits_for_the_first_listing_and_ends_with_the_drain(harness):
    async with harness.client.get(harness.url + "/readyz") as r:
        assert r.status == 503
    harness.fleet.listed.set()
    async with harness.client.get(harness.url + "/readyz") as r:
        assert r.status == 200
    harness.fleet.draining = True
    async with harness.client.get(harness.url + "/readyz") as r:
        assert r.status == 503 and (await r.json())["reasons"] == ["draining"]
        assert r.headers["Connection"] == "close"


async def test_the_router_keeps_its_connections_to_a_replica_between_requests(harness):
    harness.guards["b"].ready = 0
    await harness.fleet.read_once(harness.http)
    for _ in range(4):
        async with harness.post(completion()) as r:
            assert r.headers["X-Replica"] == "a"
            await r.read()
    assert len(harness.guards["a"].peers) == 1


async def test_a_chunked_body_over_the_limit_gets_413(harness):
    harness.settings.max_body_bytes = 1000

    async def body():
        for _ in range(5):
            yield b"x" * 400
    async with harness.client.post(harness.url + "/v1/completions", data=body()) as r:
        assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"


async def test_a_client_that_honours_the_fleets_retry_after_is_served(harness):
    for g in harness.guards.values():
        g.refuse_with = (429, 1)
    async with harness.post(completion()) as r:
        assert r.status == 429
        wait = int(r.headers["Retry-After"])
        await r.read()
    for g in harness.guards.values():   # room by the time the hint said
        g.refuse_with = None
    await asyncio.sleep(min(wait, 1))
    async with harness.post(completion()) as r:
        assert r.status == 200
        await r.read()


async def test_unknown_paths_and_methods_get_openai_format_errors(harness):
    async with harness.client.post(harness.url + "/v1/fine_tuning/jobs", json={}) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["code"] == "not_found" and "/v1/chat/completions" in err["message"]
    async with harness.client.get(harness.url + "/v1/completions") as r:
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    assert harness.count("gpufleet_router_requests_total", model="", outcome="invalid") == 2


async def test_below_max_replicas_a_request_every_replica_refused_is_held_until_there_is_room(harness):
    # Two replicas of at most three: the refusals are shedding, a replica is coming; the router keeps
    # the request and tries again after the replicas' hint instead of passing the 429 on.
    a, b = harness.guards["a"], harness.guards["b"]
    harness.publish([Route(namespace="ml", service=MODEL, model=MODEL, block_size=16, min_replicas=1,
                           max_replicas=3, replicas=(Replica("a", a.address), Replica("b", b.address)))])
    await harness.fleet.read_once(harness.http)
    a.refuse_with = b.refuse_with = (429, 1)

    async def room_later():   # once both have refused it: the router is holding the request
        await wait_for(lambda: a.bodies and b.bodies, timeout=30, interval=0.01, what="both replicas refusing")
        b.refuse_with = None
    freed = asyncio.create_task(room_later())
    async with harness.post(completion()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
        await r.read()
    await freed
    assert harness.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="scale_out") >= 1
    assert harness.count("gpufleet_router_requests_total", model=MODEL, outcome="rejected") == 0


def test_shedding_holds_only_below_max_replicas_and_within_the_time_left():
    from gpufleet_router.policy.shedding import wait_before_retrying
    assert wait_before_retrying(2, 2, [3.0], 60) is None          # at max: the client gets the 429
    assert wait_before_retrying(1, 4, [3.0, 2.0], 60) == 2.0      # the earliest hint
    assert wait_before_retrying(1, 4, [], 60) == 1.0              # no hint: a second
    assert wait_before_retrying(1, 4, [30.0], 5) == 5             # never past the time left
    assert wait_before_retrying(1, 4, [3.0], 0.1) is None         # time is up
    assert wait_before_retrying(1, 4, [0.0], 60) == 0.2           # never a busy loop
