"""The router's budget of request-body bytes held at once (--body-budget-bytes, gpufleet_kit.body_budget):
100 concurrent 8 MiB bodies get 503s with Retry-After while the router stays under its memory limit, the
bodies that fit are served, and the budget comes back to zero however a request ends (served, refused, too
large, the client gone mid-body, a handler that failed). And the relay's cap on one stream event: a replica
that sends an event without end gets its stream ended with an error event, not a buffer that grows."""
from __future__ import annotations

import asyncio
import json
import tracemalloc

import aiohttp
import pytest
from aiohttp import web
from click.testing import CliRunner

from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_kit.body_budget import PIECE
from gpufleet_router.cli import router as router_command
from gpufleet_router.policy import resume
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.server import RouterSettings
from tests.support.body_burst import MIB, Burst, completion_body, pieces
from tests.support.waiting import wait_for
from tests.unit.router.test_server import MODEL, FakeGuard, Harness, completion, harness  # noqa: F401 (a fixture)

BODY = 8 * MIB                # the router's default --max-body-bytes: each body is as large as one may be
BUDGET = 64 * MIB             # room for 8 of them at once
CLIENTS = 100


class LeanGuard(FakeGuard):
    """A guard that reads each body to its end without keeping it and answers once ``hold`` is set: the
    memory measured is the router's, and requests stay in flight exactly as long as a test needs."""

    def __init__(self, name: str):
        super().__init__(name)
        self.hold = asyncio.Event()
        self.hold.set()
        self.received = 0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        async for _ in request.content.iter_chunked(1 << 16):
            pass
        self.received += 1
        await self.hold.wait()
        return web.json_response({"choices": [{"index": 0, "text": "ok"}], "usage": {"completion_tokens": 1}})


@pytest.fixture
async def lean():
    guard = await LeanGuard("a").start()
    h = Harness([guard], RouterSettings(body_budget_bytes=BUDGET))
    await h.server.start_server()
    h.publish([h.route(Replica("a", guard.address))])
    await h.fleet.read_once(h.http)
    yield h, guard
    guard.hold.set()
    await h.client.close()
    await h.http.close()
    await h.server.close()
    await guard.server.close()


def assert_refused_for_the_budget(answer) -> None:
    assert answer.status == 503 and answer.retry_after is not None and int(answer.retry_after) >= 1
    assert answer.error["code"] == Reason.BODY_BUDGET and answer.error["type"] == "service_unavailable"
    assert f"budget of {BUDGET} bytes" in answer.error["message"]
    assert "--body-budget-bytes" in answer.error["message"] and "router.bodyBudgetBytes" in answer.error["message"]


async def test_100_concurrent_8_mib_bodies_get_503s_while_the_router_stays_under_its_memory_limit(lean):
    h, guard = lean
    budget = h.router.body_budget
    body = completion_body(BODY, MODEL)
    guard.hold.clear()          # the bodies that fit stay held until every other answer is back
    fit = BUDGET // BODY
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        async with Burst(h.url + "/v1/completions", body, CLIENTS) as burst:
            await wait_for(lambda: len(burst.answers) == CLIENTS - fit and guard.received == fit, timeout=120,
                           what="every body past the budget refused and the ones that fit at the guard",
                           describe=lambda: (burst.statuses(), guard.received, budget.held))
            assert budget.held == fit * BODY
            guard.hold.set()
            answers = await burst.done()
        _, peak = tracemalloc.get_traced_memory()
        print(f"router: peak allocated {peak / MIB:.0f} MiB for {CLIENTS} bodies of {BODY / MIB:g} MiB, "
              f"budget {BUDGET / MIB:g} MiB")
    finally:
        tracemalloc.stop()
    refused = [a for a in answers if a.status != 200]
    assert len(refused) == CLIENTS - fit and sum(a.status == 200 for a in answers) == fit
    for answer in refused:
        assert_refused_for_the_budget(answer)
    assert budget.held == 0 and budget.peak <= BUDGET
    # What the router allocated while 800 MiB arrived: the bodies that fit (read, parsed, sent on), not 100 of
    # them. The parsed prompt and the copy the send to the guard queues are about a body each again.
    assert peak < 3 * BUDGET + 32 * MIB, f"peak {peak / MIB:.0f} MiB"
    assert h.count("gpufleet_router_body_budget_refusals_total") == CLIENTS - fit
    assert h.count("gpufleet_router_requests_total", model="", outcome="unavailable") == CLIENTS - fit
    assert h.count("gpufleet_router_requests_total", model=MODEL, outcome="ok") == fit
    assert h.count("gpufleet_router_body_bytes_held") == 0


