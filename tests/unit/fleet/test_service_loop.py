"""ServiceLoop against an in-memory API server: autoscaling, the scale-in mark,
fragmentation remediation, and the races between the autoscaler and reconciles."""
import asyncio
import copy

import pytest

from gpufleet.autoscale.signals import ReplicaSample
from gpufleet.fleet.ports import ServicePorts
from gpufleet.fleet.service_loop import ServiceLoop
from gpufleet.manifests import names
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.wiring.controller import Controller
from gpufleet_kit.kube.errors import ApiError
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"


class FakeReader:
    """Replica metrics as the pods would report them: kv usage per pod, None = unreadable."""

    def __init__(self, kv: dict[str, float | None] | None = None):
        self.kv = kv or {}

    async def sample(self, pod, ip):
        kv = self.kv.get(pod, 0.5)
        if kv is None:
            return ReplicaSample(pod=pod, ok=False, error="timeout")
        return ReplicaSample(pod=pod, ok=True, kv_usage=kv)

    async def audit(self, pod, ip):
        return None, "not audited here"

    async def demand(self, pod, ip):
        return None  # nothing learned (test_demand_share.py covers sharing)


def isvc(desired=2, ready=2, autoscaling=None, generation=1, **spec):
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": generation},
            "spec": {"model": {"name": "org/m"},
                     "autoscaling": autoscaling or {"minReplicas": 1, "maxReplicas": 4},
                     "audit": {"fragmentation": {"intervalSeconds": 604800}},  # not in these tests' way
                     **spec},
            "status": {"observedGeneration": generation, "desiredReplicas": desired, "readyReplicas": ready,
                       "replicas": ready, "conditions": []}}


def deployment(replicas, ready):
    """The service's own Deployment (its owner reference: the operator applies over it)."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "chat-engine", "namespace": "ml", "generation": 1,
                         "ownerReferences": [names.owner_reference(isvc())]},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas}}


def pod(name, ready=True, deleting=False, marked=False):
    return {"name": name, "ip": f"10.0.0.{len(name)}", "ready": ready, "deleting": deleting, "marked": marked}


def pod_object(name, annotations=None):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "annotations": annotations or {},
                         "labels": {"app.kubernetes.io/name": "gpufleet-engine", "gpufleet.dev/service": "chat"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
def kube():
    return FakeKube()


class WatchedLocks:
    """The controller's service locks, saying when the autoscaler asks for one."""

    def __init__(self, controller):
        self.controller = controller
        self.asked = asyncio.Event()

    def locked(self, namespace, name):
        self.asked.set()  # the lock is queued for in this same step (``async with`` follows at once)
        return self.controller.locked(namespace, name)

    async def reconcile_locked(self, isvc, apply_children=True):
        await self.controller.reconcile_locked(isvc, apply_children)


def make_loop(kube, kv=None, reader=None):
    """A service loop wired as the runtime wires it: the API client records Events and writes
    objects, the controller writes status and holds the service locks."""
    metrics = OperatorMetrics()
    controller = Controller(kube, metrics)
    ports = ServicePorts(events=kube, status=controller, locks=WatchedLocks(controller), objects=kube,
                         replicas=reader or FakeReader(kv), metrics=metrics)
    return ServiceLoop(ports, "ml", "chat")


def deployment_replicas(kube):
    return [body["spec"]["replicas"] for verb, key, body in kube.writes
            if verb == "apply" and key[0] == "Deployment"]


def scale_events(kube):
    return [r for r in kube.event_reasons() if r.startswith("Scaled")]


def status(kube):
    return kube.obj("InferenceService", "chat")["status"]


def scaling(kube):
    return c.get(status(kube).get("conditions"), c.SCALING) or {}


# --- the 2 -> 3 -> 2 race ------------------------------------------------------------------


