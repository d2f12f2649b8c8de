"""The operator's reads of guards and routers, against real local servers that answer 100 MiB (streamed,
never held): each read stops at its cap (http_limits) and the replica is reported unreadable, naming it
and the cap, instead of being read into memory."""
from __future__ import annotations

import pytest

from gpufleet.fleet.router_demand import RouterDemand
from gpufleet.fleet.scrape import ReplicaReader
from gpufleet_api.guard.adapters import ADAPTERS_PATH
from gpufleet_api.guard.demand_prior import DEMAND_PATH
from gpufleet_kit.http_limits import JSON_REPLY_CAP, METRICS_REPLY_CAP
from tests.support.huge_reply import MIB, HugeReply, serving


@pytest.fixture
async def huge_guard():
    """Every path a guard answers the operator, each with 100 MiB."""
    replies = {path: HugeReply(content_type="application/json" if path.startswith(("/a", "/d")) else "text/plain")
               for path in ("/metrics", "/metrics/engine", "/audit", DEMAND_PATH, ADAPTERS_PATH)}
    async with serving(replies) as server:
        yield server


def under_twice(written: int, cap: int) -> bool:
    return written < 2 * cap + 16 * MIB   # what the server got out: the cap, a piece and the sockets' buffers


async def test_a_replica_whose_metrics_answer_100_mib_is_unreadable(huge_guard):
    reader = ReplicaReader(guard_port=huge_guard.port, timeout=30)
    sample = await reader.sample("chat-0", "127.0.0.1")
    await reader.close()
    assert not sample.ok and "ReplyTooLarge" in sample.error and str(METRICS_REPLY_CAP) in sample.error
    assert f"127.0.0.1:{huge_guard.port}" in sample.error
    assert all(under_twice(huge_guard.replies[p].written, METRICS_REPLY_CAP) for p in ("/metrics", "/metrics/engine"))


async def test_a_replica_whose_json_replies_are_100_mib_is_unreadable(huge_guard):
    reader = ReplicaReader(guard_port=huge_guard.port, timeout=30)
    audit, why_audit = await reader.audit("chat-0", "127.0.0.1")
    adapters, why_adapters = await reader.adapters("chat-0", "127.0.0.1")
    demand = await reader.demand("chat-0", "127.0.0.1")
    await reader.close()
    assert audit is None and "ReplyTooLarge" in why_audit and str(JSON_REPLY_CAP) in why_audit
    assert adapters is None and "ReplyTooLarge" in why_adapters and ADAPTERS_PATH in why_adapters
    assert demand is None
    for path in ("/audit", DEMAND_PATH, ADAPTERS_PATH):
        assert under_twice(huge_guard.replies[path].written, JSON_REPLY_CAP), path


async def test_a_router_whose_metrics_answer_100_mib_holds_nothing(huge_guard, caplog):
    address = f"127.0.0.1:{huge_guard.port}"
    demand = RouterDemand(pods=None, publish=lambda held: None, addresses=[address], interval=30)
    assert await demand.read_once() == {}
    assert any("unreadable" in r.getMessage() and address in r.getMessage() for r in caplog.records)
    assert under_twice(huge_guard.replies["/metrics"].written, METRICS_REPLY_CAP)
