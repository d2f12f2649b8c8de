"""The demo's clients behave as real ones, over real HTTP: a local aiohttp server answers 429 with
Retry-After, then streams; the client retries as the openai SDK does (2 retries, after the hint),
and an impatient user gives up on a first token that does not come (but not on a slow stream)."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from aiohttp import web

from gpufleet_dev.demo.comparison import fate
from gpufleet_dev.demo.load import ClientPolicy, EndpointLoad, retry_delay
from gpufleet_dev.demo.surge import SurgePlan, drive

HINT = 0.2  # seconds of Retry-After


class Server:
    """Refuses the first ``refusals`` requests (429, Retry-After ``hint`` unless None), then streams."""

    def __init__(self, refusals: int, hint: str | None = str(HINT), stall_after_first_token: float = 0.0):
        self.refusals, self.hint, self.stall = refusals, hint, stall_after_first_token
        self.requests = 0
        self.released = asyncio.Event()  # a stall of ``inf`` lasts until the test is over

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        assert body["stream"] is True
        if self.requests <= self.refusals:
            headers = {"Retry-After": self.hint} if self.hint is not None else {}
            return web.json_response({"error": {"message": "KV cache full", "code": "kv_watermark"}}, status=429,
                                     headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if self.stall == float("inf"):
            await self.released.wait()
        elif self.stall:
            await asyncio.sleep(self.stall)  # a slow stream, after its first token
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 2}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def serve(server: Server) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def ask(server: Server, policy: ClientPolicy | None = None):
    runner, url = await serve(server)
    try:
        load = EndpointLoad(kube=None, namespace="demo", service="chat", model="m", prompt_tokens=4, max_tokens=2)
        load.endpoints = [url]
        async with httpx.AsyncClient(trust_env=False) as http:
            return await load.one(http, policy or ClientPolicy())
    finally:
        server.released.set()
        await runner.cleanup()


async def test_a_refusal_then_served_on_a_retry_after_the_hint():
    server = Server(refusals=2)
    r = await ask(server)
    assert (r.status, r.tokens, r.refusals, r.attempts, server.requests) == (200, 2, 2, 3, 3)
    assert fate(r) == "completed"
    # TTFT counts from the user's first try: both waits of the hint are in it.
    assert r.ttft is not None and r.ttft >= 2 * HINT


async def test_two_retries_at_most_then_the_refusal_stands():
    server = Server(refusals=10)
    r = await ask(server)
    assert (r.status, r.refusals, r.attempts, server.requests, r.retry_after) == (429, 3, 3, 3, str(HINT))
    assert fate(r) == "refused" and r.ttft is None


async def test_an_impatient_user_gives_up_while_asked_to_come_back_later():
    server = Server(refusals=10, hint="30")
    r = await ask(server, ClientPolicy(patience=0.3, timeout=60))
    assert r.gave_up and not r.timed_out and fate(r) == "gave_up"
    assert (r.refusals, server.requests) == (1, 1)


async def test_patience_ends_at_the_first_token_a_slow_stream_is_read_to_its_end():
    server = Server(refusals=0, stall_after_first_token=0.6)
    r = await ask(server, ClientPolicy(patience=0.2, timeout=60))
    assert fate(r) == "completed" and not r.gave_up and r.tokens == 2


async def test_the_clients_timeout_ends_a_stream_that_does_not():
    server = Server(refusals=0, stall_after_first_token=float("inf"))
    r = await ask(server, ClientPolicy(patience=None, timeout=0.5))
    assert r.timed_out and not r.gave_up and fate(r) == "failed"


async def test_a_refusal_without_a_hint_is_retried_after_a_backoff_and_counted_apart():
    server = Server(refusals=1, hint=None)
    r = await ask(server)
    assert fate(r) == "completed" and (r.refusals, r.bare_refusals, r.attempts) == (0, 1, 2)


@pytest.mark.parametrize("hint, retries, expected", [("2", 0, 2.0), ("0.5", 1, 0.5), ("61", 0, None), (None, 3, None),
                                                     ("soon", 1, None)])
def test_the_wait_before_a_retry_is_the_openai_sdks(hint, retries, expected):
    wait = retry_delay(retries, hint, random.Random(1))
    if expected is not None:
        assert wait == expected
    else:  # 0.5 s doubling per retry, at most 8 s, less up to a quarter
        base = min(0.5 * 2 ** retries, 8.0)
        assert 0.75 * base <= wait <= base


def test_the_surge_plan_phases_and_its_impatient_share():
    plan = SurgePlan(clients=10, warmup_clients=2, warmup_seconds=10, surge_seconds=90)
    assert [plan.phase_at(t) for t in (0, 9.9, 10, 99.9, 100)] == [
        ("warm-up", 2), ("warm-up", 2), ("surge", 10), ("surge", 10), ("finish", 0)]
    impatient = [i for i in range(10) if plan.policy_of(i).patience is not None]
    assert impatient == [2, 5, 8] and plan.policy_of(0).max_retries == 2


async def test_a_surge_counts_the_requests_it_started_and_its_in_flight_ones_finish_first():
    """surge.drive over the real client and server: the surge's requests (all finished before it
    ends), then the next phase's, apart."""
    server = Server(refusals=3, stall_after_first_token=0.05)
    runner, url = await serve(server)
    load = EndpointLoad(kube=None, namespace="demo", service="chat", model="m", prompt_tokens=4, max_tokens=2)
    load.endpoints = [url]

    async def no_pods():
        return load.endpoints
    load.refresh_endpoints = no_pods  # type: ignore[method-assign]
    plan = SurgePlan(clients=3, warmup_clients=1, warmup_seconds=0.2, surge_seconds=0.6, tick_seconds=0.1)
    ticks: list[tuple[str, int]] = []

    async def tick(t: float, phase: str, clients: int) -> None:
        ticks.append((phase, clients))

    async def after(phase: dict) -> None:
        phase.update(name="lull", clients=1)
        while not any(r.started >= plan.load_seconds for r in load.results):
            await asyncio.sleep(0.05)
    try:
        run = await drive(load, plan, tick, after=after)
    finally:
        server.released.set()
        await runner.cleanup()
    assert run.results and all(r.started < plan.load_seconds for r in run.results)
    assert all(r.finished <= (run.ended_at - run.started_at) + 0.01 for r in run.results)
    assert run.later and all(r.started >= plan.load_seconds for r in run.later)
    assert ("warm-up", 1) in ticks and ("surge", 3) in ticks
    assert sum(r.refusals for r in run.results) == 3 and all(fate(r) == "completed" for r in run.results)
