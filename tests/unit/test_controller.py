"""Controller against an in-memory API server: refused children, per-type
condition writes under concurrent writers, and reading the freshest object."""
import asyncio

import pytest

from gpufleet.manifests import names
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.wiring.children import REJECTED_RETRY_FIRST_S
from gpufleet.wiring.controller import Controller
from gpufleet_kit.kube.errors import ApiError, Invalid
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"
REFUSAL = ('Deployment.apps "chat-engine" is invalid: spec.template.spec.containers[0].image: Invalid value: '
           '"registry.example/engine": image is not from an allowed registry')


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def isvc(generation=1, status=None, **spec):
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": generation},
            "spec": {"model": {"name": "org/m"}, **spec}, "status": status or {}}


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def controller(kube, clock):
    return Controller(kube, OperatorMetrics(), clock=clock)


def ready(kube):
    return c.get(kube.obj("InferenceService", "chat")["status"].get("conditions"), c.READY) or {}


def deployment_applies(kube):
    return sum(1 for verb, key, _ in kube.writes if verb == "apply" and key[0] == "Deployment")


async def test_a_refused_child_becomes_ready_false_naming_it_with_one_event(kube, controller):
    kube.put(isvc())
    kube.reject[("Deployment", "chat-engine")] = Invalid(422, "Invalid", REFUSAL)
    await controller.reconcile_key("ml", "chat")     # no exception: nothing for kopf to retry
    r = ready(kube)
    assert r["status"] == "False" and r["reason"] == "ChildRejected" and r["observedGeneration"] == 1
    assert r["message"] == f"Deployment chat-engine rejected by the API server: {REFUSAL}"
    prog = c.get(kube.obj("InferenceService", "chat")["status"]["conditions"], c.PROGRESSING)
    assert prog["reason"] == "ChildRejected"
    assert kube.event_reasons() == ["ChildRejected"]
    assert kube.events[0]["type"] == "Warning" and "chat-engine" in kube.events[0]["message"]
    # Pod events and resyncs before the backoff neither re-apply nor repeat the Event.
    for apply in (False, True):
        await controller.reconcile_key("ml", "chat", apply_children=apply)
    assert kube.event_reasons() == ["ChildRejected"]
    assert ready(kube)["reason"] == "ChildRejected"


async def test_a_refused_child_is_retried_after_a_slow_backoff_not_every_pass(kube, controller, clock):
    kube.put(isvc())
    kube.reject[("Deployment", "chat-engine")] = Invalid(422, "Invalid", REFUSAL)
    await controller.reconcile_key("ml", "chat")
    tried = len(kube.writes)
    clock.now += 30
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert len(kube.writes) == tried            # no 30 s hot loop
    clock.now += REJECTED_RETRY_FIRST_S
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert len(kube.writes) > tried             # due: the children are applied again
    again = len(kube.writes)
    clock.now += REJECTED_RETRY_FIRST_S + 1     # the backoff doubled
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert len(kube.writes) == again
    assert kube.event_reasons() == ["ChildRejected"]   # same refusal, no new Event


async def test_a_fixed_spec_is_applied_at_once_and_clears_the_refusal(kube, controller):
    kube.put(isvc())
    kube.reject[("Deployment", "chat-engine")] = Invalid(422, "Invalid", REFUSAL)
    await controller.reconcile_key("ml", "chat")
    del kube.reject[("Deployment", "chat-engine")]
    kube.put(isvc(generation=2, status=kube.obj("InferenceService", "chat")["status"]))
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.obj("Deployment", "chat-engine") is not None
    assert ready(kube)["reason"] == "EngineStarting" and ready(kube)["observedGeneration"] == 2


async def test_a_different_refusal_is_a_new_event(kube, controller):
    kube.put(isvc())
    kube.reject[("Deployment", "chat-engine")] = Invalid(422, "Invalid", REFUSAL)
    await controller.reconcile_key("ml", "chat")
    kube.reject[("Deployment", "chat-engine")] = Invalid(422, "Invalid", "something else")
    kube.put(isvc(generation=2, status=kube.obj("InferenceService", "chat")["status"]))
    await controller.reconcile_key("ml", "chat")
    assert kube.event_reasons() == ["ChildRejected", "ChildRejected"]
    assert ready(kube)["message"].endswith("something else")


async def test_transient_errors_are_raised_for_a_retry_not_reported_as_refusals(kube, controller):
    kube.put(isvc())
    kube.reject[("Deployment", "chat-engine")] = ApiError(503, "ServiceUnavailable", "etcd is busy")
    with pytest.raises(ApiError):
        await controller.reconcile_key("ml", "chat")
    assert "ChildRejected" not in kube.event_reasons()


async def test_a_stale_copy_is_re_read_before_anything_is_applied(kube, controller):
    kube.put(isvc(status={"observedGeneration": 1, "desiredReplicas": 3}))
    await controller.reconcile(isvc(status={"observedGeneration": 1, "desiredReplicas": 2}))
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 3


async def test_condition_writes_keep_what_another_writer_wrote_meanwhile(kube, controller):
    kube.put(isvc(status={"conditions": []}))
    mine = kube.obj("InferenceService", "chat")       # read before the other writer's write
    other = kube.obj("InferenceService", "chat")
    await controller.write_status(other, {}, [c.condition(c.FRAGMENTATION_OK, True, "OK", generation=1)])
    await controller.write_status(mine, {"kvCacheUsagePercent": 50},
                                  [c.condition(c.SCALING, False, "MetricsUnavailable", generation=1)])
    conds = kube.obj("InferenceService", "chat")["status"]["conditions"]
    assert {x["type"] for x in conds} == {c.FRAGMENTATION_OK, c.SCALING}
    assert mine["status"]["conditions"] == conds     # the caller's copy is what the server stored
    conflicts = [body for verb, _, body in kube.writes if verb == "patch/status"]
    assert all(b["metadata"]["resourceVersion"] for b in conflicts)


async def test_nothing_is_written_when_nothing_changed(kube, controller):
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    writes = len(kube.writes)
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert len(kube.writes) == writes


async def test_a_burst_of_reconciles_asks_discovery_about_podmonitors_once(kube, controller):
    asked = []

    async def has_kind(api_version, kind):
        asked.append(kind)
        await asyncio.sleep(0)
        return False
    kube.has_kind = has_kind
    assert await asyncio.gather(*(controller.children.has_podmonitor() for _ in range(16))) == [False] * 16
    assert asked == ["PodMonitor"]


async def test_a_replica_that_cannot_be_placed_is_one_warning_event_not_two(kube, controller):
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    await controller.reconcile_key("ml", "chat", apply_children=False)
    kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "chat-engine-0", "labels": names.selector_labels("chat")}, "status": {
        "phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}})
    await controller.reconcile_key("ml", "chat", apply_children=False)
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert ready(kube)["reason"] == "Unschedulable"
    stuck = [e for e in kube.events if e["type"] == "Warning"]
    assert [e["reason"] for e in stuck] == ["Unschedulable"]
    message = stuck[0]["message"]
    assert "chat-engine-0 cannot be placed" in message and "Insufficient nvidia.com/gpu" in message
