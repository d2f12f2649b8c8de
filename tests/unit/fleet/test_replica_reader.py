"""The replica reader over an injected transport: both endpoints of a pod are
read, and any failure (an error status, a replica too slow to answer) makes
the replica unreadable rather than idle."""
from __future__ import annotations

import asyncio
import json

import httpx

from gpufleet.fleet.scrape import ReplicaReader

VLLM = 'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_running{engine="0"} 2.0\n'
GUARD = 'gpufleet_guard_queue_depth{class="interactive"} 3.0\n'


def reader(handler, **kwargs) -> ReplicaReader:
    return ReplicaReader(transport=httpx.MockTransport(handler), guard_port=8080, engine_port=8000, **kwargs)


async def test_sample_reads_engine_and_guard_metrics():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text=VLLM if request.url.port == 8000 else GUARD)

    r = reader(handler)
    sample = await r.sample("chat-0", "10.0.0.7")
    await r.close()
    assert sample.ok and sample.kv_usage == 0.5 and sample.engine_running == 2 and sample.guard_queued == 3
    assert sorted(seen) == ["http://10.0.0.7:8000/metrics", "http://10.0.0.7:8080/metrics"]


async def test_error_status_makes_the_replica_unreadable():
    r = reader(lambda request: httpx.Response(503 if request.url.port == 8080 else 200, text=VLLM))
    sample = await r.sample("chat-0", "10.0.0.7")
    await r.close()
    assert not sample.ok and "answered 503" in sample.error


async def test_a_replica_slower_than_the_deadline_is_unreadable():
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1)  # a stalled body counts against the one deadline too
        return httpx.Response(200, text=VLLM)

    r = reader(handler, timeout=0.1)
    sample = await r.sample("chat-0", "10.0.0.7")
    await r.close()
    assert not sample.ok and "TimeoutError" in sample.error


async def test_audit_returns_the_guards_report():
    r = reader(lambda request: httpx.Response(200, text=json.dumps({"verdict": "OK"})))
    assert await r.audit("chat-0", "10.0.0.7") == ({"verdict": "OK"}, None)
    await r.close()
