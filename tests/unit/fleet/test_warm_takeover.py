"""A follower keeps the autoscaler's state warm, and a new leader acts on it first.

The fleet loop runs against the in-memory API server with replicas whose reads
the tests count and can hold (a replica that does not answer): a follower reads
and writes nothing; on taking over, the service under pressure is scaled out
from what the follower read, while every read of the new term still hangs; with
a follower interval of 0 nothing is read before leading and the first action
waits for a read, as before.
"""
from __future__ import annotations

import asyncio
import collections

import pytest

from gpufleet.autoscale.signals import ReplicaSample
from gpufleet.fleet.fleet_loop import FleetLoop
from gpufleet.fleet.ports import ServicePorts
from gpufleet.manifests import names
from gpufleet.metrics import OperatorMetrics
from gpufleet.wiring.controller import Controller
from tests.support.fake_kube import FakeKube
from tests.unit.fleet.test_service_loop import deployment, isvc, make_loop, pod

HOT = ("ml", "hot")


class Reader:
    """Replica reads by pod name (``kv``; None: unreadable), counted; while ``held`` is set, a
    read waits until it is released (a replica that does not answer)."""

    def __init__(self, kv: dict[str, float | None]):
        self.kv = kv
        self.reads: collections.Counter[str] = collections.Counter()  # finished reads per pod
        self.started: collections.Counter[str] = collections.Counter()
        self.held: asyncio.Event | None = None
        self.audits = 0

    async def sample(self, pod_name: str, ip: str) -> ReplicaSample:
        self.started[pod_name] += 1
        if self.held is not None:
            await self.held.wait()
        self.reads[pod_name] += 1
        kv = self.kv.get(pod_name, 0.5)
        if kv is None:
            return ReplicaSample(pod=pod_name, ok=False, error="timeout")
        return ReplicaSample(pod=pod_name, ok=True, kv_usage=kv)

    async def audit(self, pod_name, ip):
        self.audits += 1
        return None, "not audited here"

    async def demand(self, pod_name, ip):
        return None


class Lead:
    """Leadership as the runtime gives it to the fleet loop."""

    def __init__(self):
        self.leading = False
        self._event = asyncio.Event()

    def acting(self) -> bool:
        return self.leading

    async def wait_leading(self) -> None:
        await self._event.wait()

    def lead(self) -> None:
        self.leading = True
        self._event.set()


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def fleet_of(kube: FakeKube, reader: Reader, n_calm: int, *, follow_interval: float, clock: Clock,
             concurrency: int = 64):
    """``hot`` (KV 95%, over the 80% watermark) and ``n_calm`` calm services, one ready replica each."""
    metrics = OperatorMetrics()
    controller = Controller(kube, metrics)
    ports = ServicePorts(events=kube, status=controller, locks=controller, objects=kube, replicas=reader,
                         metrics=metrics)
    lead = Lead()
    fleet = FleetLoop(ports, interval=1.0, follow_interval=follow_interval, leadership=lead, clock=clock,
                      concurrency=concurrency)
    for name in [*(f"calm-{i:02d}" for i in range(n_calm)), "hot"]:  # the hot one comes last by name
        body = isvc(desired=1, ready=1)
        body["metadata"].update(name=name, uid=f"u-{name}")
        dep = deployment(1, 1)
        dep["metadata"].update(name=f"{name}-engine", ownerReferences=[names.owner_reference(body)])
        kube.put(dep)
        fleet.upsert_service(kube.put(body))
        fleet.upsert_pod("ml", name, f"{name}-0", {"ip": "10.0.0.1", "ready": True, "deleting": False,
                                                  "marked": False})
        reader.kv.setdefault(f"{name}-0", 0.5)
    reader.kv["hot-0"] = 0.95
    return fleet, lead, metrics


