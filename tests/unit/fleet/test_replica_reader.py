"""The replica reader against a local guard endpoint serving its own metrics and
vLLM's (/metrics/engine): both are read, and any failure (an error status, a
replica too slow to answer) makes the replica unreadable rather than idle."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet.fleet.scrape import ReplicaReader

VLLM = 'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_running{engine="0"} 2.0\n'
GUARD = 'gpufleet_guard_queue_depth{class="interactive"} 3.0\n'


class Endpoint:
    def __init__(self, text: str):
        self.text, self.status = text, 200
        self.hanging = asyncio.Event()  # a replica that does not answer until this is set
        self.hanging.set()

    async def serve(self, _request):
        await self.hanging.wait()
        return web.Response(text=self.text, status=self.status)


async def audit(_request):
    return web.json_response({"verdict": "OK"})


@pytest.fixture
async def replica():
    """(vLLM's metrics, the guard's metrics), both on the one guard port."""
    engine, guard = Endpoint(VLLM), Endpoint(GUARD)
    app = web.Application()
    app.router.add_get("/metrics/engine", engine.serve)
    app.router.add_get("/metrics", guard.serve)
    app.router.add_get("/audit", audit)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    engine.server = guard.server = server
    yield engine, guard
    await server.close()


def reader_for(replica, **kwargs) -> ReplicaReader:
    return ReplicaReader(guard_port=replica[1].server.port, **kwargs)


async def test_sample_reads_engine_and_guard_metrics(replica):
    r = reader_for(replica)
    sample = await r.sample("chat-0", "127.0.0.1")
    await r.close()
    assert sample.ok and sample.kv_usage == 0.5 and sample.engine_running == 2 and sample.guard_queued == 3


async def test_error_status_makes_the_replica_unreadable(replica):
    replica[1].status = 503
    r = reader_for(replica)
    sample = await r.sample("chat-0", "127.0.0.1")
    await r.close()
    assert not sample.ok and "answered 503" in sample.error


async def test_a_replica_slower_than_the_timeout_is_unreadable(replica):
    replica[0].hanging.clear()          # vLLM's metrics never come
    r = reader_for(replica, timeout=0.1)
    sample = await r.sample("chat-0", "127.0.0.1")
    replica[0].hanging.set()
    await r.close()
    assert not sample.ok and "TimeoutError" in sample.error


async def test_audit_returns_the_guards_report(replica):
    r = reader_for(replica)
    assert await r.audit("chat-0", "127.0.0.1") == ({"verdict": "OK"}, None)
    await r.close()
