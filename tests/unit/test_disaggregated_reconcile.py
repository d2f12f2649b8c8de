"""Reconciling a disaggregated service: replicas per pool, status per pool, the Scaling condition
an older operator left (PoolsNotAutoscaled) replaced now that the pools are autoscaled, and a switch
between unified and disaggregated that deletes the Deployments of the shape left, against the
in-memory API server."""
import pytest

from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.replicas import desired_replicas
from gpufleet.reconcile.status import POOLS_NOT_AUTOSCALED, Observed, derive_status
from gpufleet.wiring.controller import Controller
from gpufleet_api import parse_spec
from gpufleet_kit.kube.errors import Invalid
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"
KV = {"kvTransfer": {"connector": "Nixl"}}


def spec(**over):
    return parse_spec({"model": {"name": "m"}, **over})


def pd_spec(mode="Auto", prefill=None, decode=None):
    return spec(disaggregation={"prefill": prefill or {}, "decode": decode or {}}, engine=KV,
                autoscaling={"mode": mode})


def test_manual_pools_take_their_replicas_or_their_minimum():
    s = pd_spec("Manual", prefill={"replicas": 3, "maxReplicas": 4}, decode={"minReplicas": 2})
    assert desired_replicas(s, {}) == {"prefill": 3, "decode": 2}


def test_auto_pools_keep_their_last_replicas_inside_their_bounds():
    s = pd_spec("Auto", prefill={"minReplicas": 1, "maxReplicas": 2}, decode={"minReplicas": 2, "maxReplicas": 6})
    assert desired_replicas(s, {}) == {"prefill": 1, "decode": 2}
    last = {"pools": [{"role": "prefill", "desiredReplicas": 5}, {"role": "decode", "desiredReplicas": 4}]}
    assert desired_replicas(s, last) == {"prefill": 2, "decode": 4}


def test_a_unified_service_has_one_pool_as_before():
    assert desired_replicas(spec(replicas=3, autoscaling={"mode": "Manual", "maxReplicas": 4}), {}) == {"unified": 3}


def dep(replicas, ready):
    return {"metadata": {"generation": 1}, "status": {"replicas": replicas, "readyReplicas": ready,
                                                      "updatedReplicas": replicas, "observedGeneration": 1}}


def derive(s, pools, want, previous=None):
    return derive_status(service="chat", namespace="ml", generation=2, spec=s, desired=sum(want.values()),
                         observed=Observed(None, [], pools), previous=previous or {}, pool_desired=want)


