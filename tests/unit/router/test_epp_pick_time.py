"""The endpoint picker's own time per request, as a gateway sees it: from sending a request's headers and body
on its ext_proc stream to receiving the destination, over a local gRPC connection, four replicas, a chat trace
with shared system prompts (prefix affinity at work). Printed (p50/p99) for docs/gateway-epp.md; the bound
asserted is loose, so a slow machine does not fail it, and still catches a pick that blocks the loop."""
from __future__ import annotations

import json
import random
import statistics
import time

import pytest

from gpufleet_router.policy.replicas import Replica
from gpufleet_router.server import RouterSettings
from tests.support import epp as envoy
from tests.unit.router.test_server import MODEL, FakeGuard, Harness

REQUESTS = 400


@pytest.fixture
async def picker():
    guards = [await FakeGuard(n).start() for n in ("a", "b", "c", "d")]
    for g in guards:
        g.free = 100
    h = Harness(guards, RouterSettings(prefix_blocks=4, epp_secure=False, hold_timeout=0.0))
    h.publish([h.route(*(Replica(g.name, g.address) for g in guards))])
    await h.fleet.read_once(h.http)
    h.fleet.listed.set()
    async with envoy.epp(h.fleet) as (server, address), envoy.channel(address) as stub:
        h.stub = stub
        yield h
    await h.client.close()
    await h.http.close()
    for g in guards:
        await g.server.close()


async def test_the_pick_takes_about_a_millisecond(picker):
    rng = random.Random(7)
    systems = [f"You are assistant {i}. " + "Follow the policy carefully. " * 30 for i in range(8)]
    seconds = []
    for i in range(REQUESTS):
        body = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [
            {"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": f"Question {i}?"}]})
        stream = envoy.Stream(picker.stub)
        started = time.perf_counter()
        await stream.send(envoy.headers_message("/v1/chat/completions"), *envoy.body_messages(body.encode()))
        (first,) = await stream.expect()
        seconds.append(time.perf_counter() - started)
        assert first.WhichOneof("response") == "request_headers"
        await stream.send(envoy.response_headers_message(200), envoy.response_body_message(b"{}", True))
        await stream.expect(2 + -(-len(body) // 62000))
        await stream.close()
    own = picker.count("gpufleet_router_epp_pick_seconds_sum") / picker.count("gpufleet_router_epp_pick_seconds_count")
    cuts = statistics.quantiles(seconds, n=100)
    p50, p99 = cuts[49], cuts[98]
    print(f"\nendpoint picker, {REQUESTS} chat requests over local gRPC (plaintext), 4 replicas: "
          f"pick p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms (client and picker on one event loop); the "
          f"picker's own decision (gpufleet_router_epp_pick_seconds) mean {own * 1000:.3f} ms")
    assert picker.count("gpufleet_router_prefix_affinity_hits_total", model=MODEL) > REQUESTS / 2
    assert p50 < 0.25