async def test_a_reconcile_that_read_the_object_before_a_scale_out_does_not_undo_it(kube):
    """A triggered reconcile holds a copy that says 2 replicas; meanwhile the autoscaler
    decides 3 and applies it. The old copy must not put the Deployment back to 2
    (which would delete the pod just created)."""
    kube.put(isvc(desired=2, ready=2))
    kube.put(deployment(2, 2))
    loop = make_loop(kube, kv={"a": 0.95, "b": 0.95})
    stale = kube.obj("InferenceService", "chat")   # what the triggered reconcile read
    fleet_copy = copy.deepcopy(stale)              # what the fleet loop holds

    kube.pause[("ConfigMap", "chat-guard")] = release = asyncio.Event()
    kube.paused[("ConfigMap", "chat-guard")] = holding = asyncio.Event()
    reconcile = asyncio.create_task(loop.ports.locks.controller.reconcile(copy.deepcopy(stale)))
    await holding.wait()        # the reconcile holds the service's lock, mid-apply
    tick = asyncio.create_task(loop.tick(fleet_copy, [pod("a"), pod("b")], now=100.0))
    await loop.ports.locks.asked.wait()   # the autoscaler decided 3 and waits for the lock
    assert not reconcile.done() and not tick.done()
    release.set()
    await asyncio.gather(reconcile, tick)

    applied = deployment_replicas(kube)
    assert applied[-1] == 3, f"Deployment replicas applied in order: {applied}"
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 3
    assert status(kube)["desiredReplicas"] == 3
    assert scale_events(kube) == ["ScaledUp"]


# --- autoscale --------------------------------------------------------------------------


async def test_scale_out_records_the_decision_and_applies_it(kube):
    kube.put(isvc(desired=2, ready=2))
    kube.put(deployment(2, 2))
    loop = make_loop(kube, kv={"a": 0.95, "b": 0.95})
    await loop.tick(kube.obj("InferenceService", "chat"), [pod("a"), pod("b")], now=100.0)
    st = status(kube)
    assert st["desiredReplicas"] == 3 and st["lastScaling"]["from"] == 2 and st["lastScaling"]["to"] == 3
    assert st["lastScaling"]["reason"] == "KVHighWatermark" and st["kvCacheUsagePercent"] == 95
    assert scaling(kube)["status"] == "True" and scaling(kube)["observedGeneration"] == 1
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 3
    assert scale_events(kube) == ["ScaledUp"]


async def test_a_decision_on_a_replica_count_that_changed_meanwhile_is_dropped(kube):
    kube.put(isvc(desired=3, ready=2))              # another decision already took it to 3
    kube.put(deployment(3, 2))
    loop = make_loop(kube, kv={"a": 0.95, "b": 0.95})
    fleet_copy = isvc(desired=2, ready=2)           # the watch has not delivered that yet
    await loop.tick(fleet_copy, [pod("a"), pod("b")], now=100.0)
    assert status(kube)["desiredReplicas"] == 3
    assert scale_events(kube) == []
    assert deployment_replicas(kube) == []


async def test_scale_in_marks_the_least_loaded_replica_first(kube):
    kube.put(isvc(desired=2, ready=2, autoscaling={"minReplicas": 1, "maxReplicas": 4,
                                                   "scaleDownStabilizationSeconds": 0}))
    kube.put(deployment(2, 2))
    for name in ("a", "b"):
        kube.put(pod_object(name))
    loop = make_loop(kube, kv={"a": 0.2, "b": 0.1})
    await loop.tick(kube.obj("InferenceService", "chat"), [pod("a"), pod("b")], now=100.0)
    assert status(kube)["desiredReplicas"] == 1 and scale_events(kube) == ["ScaledDown"]
    assert kube.obj("Pod", "b")["metadata"]["annotations"] == {names.ANNOTATION_DELETION_COST: "-1000"}
    assert names.ANNOTATION_DELETION_COST not in kube.obj("Pod", "a")["metadata"]["annotations"]
    marks = [i for i, (verb, key, _) in enumerate(kube.writes) if key == ("Pod", "ml", "b")]
    scale = [i for i, (verb, key, body) in enumerate(kube.writes) if key[0] == "Deployment"]
    assert marks[0] < scale[0]   # marked before the ReplicaSet picks