def test_status_counts_each_pool_and_the_service_as_their_sum():
    st = derive(pd_spec(), {"prefill": dep(1, 1), "decode": dep(2, 2)}, {"prefill": 1, "decode": 2})
    assert st["pools"] == [{"role": "prefill", "replicas": 1, "readyReplicas": 1, "desiredReplicas": 1},
                           {"role": "decode", "replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}]
    assert (st["replicas"], st["readyReplicas"], st["desiredReplicas"]) == (3, 3, 3)
    ready = c.get(st["conditions"], c.READY)
    assert ready["reason"] == "AllReplicasReady" and ready["message"] == "prefill 1/1, decode 2/2 replicas ready"


def test_a_service_without_a_ready_decode_pod_is_not_ready_whatever_its_prefill_pods():
    st = derive(pd_spec(), {"prefill": dep(2, 2), "decode": dep(1, 0)}, {"prefill": 2, "decode": 1})
    ready = c.get(st["conditions"], c.READY)
    assert ready["status"] == "False" and ready["reason"] == "EngineStarting"
    assert "prefill 2/2, decode 0/1" in ready["message"]
    partly = derive(pd_spec(), {"prefill": dep(2, 1), "decode": dep(1, 1)}, {"prefill": 2, "decode": 1})
    assert c.get(partly["conditions"], c.READY)["reason"] == "PartiallyReady"


def test_the_reconciler_leaves_scaling_to_the_autoscaler_and_replaces_what_an_older_operator_said():
    pools = {"prefill": dep(1, 1), "decode": dep(1, 1)}
    for mode in ("Auto", "Manual"):
        st = derive(pd_spec(mode), pools, {"prefill": 1, "decode": 1})
        assert c.get(st["conditions"], c.SCALING) is None
    older = {"conditions": [c.condition(c.SCALING, False, POOLS_NOT_AUTOSCALED, "not yet")]}
    auto = c.get(derive(pd_spec("Auto"), pools, {"prefill": 1, "decode": 1}, older)["conditions"], c.SCALING)
    assert auto["status"] == "True" and auto["reason"] == "PoolsAutoscaled"
    unified = derive_status(service="chat", namespace="ml", generation=3, spec=spec(), desired=1,
                            observed=Observed(dep(1, 1), []), previous=older)
    assert c.get(unified["conditions"], c.SCALING)["reason"] == "UnifiedPool"
    assert unified["pools"] is None  # removes the pools a former disaggregated shape left in status


# --- against the in-memory API server -------------------------------------------------------


def isvc(generation=1, **spec_fields):
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": generation},
            "spec": {"model": {"name": "org/m"}, **spec_fields}, "status": {}}


PD = {"disaggregation": {"prefill": {"minReplicas": 1}, "decode": {"minReplicas": 2}}, "engine": KV}


@pytest.fixture
def kube():
    return FakeKube()


def deployments(kube):
    return sorted(name for (kind, _, name) in kube.objects if kind == "Deployment")


async def test_a_disaggregated_service_is_reconciled_into_its_pools_with_status_per_pool(kube):
    kube.put(isvc(**PD))
    await Controller(kube, OperatorMetrics()).reconcile_key("ml", "chat")
    assert deployments(kube) == ["chat-decode", "chat-prefill"]
    assert kube.obj("Deployment", "chat-decode")["spec"]["replicas"] == 2
    status = kube.obj("InferenceService", "chat")["status"]
    assert [(p["role"], p["desiredReplicas"]) for p in status["pools"]] == [("prefill", 1), ("decode", 2)]
    assert status["desiredReplicas"] == 3
    assert POOLS_NOT_AUTOSCALED not in kube.event_reasons()


async def test_switching_shape_deletes_the_deployments_of_the_shape_left_once_the_new_ones_exist(kube):
    controller = Controller(kube, OperatorMetrics())
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert deployments(kube) == ["chat-engine"]

    kube.put(isvc(generation=2, **PD))
    await controller.reconcile_key("ml", "chat")
    assert deployments(kube) == ["chat-decode", "chat-prefill"]
    assert "PoolRemoved" in kube.event_reasons()
    order = [(verb, key[2]) for verb, key, _ in kube.writes if key[0] == "Deployment"]
    assert [name for verb, name in order if verb == "delete"] == ["chat-engine"]
    assert order.index(("delete", "chat-engine")) > max(order.index(("apply", n)) for n in ("chat-prefill",
                                                                                           "chat-decode"))

    kube.put({**isvc(generation=3), "status": kube.obj("InferenceService", "chat")["status"]})
    await controller.reconcile_key("ml", "chat")
    assert deployments(kube) == ["chat-engine"]
    assert "pools" not in kube.obj("InferenceService", "chat")["status"]


def engine_pod(name, role=None):
    labels = {"app.kubernetes.io/name": "gpufleet-engine", "gpufleet.dev/service": "chat"}
    if role:
        labels["gpufleet.dev/role"] = role
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml", "labels": labels},
            "status": {}}


async def test_the_guard_json_of_the_pods_left_behind_stays_until_they_are_gone(kube):
    """Their preStop hook reads their drain timeout there; without it they would stop undrained."""
    controller = Controller(kube, OperatorMetrics())
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    kube.put(engine_pod("chat-engine-a"))
    kube.put({**isvc(generation=2, **PD), "status": kube.obj("InferenceService", "chat")["status"]})
    await controller.reconcile_key("ml", "chat")
    assert sorted(kube.obj("ConfigMap", "chat-guard")["data"]) == ["guard-decode.json", "guard-prefill.json",
                                                                   "guard.json"]
    del kube.objects[("Pod", "ml", "chat-engine-a")]
    await controller.reconcile_key("ml", "chat")
    assert sorted(kube.obj("ConfigMap", "chat-guard")["data"]) == ["guard-decode.json", "guard-prefill.json"]


async def test_a_refused_pool_leaves_the_unified_pool_serving(kube):
    controller = Controller(kube, OperatorMetrics())
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    kube.reject[("Deployment", "chat-decode")] = Invalid(422, "Invalid", "decode refused")
    kube.put(isvc(generation=2, **PD))
    await controller.reconcile_key("ml", "chat")
    assert "chat-engine" in deployments(kube)
    await controller.reconcile_key("ml", "chat", apply_children=False)  # a pod event meanwhile
    assert "chat-engine" in deployments(kube)


async def test_a_deployment_of_another_owner_is_never_deleted(kube):
    kube.put({"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "chat-engine", "namespace": "ml",
                           "labels": {"app.kubernetes.io/name": "gpufleet-engine", "gpufleet.dev/service": "chat"},
                           "ownerReferences": [{"uid": "another", "controller": True}]}})
    kube.put(isvc(**PD))
    await Controller(kube, OperatorMetrics()).reconcile_key("ml", "chat")
    assert "chat-engine" in deployments(kube)
