"""ServiceLoop against an in-memory API server: autoscaling, the scale-in mark,
fragmentation remediation, and the races between the autoscaler and reconciles."""
import asyncio
import copy
import types

import pytest

from gpufleet.autoscale.signals import ReplicaSample
from gpufleet.controller import Controller
from gpufleet.fleet.service_loop import DELETION_COST, ServiceLoop
from gpufleet.kube.errors import ApiError
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
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


def isvc(desired=2, ready=2, autoscaling=None, generation=1, **spec):
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": generation},
            "spec": {"model": {"name": "org/m"},
                     "autoscaling": autoscaling or {"minReplicas": 1, "maxReplicas": 4},
                     **spec},
            "status": {"observedGeneration": generation, "desiredReplicas": desired, "readyReplicas": ready,
                       "replicas": ready, "conditions": []}}


def deployment(replicas, ready):
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "chat-engine", "namespace": "ml", "generation": 1},
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


def make_loop(kube, kv=None):
    metrics = OperatorMetrics()
    rt = types.SimpleNamespace(kube=kube, metrics=metrics, controller=Controller(kube, metrics),
                               reader=FakeReader(kv))
    return ServiceLoop(rt, "ml", "chat")


def deployment_replicas(kube):
    return [body["spec"]["replicas"] for verb, key, body in kube.writes
            if verb == "apply" and key[0] == "Deployment"]


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
    reconcile = asyncio.create_task(loop.rt.controller.reconcile(copy.deepcopy(stale)))
    while ("ConfigMap", "chat-guard") not in kube.paused:
        await asyncio.sleep(0)
    tick = asyncio.create_task(loop.tick(fleet_copy, [pod("a"), pod("b")], now=100.0))
    await asyncio.sleep(0.05)   # the autoscaler gets as far as it can
    release.set()
    await asyncio.gather(reconcile, tick)

    applied = deployment_replicas(kube)
    assert applied[-1] == 3, f"Deployment replicas applied in order: {applied}"
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 3
    assert status(kube)["desiredReplicas"] == 3
    assert kube.event_reasons().count("ScaledUp") == 1