async def test_the_mark_is_cleared_from_a_replica_that_outlived_its_scale_in(kube):
    """The ReplicaSet removes a not-ready pod before a marked ready one: the marked one
    stays, and its mark must not make it the next one removed however busy it is."""
    kube.put(isvc(desired=3, ready=3, autoscaling={"minReplicas": 1, "maxReplicas": 4,
                                                   "scaleDownStabilizationSeconds": 0}))
    kube.put(deployment(3, 3))
    for name in ("a", "b", "c"):
        kube.put(pod_object(name))
    loop = make_loop(kube, kv={"a": 0.2, "b": 0.1, "c": 0.2})
    body = kube.obj("InferenceService", "chat")
    await loop.tick(body, [pod("a"), pod("b"), pod("c")], now=100.0)
    assert status(kube)["desiredReplicas"] == 2
    assert names.ANNOTATION_DELETION_COST in kube.obj("Pod", "b")["metadata"]["annotations"]
    # The ReplicaSet has not acted yet: the mark stays.
    await loop.marks.release_outlived(body, [pod("a"), pod("b", marked=True), pod("c")])
    assert names.ANNOTATION_DELETION_COST in kube.obj("Pod", "b")["metadata"]["annotations"]
    # It removed c instead.
    await loop.marks.release_outlived(body, [pod("a"), pod("b", marked=True), pod("c", deleting=True)])
    assert names.ANNOTATION_DELETION_COST not in kube.obj("Pod", "b")["metadata"]["annotations"]
    assert loop.marks.removals == {}


async def test_a_mark_left_from_before_a_restart_is_cleared_once_the_count_matches(kube):
    kube.put(isvc(desired=2, ready=2))
    kube.put(pod_object("a", {names.ANNOTATION_DELETION_COST: "-1000"}))
    loop = make_loop(kube)
    await loop.marks.release_outlived(kube.obj("InferenceService", "chat"), [pod("a", marked=True), pod("b")])
    assert kube.obj("Pod", "a")["metadata"]["annotations"] == {}


async def test_the_mark_is_taken_back_when_the_scale_in_cannot_be_recorded(kube):
    kube.put(isvc(desired=2, ready=2, autoscaling={"minReplicas": 1, "maxReplicas": 4,
                                                   "scaleDownStabilizationSeconds": 0}))
    for name in ("a", "b"):
        kube.put(pod_object(name))

    async def status_refused(verb, key, body):
        if verb == "patch/status":
            raise ApiError(500, "InternalError", "etcd timed out")
    kube.on_write = status_refused
    loop = make_loop(kube, kv={"a": 0.2, "b": 0.1})
    with pytest.raises(ApiError):
        await loop.tick(kube.obj("InferenceService", "chat"), [pod("a"), pod("b")], now=100.0)
    assert kube.obj("Pod", "b")["metadata"]["annotations"] == {} and loop.marks.removals == {}


async def test_a_failed_mark_does_not_stop_the_scale_in(kube):
    loop = make_loop(kube)
    await loop.marks.mark("gone", 1)      # the pod went away meanwhile: logged, not raised
    assert loop.marks.removals == {}


async def test_metrics_unavailable_is_reported_and_cleared_when_reads_recover(kube):
    kube.put(isvc(desired=2, ready=2))
    kube.put(deployment(2, 2))
    loop = make_loop(kube, kv={"a": 0.5, "b": None})
    body = kube.obj("InferenceService", "chat")
    await loop.tick(body, [pod("a"), pod("b")], now=100.0)
    assert scaling(kube)["status"] == "False" and scaling(kube)["reason"] == "MetricsUnavailable"
    assert "cannot read b" in scaling(kube)["message"] and scaling(kube)["observedGeneration"] == 1
    loop.ports.replicas.kv["b"] = 0.5
    await loop.tick(body, [pod("a"), pod("b")], now=101.0)
    assert scaling(kube)["status"] == "True" and scaling(kube)["reason"] == "SignalsAvailable"
    writes = len(kube.writes)
    await loop.tick(body, [pod("a"), pod("b")], now=102.0)
    assert len(kube.writes) == writes    # nothing changed, nothing written