async def until(check, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("not within the time allowed")
        await asyncio.sleep(0.01)


def scaled_out(kube: FakeKube, service: str) -> bool:
    return any(verb == "apply" and key == ("Deployment", "ml", f"{service}-engine") and body["spec"]["replicas"] > 1
               for verb, key, body in kube.writes)


def exported(metrics: OperatorMetrics, sample: str) -> list:
    return [s for family in metrics.registry.collect() for s in family.samples if s.name == sample]


async def stopped(fleet: FleetLoop, runner: asyncio.Task) -> None:
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    await fleet.stop()


async def test_a_follower_reads_every_replica_each_interval_and_writes_nothing():
    kube, clock = FakeKube(), Clock()
    reader = Reader({"calm-01-0": None})  # one replica does not answer
    fleet, _lead, metrics = fleet_of(kube, reader, 3, follow_interval=5.0, clock=clock)
    writes_before = list(kube.writes)
    runner = asyncio.create_task(fleet.run_forever())
    try:
        await until(lambda: all(reader.reads[f"{k[1]}-0"] == 1 for k in fleet.services))
        await asyncio.sleep(0.1)
        assert max(reader.started.values()) == 1  # not read again before the interval
        clock.t += 5.0
        fleet.wake()
        await until(lambda: all(reader.reads[f"{k[1]}-0"] == 2 for k in fleet.services))
    finally:
        await stopped(fleet, runner)
    assert kube.writes == writes_before and kube.events == []
    assert exported(metrics, "gpufleet_service_kv_usage_ratio") == []
    assert not [s for s in exported(metrics, "gpufleet_metrics_read_errors_total") if s.value]
    # What the leader would decide is known, and the evidence stays unanswered: the high clock runs
    # from the first reading, where a leader acting on it would have cleared it.
    warm = fleet.warm(HOT)
    assert warm is not None and warm.at == 105.0 and warm.judgement.decision is not None
    assert warm.judgement.decision.target == 2 and warm.judgement.decision.reason == "KVHighWatermark"
    assert fleet._loops[HOT].autoscaler.state.high_since == 100.0


@pytest.mark.parametrize("concurrency", [64, 1])
async def test_a_new_leader_scales_the_pressured_service_from_warm_state_before_any_read(concurrency):
    """With one tick at a time and no replica answering, the pressured service's turn must come first."""
    kube, clock = FakeKube(), Clock()
    reader = Reader({})
    fleet, lead, _metrics = fleet_of(kube, reader, 20, follow_interval=5.0, clock=clock, concurrency=concurrency)
    runner = asyncio.create_task(fleet.run_forever())
    try:
        await until(lambda: all(reader.reads[f"{k[1]}-0"] == 1 for k in fleet.services))
        reader.held = asyncio.Event()  # from now on no replica answers
        started = sum(reader.started.values())
        fleet.take_over()
        lead.lead()
        await until(lambda: scaled_out(kube, "hot"), timeout=5.0)
        assert kube.obj("InferenceService", "hot")["status"]["desiredReplicas"] == 2
        assert [e["involvedObject"]["name"] for e in kube.events if e["reason"] == "ScaledUp"] == ["hot"]
        assert reader.started["hot-0"] == 1, "the pressured service was read again before it was scaled"
        assert sum(reader.reads.values()) == len(fleet.services), "a read of the new term finished"
        await until(lambda: sum(reader.started.values()) > started)  # the calm services' first ticks read
        assert not fleet.first_pass.is_set() and not fleet.audits_allowed()
        reader.held.set()
        await until(fleet.first_pass.is_set)
    finally:
        await stopped(fleet, runner)
    assert not [k for k in kube.writes if k[1][0] == "Deployment" and k[1][2] != "hot-engine"]


async def test_with_a_follower_interval_of_0_nothing_is_read_before_leading_and_the_first_action_waits_for_a_read():
    kube, clock = FakeKube(), Clock()
    reader = Reader({})
    fleet, lead, _metrics = fleet_of(kube, reader, 3, follow_interval=0.0, clock=clock)
    runner = asyncio.create_task(fleet.run_forever())
    try:
        await asyncio.sleep(0.2)
        assert sum(reader.started.values()) == 0 and fleet.warm(HOT) is None
        reader.held = asyncio.Event()
        fleet.take_over()
        lead.lead()
        await until(lambda: reader.started["hot-0"] == 1)
        await asyncio.sleep(0.2)
        assert not scaled_out(kube, "hot")  # cold: the decision needs a read
        reader.held.set()
        await until(lambda: scaled_out(kube, "hot"))
    finally:
        await stopped(fleet, runner)


async def test_a_scale_out_the_old_leader_made_before_it_died_is_not_made_again():
    kube = FakeKube()
    kube.put(isvc(desired=1, ready=1))
    kube.put(deployment(1, 1))
    reader = Reader({"a": 0.95})
    loop = make_loop(kube, reader=reader)
    await loop.follow(kube.obj("InferenceService", "chat"), [pod("a")], now=100.0)
    assert loop.warm is not None and loop.warm.judgement.decision is not None
    # The old leader scaled to 2 after that reading; the new replica is still starting.
    body = kube.obj("InferenceService", "chat")
    body["status"].update(desiredReplicas=2, readyReplicas=1)
    kube.put(body)
    await loop.take_over(kube.obj("InferenceService", "chat"), [pod("a")], now=101.0, max_age=10.0)
    assert reader.started["a"] == 2  # read again instead
    assert kube.event_reasons() == [] and kube.obj("InferenceService", "chat")["status"]["desiredReplicas"] == 2


async def test_a_warm_reading_older_than_two_intervals_is_read_again_before_acting():
    kube = FakeKube()
    kube.put(isvc(desired=1, ready=1))
    kube.put(deployment(1, 1))
    reader = Reader({"a": 0.95})
    loop = make_loop(kube, reader=reader)
    await loop.follow(kube.obj("InferenceService", "chat"), [pod("a")], now=100.0)
    reader.kv["a"] = 0.5  # the surge is over by the time this replica leads
    await loop.take_over(kube.obj("InferenceService", "chat"), [pod("a")], now=111.0, max_age=10.0)
    assert reader.started["a"] == 2 and kube.event_reasons() == []
    assert kube.obj("InferenceService", "chat")["status"]["desiredReplicas"] == 1


async def test_a_follower_reads_nothing_of_a_manual_service():
    kube = FakeKube()
    kube.put(isvc(desired=1, ready=1, autoscaling={"mode": "Manual"}))
    reader = Reader({"a": 0.95})
    loop = make_loop(kube, reader=reader)
    await loop.follow(kube.obj("InferenceService", "chat"), [pod("a")], now=100.0)
    assert reader.started["a"] == 0 and loop.warm is None


@pytest.mark.parametrize("audits, expected", [(False, 0), (True, 1)])
async def test_a_requested_fragmentation_audit_waits_while_the_first_pass_runs(audits, expected):
    kube = FakeKube()
    body = isvc(desired=1, ready=1)
    body["metadata"]["annotations"] = {names.ANNOTATION_AUDIT_REQUEST: "now"}
    kube.put(body)
    kube.put(deployment(1, 1))
    reader = Reader({"a": 0.5})
    loop = make_loop(kube, reader=reader)
    await loop.tick(kube.obj("InferenceService", "chat"), [pod("a")], now=100.0, audits=audits)
    assert reader.audits == expected


def test_audits_are_held_after_a_takeover_until_the_first_pass_or_for_at_most_10_seconds():
    clock = Clock()
    fleet = FleetLoop(ports=None, clock=clock, follow_interval=5.0)
    assert fleet.audits_allowed()
    fleet.take_over()
    assert not fleet.audits_allowed()
    clock.t += 9.9
    assert not fleet.audits_allowed()
    clock.t += 0.1
    assert fleet.audits_allowed()
    fleet.take_over()
    fleet.first_pass.set()
    assert fleet.audits_allowed()
