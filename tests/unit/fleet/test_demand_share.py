"""The operator hands what a service's replicas learned of their answers' lengths to the
replicas it adds (fleet/demand_share.py): read from the ready replicas, pooled, written as
demand.json in the guard ConfigMap by its own field manager, and only when it moved."""
from __future__ import annotations

import json
import types

from gpufleet.fleet import demand_share
from gpufleet.fleet.demand_share import SHARE_SECONDS, STARTING_SECONDS, DemandShare
from gpufleet.manifests.children import DEMAND_FIELD_MANAGER
from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.demand_prior import DemandPrior, KeyPrior
from tests.unit.fleet.test_service_loop import isvc, pod

KEY = ("/v1/chat/completions", "interactive")


class Kube:
    def __init__(self):
        self.applied: list[tuple[dict, str]] = []

    async def apply(self, obj, *, field_manager):
        self.applied.append((obj, field_manager))
        return obj


class Reader:
    def __init__(self):
        self.lengths: dict[str, tuple[int, ...]] = {}
        self.asked: list[str] = []

    async def demand(self, name, ip):
        self.asked.append(name)
        lengths = self.lengths.get(name)
        return DemandPrior((KeyPrior(*KEY, len(lengths), lengths),)) if lengths else None


def share():
    rt = types.SimpleNamespace(kube=Kube(), reader=Reader())
    return DemandShare(rt.kube, rt.reader, "ml", "chat"), rt


def written(rt) -> list[DemandPrior]:
    return [demand_prior.parse(json.loads(obj["data"][demand_prior.FILE_NAME])) for obj, _ in rt.kube.applied]


async def test_the_pooled_lengths_are_written_beside_guard_json_by_their_own_manager():
    s, rt = share()
    rt.reader.lengths = {"a": (10,) * 40, "b": (30,) * 40}
    body = isvc()
    start = 1000.0
    await s.tick(body, [pod("a"), pod("b")], [pod("a"), pod("b")], start)
    first = demand_share.first_look("chat", "ml", start)
    await s.tick(body, [pod("a"), pod("b")], [pod("a"), pod("b")], first)
    ((obj, manager),) = rt.kube.applied
    assert manager == DEMAND_FIELD_MANAGER != "gpufleet"
    assert obj["metadata"]["name"] == "chat-guard" and list(obj["data"]) == [demand_prior.FILE_NAME]
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-chat"
    (k,) = written(rt)[0].keys
    assert k.key == KEY and k.samples == 80 and k.mean == 20


async def test_unchanged_lengths_are_not_written_again_and_a_moved_mean_is():
    s, rt = share()
    rt.reader.lengths = {"a": (20,) * 40}
    body, ready = isvc(), [pod("a")]
    now = demand_share.first_look("chat", "ml", 0.0)
    s.first_look = now
    await s.tick(body, ready, ready, now)
    rt.reader.lengths = {"a": (21,) * 40}
    await s.tick(body, ready, ready, now + SHARE_SECONDS)
    assert len(rt.kube.applied) == 1
    rt.reader.lengths = {"a": (25,) * 40}
    await s.tick(body, ready, ready, now + SHARE_SECONDS / 2 * 3)   # not due yet
    assert len(rt.kube.applied) == 1
    await s.tick(body, ready, ready, now + 2 * SHARE_SECONDS)
    assert len(rt.kube.applied) == 2 and written(rt)[-1].keys[0].mean == 25


async def test_a_starting_replica_gets_the_freshest_lengths_sooner():
    s, rt = share()
    rt.reader.lengths = {"a": (20,) * 40}
    body, ready = isvc(), [pod("a")]
    s.first_look = 0.0
    await s.tick(body, ready, ready, 0.0)
    rt.reader.lengths = {"a": (60,) * 40}
    await s.tick(body, ready, [*ready, pod("new", ready=False)], STARTING_SECONDS - 1)
    assert len(rt.kube.applied) == 1                   # looked a moment ago
    await s.tick(body, ready, [*ready, pod("new", ready=False)], STARTING_SECONDS)
    assert len(rt.kube.applied) == 2 and written(rt)[-1].keys[0].mean == 60


async def test_nothing_learned_nothing_written_and_few_replicas_read():
    s, rt = share()
    ready = [pod(n) for n in "abcdef"]
    s.first_look = 0.0
    await s.tick(isvc(), ready, ready, 0.0)
    assert rt.kube.applied == [] and len(rt.reader.asked) == demand_share.READ_REPLICAS


def test_a_new_leaders_first_looks_spread_over_the_interval():
    offsets = {demand_share.first_look(f"svc-{i}", "ml", 0.0) for i in range(200)}
    assert min(offsets) >= 0 and max(offsets) < SHARE_SECONDS
    assert len({int(o) for o in offsets}) > SHARE_SECONDS / 2