async def test_a_replica_that_never_becomes_ready_does_not_freeze_scaling(kube):
    """3 wanted, 2 ready for good: past the grace the autoscaler decides on the 2 it can
    read, says so in the Scaling condition, and can scale in (the ReplicaSet then
    removes the not-ready pod first)."""
    kube.put(isvc(desired=3, ready=2, autoscaling={"minReplicas": 1, "maxReplicas": 4,
                                                   "scaleDownStabilizationSeconds": 0}))
    kube.put(deployment(3, 2))
    loop = make_loop(kube, kv={"a": 0.1, "b": 0.1})
    body = kube.obj("InferenceService", "chat")
    pods = [pod("a"), pod("b"), pod("c", ready=False)]
    await loop.tick(body, pods, now=100.0)
    assert status(kube)["desiredReplicas"] == 3 and scale_events(kube) == []   # still starting, perhaps
    await loop.tick(body, pods, now=100.0 + 599)
    assert scale_events(kube) == []
    await loop.tick(body, pods, now=100.0 + 601)
    assert status(kube)["desiredReplicas"] == 2 and scale_events(kube) == ["ScaledDown"]


async def test_the_condition_says_when_decisions_use_only_the_ready_replicas(kube):
    kube.put(isvc(desired=3, ready=2))
    kube.put(deployment(3, 2))
    loop = make_loop(kube, kv={"a": 0.6, "b": 0.6})   # between the watermarks: no action
    body = kube.obj("InferenceService", "chat")
    pods = [pod("a"), pod("b"), pod("c", ready=False)]
    await loop.tick(body, pods, now=100.0)
    await loop.tick(body, pods, now=800.0)
    assert scaling(kube)["reason"] == "ReplicasNotReady" and scaling(kube)["status"] == "False"
    assert "1 of 3 replica(s) not ready" in scaling(kube)["message"]
    kube.put({**kube.obj("InferenceService", "chat"), "status": {**status(kube), "readyReplicas": 3}})
    body = kube.obj("InferenceService", "chat")
    await loop.tick(body, [pod("a"), pod("b"), pod("c")], now=801.0)
    assert scaling(kube)["reason"] == "SignalsAvailable" and scaling(kube)["status"] == "True"


# --- remediation --------------------------------------------------------------------------


def put_pods(kube, pods):
    for p in pods:
        kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": p["name"], "namespace": "ml"}})


def restart_isvc(desired=3, ready=3, **status):
    body = isvc(desired=desired, ready=ready, audit={"fragmentation": {
        "intervalSeconds": 604800, "thresholdPercent": 25, "remediation": "RestartReplica",
        "restartCooldownSeconds": 600}})
    body["status"].update(status)
    return body


class AuditingReader(FakeReader):
    """Replicas' /audit reports: (fragmentation, alloc retries, OOMs) per pod, changed between audits."""

    def __init__(self, kv, memory):
        super().__init__(kv)
        self.memory = memory

    async def audit(self, pod, ip):
        ratio, retries, ooms = self.memory[pod]
        return {"fragmentationRatio": ratio, "allocRetries": retries, "ooms": ooms,
                "device": {"available": True}}, None


PODS = [pod("a"), pod("b"), pod("c")]


async def audit_twice(kube, body, *, kv=None, retries_after=40, pods=PODS, now=10_000.0):
    """Two audits of three replicas; b is 40% fragmented and its retries go 3 -> ``retries_after``."""
    kube.put(body)
    put_pods(kube, pods)
    loop = make_loop(kube, reader=AuditingReader(kv or {"a": 0.3, "b": 0.3, "c": 0.3},
                                                 {"a": (0.05, 0, 0), "b": (0.40, 3, 0), "c": (0.10, 0, 0)}))
    loop.fragmentation.watching_since = 0.0
    spec = loop.spec_of(body)
    ready = [p for p in pods if p["ready"] and not p["deleting"]]
    samples = [await loop.ports.replicas.sample(p["name"], p["ip"]) for p in ready]
    await loop.fragmentation.audit(body, spec, ready, now - 3600, samples=samples, pods=pods)
    loop.ports.replicas.memory["b"] = (0.40, retries_after, 0)
    await loop.fragmentation.audit(kube.obj("InferenceService", "chat"), spec, ready, now, samples=samples, pods=pods)
    return loop


async def test_a_fragmented_replica_losing_memory_is_restarted_and_the_restart_recorded(kube):
    await audit_twice(kube, restart_isvc())
    assert kube.deleted("Pod") == ["b"]
    assert kube.event_reasons() == ["FragmentationHigh", "FragmentationHigh", "ReplicaRestarted"]
    f = status(kube)["fragmentation"]
    assert f["lastRestartedReplica"] == "b" and f["lastRestartTime"] and f["percent"] == 40
    assert f["losingMemoryReplica"] == "b"