async def test_chunked_bodies_are_counted_while_they_arrive_and_the_budget_is_never_passed(lean):
    h, guard = lean
    budget = h.router.body_budget
    async with Burst(h.url + "/v1/completions", completion_body(BODY, MODEL), 20, declare=False) as burst:
        answers = await burst.done()
    served = [a for a in answers if a.status == 200]
    assert served, "some bodies fit and were served"
    for answer in answers:
        if answer.status != 200:
            assert_refused_for_the_budget(answer)
    # Counted piece by piece before each piece is held: never more than the budget, whatever interleaving.
    assert budget.peak <= BUDGET and budget.held == 0
    assert guard.received == len(served)


async def test_a_client_gone_mid_body_gives_its_bytes_back(lean):
    h, guard = lean
    budget = h.router.body_budget
    body = completion_body(BODY, MODEL)
    for declare in (True, False):
        headers = {"Content-Length": str(len(body))} if declare else {}
        with pytest.raises((aiohttp.ClientError, ConnectionAbortedError)):
            async with h.client.post(h.url + "/v1/completions", data=pieces(body, stop_after=2 * MIB),
                                     headers=headers) as r:
                await r.read()
        held_at_most = BODY if declare else 2 * MIB - PIECE   # declared: counted whole before it is read
        await wait_for(lambda held_at_most=held_at_most: budget.peak >= held_at_most and budget.held == 0, timeout=10,
                       what="the body cut off counted, then its bytes given back",
                       describe=lambda: (budget.peak, budget.held))
        budget.peak = 0
    assert guard.received == 0


async def test_a_body_over_the_per_request_limit_stays_413_and_holds_nothing(lean):
    h, _ = lean
    budget = h.router.body_budget
    too_big = completion_body(BODY + 1, MODEL)
    for declare in (True, False):
        headers = {"Content-Length": str(len(too_big))} if declare else {}
        async with h.client.post(h.url + "/v1/completions", data=pieces(too_big), headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
        assert budget.held == 0
    assert h.count("gpufleet_router_body_budget_refusals_total") == 0


async def test_a_handler_that_fails_gives_the_bytes_back(lean, monkeypatch):
    h, _ = lean

    async def broken(call):
        raise RuntimeError("a bug past the read")
    monkeypatch.setattr(h.router.forwarder, "forward", broken)
    async with h.post(completion()) as r:
        assert r.status == 500
    assert h.router.body_budget.held == 0 and h.router.body_budget.peak > 0


async def test_a_body_that_fits_again_is_served_after_the_burst(lean):
    h, _ = lean
    h.router.body_budget.limit = 1000
    async with h.post(completion(prompt="x" * 2000)) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
    async with h.post(completion(prompt="short")) as r:
        assert r.status == 200
    assert h.router.body_budget.held == 0


def test_a_budget_under_the_per_request_limit_is_refused_at_start():
    result = CliRunner().invoke(router_command, ["--max-body-bytes", "1000", "--body-budget-bytes", "999"])
    assert result.exit_code == 2
    assert "--body-budget-bytes" in result.output and "--max-body-bytes" in result.output


# --- the relay's cap on one event ------------------------------------------------------------------------


def test_an_event_without_end_is_cut_at_the_cap_and_never_held_past_it():
    stream = resume.Stream({"model": MODEL, "prompt": "hi", "stream": True}, "/v1/completions")
    assert stream.feed(b'data: {"id": "c", "choices": [{"index": 0, "text": "a"}]}\n\n')
    piece = b"x" * (64 << 10)
    out: list[bytes] = []
    fed = 0
    while not stream.overflowed:
        out += stream.feed(piece)
        fed += len(piece)
        assert len(stream._buffer) <= resume.MAX_EVENT_BYTES + len(piece)
    assert fed <= resume.MAX_EVENT_BYTES + len(piece)
    error = json.loads(out[0].split(b"\n\n")[0][len(b"data: "):])["error"]
    assert error["code"] == resume.Code.EVENT_TOO_LONG and str(resume.MAX_EVENT_BYTES) in error["message"]
    assert out[0].endswith(resume.DONE) and stream.done and stream.why_not() is not None
    assert stream.feed(piece + b"\n\n") == [] and stream._buffer == b""


async def test_a_replica_streaming_an_endless_event_gets_its_stream_ended_with_an_error_event(harness):  # noqa: F811
    endless = b"data: " + b"x" * (3 * resume.MAX_EVENT_BYTES)
    for g in harness.guards.values():
        g.chunks = [b'data: {"id": "c", "choices": [{"index": 0, "text": "a"}]}\n\n', endless]
    async with harness.post(completion(stream=True)) as r:
        assert r.status == 200
        received = await r.read()
    events = received.split(b"\n\n")
    assert events[0].startswith(b'data: {"id"')
    error = json.loads(events[1][len(b"data: "):])["error"]
    assert error["code"] == resume.Code.EVENT_TOO_LONG
    assert received.endswith(resume.DONE) and len(received) < resume.MAX_EVENT_BYTES
    assert harness.count("gpufleet_router_requests_total", model=MODEL, outcome="error") == 1