async def test_fragmentation_without_rising_retries_restarts_nothing(kube):
    await audit_twice(kube, restart_isvc(), retries_after=3)
    assert kube.deleted("Pod") == [] and "RemediationDeferred" not in kube.event_reasons()
    assert status(kube)["fragmentation"].get("losingMemoryReplica") is None


async def test_no_restart_right_after_the_operator_starts(kube):
    body = restart_isvc()
    kube.put(body)
    loop = make_loop(kube, reader=AuditingReader({}, {"a": (0.9, 100, 5), "b": (0.9, 100, 5),
                                                      "c": (0.9, 100, 5)}))
    ready = PODS
    samples = [await loop.ports.replicas.sample(p["name"], p["ip"]) for p in ready]
    await loop.tick(body, ready, now=50.0)  # the loop starts watching
    for i, now in enumerate((60.0, 120.0, 180.0)):
        loop.ports.replicas.memory = {p: (0.9, 200 + i, 5) for p in "abc"}
        await loop.fragmentation.audit(kube.obj("InferenceService", "chat"), loop.spec_of(body), ready, now,
                         samples=samples, pods=ready)
    assert kube.deleted("Pod") == []
    deferred = [e["message"] for e in kube.events if e["reason"] == "RemediationDeferred"]
    assert deferred and all("no burst after a start" in m for m in deferred)


async def test_a_restart_waits_out_the_cooldown_of_the_last_one(kube):
    recent = c.now_iso()
    await audit_twice(kube, restart_isvc(fragmentation={"lastRestartTime": recent, "lastRestartedReplica": "a"}))
    assert kube.deleted("Pod") == []
    assert any("cooldown" in e["message"] for e in kube.events if e["reason"] == "RemediationDeferred")


async def test_one_replica_at_a_time(kube):
    await audit_twice(kube, restart_isvc(desired=3, ready=2),
                      pods=[pod("a"), pod("b"), pod("c", ready=False), pod("d", deleting=True)])
    assert kube.deleted("Pod") == []
    assert any("one replica at a time" in e["message"] for e in kube.events)


async def test_no_restart_when_the_others_lack_kv_headroom_for_its_load(kube):
    await audit_twice(kube, restart_isvc(), kv={"a": 0.6, "b": 0.6, "c": 0.6})
    assert kube.deleted("Pod") == []
    assert any("90% KV usage" in e["message"] and "watermark" in e["message"] for e in kube.events)


@pytest.mark.parametrize("pods, drain, reason", [
    ([pod("b")], None, "only ready replica"),
    (PODS, {"replicas": 1, "nodes": ["n1"], "pods": ["a"]}, "a node drain is under way"),
], ids=["no-spare-replica", "node-drain"])
async def test_remediation_is_deferred_without_spare_capacity(kube, pods, drain, reason):
    await audit_twice(kube, restart_isvc(desired=len(pods), ready=len(pods), drain=drain), pods=pods)
    assert kube.deleted("Pod") == []
    assert any(reason in e["message"] for e in kube.events if e["reason"] == "RemediationDeferred")


async def test_never_in_the_same_pass_as_a_scale_in(kube):
    body = restart_isvc()
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4, "scaleDownStabilizationSeconds": 0}
    body["metadata"]["annotations"] = {names.ANNOTATION_AUDIT_REQUEST: "now"}
    kube.put(body)
    kube.put(deployment(3, 3))
    loop = make_loop(kube, reader=AuditingReader({"a": 0.01, "b": 0.01, "c": 0.01},
                                                 {"a": (0.05, 0, 0), "b": (0.40, 50, 0), "c": (0.10, 0, 0)}))
    loop.fragmentation.watching_since = -100_000.0
    loop.fragmentation.baseline = {"a": (0, 0), "b": (3, 0), "c": (0, 0)}
    await loop.tick(kube.obj("InferenceService", "chat"), PODS, now=10_000.0)
    assert scale_events(kube) == ["ScaledDown"]
    assert kube.deleted("Pod") == []
    assert any("scale-in" in e["message"] for e in kube.events if e["reason"] == "RemediationDeferred")


