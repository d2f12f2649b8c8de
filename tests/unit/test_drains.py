"""Node drains: each pool's PodDisruptionBudget, the surge for pods on cordoned nodes, and the
reconciler applying it (docs/drains.md)."""
import pytest

from gpufleet.autoscale import policy
from gpufleet.autoscale.drain_hold import hold_scale_in
from gpufleet.manifests import children, names
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile import drains
from gpufleet.reconcile.desired import desired_children, stale_budgets
from gpufleet.wiring.controller import Controller
from gpufleet_api import parse_spec
from gpufleet_kit.kube.errors import Invalid
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"
ISVC = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat"}}
PD = {"disaggregation": {"prefill": {"minReplicas": 1}, "decode": {"minReplicas": 2}}}


def spec(**over):
    return parse_spec({"model": {"name": "org/m"}, **over})


def selects(selector: dict, labels: dict) -> bool:
    """A label selector as the API server applies it (matchLabels, In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod(name, node="n1", role=None, deleting=False, phase="Running", track=None):
    labels = {**names.selector_labels("chat"), **({names.LABEL_ROLE: role} if role else {}),
              **({names.LABEL_TRACK: track} if track else {})}
    meta = {"name": name, "namespace": "ml", "labels": labels,
            **({"deletionTimestamp": "2026-12-04T20:00:00Z"} if deleting else {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": node},
            "status": {"phase": phase}}


# --- the budgets ----------------------------------------------------------------------


def test_the_unified_budget_keeps_every_desired_replica_and_never_protects_a_broken_one():
    pdb = children.build_pdb(ISVC, "unified", 3)
    assert pdb["metadata"]["name"] == "chat-engine"  # the name before budgets were per pool: replaced in place
    assert pdb["spec"]["minAvailable"] == 3 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_every_pool_has_its_own_budget_over_its_own_pods_only():
    objs = desired_children(ISVC, spec(**PD), {"prefill": 1, "decode": 2}, with_podmonitor=False)
    budgets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PodDisruptionBudget"}
    assert {n: b["spec"]["minAvailable"] for n, b in budgets.items()} == {"chat-prefill": 1, "chat-decode": 2}
    deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    unified = children.build_pdb(ISVC, "unified", 1)
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        # A pod under two budgets cannot be evicted at all: exactly one selects each pod, and not
        # the unified pool's (left over while the service changes shape).
        assert [n for n, b in budgets.items() if selects(b["spec"]["selector"], labels)] == [name]
        assert not selects(unified["spec"]["selector"], labels)


def test_the_unified_budget_selects_its_pods_but_not_a_canarys():
    dep, = [o for o in desired_children(ISVC, spec(), {"unified": 2}, with_podmonitor=False)
            if o["kind"] == "Deployment"]
    selector = children.build_pdb(ISVC, "unified", 2)["spec"]["selector"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(selector, labels)
    assert selects(selector, {**labels, names.LABEL_TRACK: "stable"})
    assert not selects(selector, {**labels, names.LABEL_TRACK: "canary"})


def test_the_budgets_of_a_shape_the_service_left_are_stale():
    owned = {"ownerReferences": [{"uid": "u-chat", "controller": True}]}
    budgets = [{"metadata": {"name": n, **owned}} for n in ("chat-engine", "chat-prefill", "chat-decode")]
    budgets.append({"metadata": {"name": "chat-engine", "ownerReferences": [{"uid": "other", "controller": True}]}})
    assert [b["metadata"]["name"] for b in stale_budgets(ISVC, spec(**PD), budgets)] == ["chat-engine"]
    assert [b["metadata"]["name"] for b in stale_budgets(ISVC, spec(), budgets[:3])] == ["chat-prefill",
                                                                                         "chat-decode"]


# --- the surge ------------------------------------------------------------------------


def test_pods_on_cordoned_nodes_that_are_not_leaving_yet_each_add_a_replica_to_their_pool():
    pods = [pod("a", "n1"), pod("b", "n2"), pod("c", "n1", deleting=True), pod("d", "n1", phase="Failed"),
            pod("e", "n1", track="canary"), pod("p", "n1", role="prefill"), pod("q", "n3", role="decode")]
    s = drains.surge(pods, {"n1", "n3"})
    assert s.pods == {"unified": ("a",), "prefill": ("p",), "decode": ("q",)}
    assert s.nodes == ("n1", "n3") and s.total == 3
    assert drains.with_surge({"prefill": 2, "decode": 1}, s) == {"prefill": 3, "decode": 2}
    assert drains.surge(pods, set()).total == 0
    assert drains.node_names(pods) == {"n1", "n2", "n3"}


def test_the_surge_goes_to_the_deployment_not_to_the_budget():
    s = drains.surge([pod("a", "n1")], {"n1"})
    objs = desired_children(ISVC, spec(), {"unified": 1}, with_podmonitor=False, surge=s)
    by_kind = {o["kind"]: o for o in objs}
    assert by_kind["Deployment"]["spec"]["replicas"] == 2
    assert by_kind["PodDisruptionBudget"]["spec"]["minAvailable"] == 1


def test_the_status_says_what_the_surge_is_for_and_when_it_changed():
    s = drains.surge([pod("a", "n1"), pod("b", "n1")], {"n1"})
    st = drains.status(s)
    assert st["replicas"] == 2 and st["nodes"] == ["n1"] and st["pods"] == ["a", "b"]
    assert "a, b on cordoned node(s) n1" in st["message"]
    assert drains.status(drains.Surge()) is None
    assert not drains.changed(st, s) and drains.changed(None, s) and drains.changed(st, drains.Surge())
    assert not drains.changed(None, drains.Surge())
    assert drains.surging({"drain": st}) and not drains.surging({})


def test_the_cordon_index_says_which_services_a_cordon_concerns():
    idx = drains.CordonIndex()
    assert idx.cordoned("n1") is None
    assert not idx.node_seen("n1", False)  # first listed, schedulable: nothing to do
    assert idx.cordoned("n1") is False and not idx.node_seen("n1", False)
    assert idx.node_seen("n1", True) and idx.cordoned("n1")  # cordoned
    assert idx.node_seen("n1", False) and idx.node_seen("n1", True)  # uncordoned, cordoned again
    assert idx.node_seen("n9", True)  # first listed cordoned
    idx.pod_seen("ml", "chat", "a", "n1")
    idx.pod_seen("ml", "other", "b", "n2")
    idx.pod_seen("ml", "chat", "c", "n2")
    idx.pod_seen("ml", "chat", "c", "n1")  # rescheduled under the same name (a StatefulSet would)
    assert idx.services_on("n1") == {("ml", "chat")} and idx.services_on("n2") == {("ml", "other")}
    idx.pod_seen("ml", "chat", "a", None)
    idx.pod_seen("ml", "chat", "c", None)
    assert idx.services_on("n1") == set()
    assert not idx.node_seen("n1", None) and idx.cordoned("n1") is None


def test_the_autoscaler_does_not_scale_in_during_a_surge_but_may_scale_out():
    draining = {"drain": {"replicas": 1, "pods": ["a"], "nodes": ["n1"]}}
    down, up = policy.Decision(1, "KVLowWatermark", ""), policy.Decision(3, "KVHighWatermark", "")
    assert hold_scale_in(draining, down, 2) is None
    assert hold_scale_in(draining, up, 2) is up
    assert hold_scale_in({}, down, 2) is down


# --- the reconciler -------------------------------------------------------------------


@pytest.fixture
def kube():
    return FakeKube()


def node(name, unschedulable=False):
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "namespace": ""},
            "spec": {"unschedulable": True} if unschedulable else {}}


async def test_a_cordon_surges_the_pool_until_its_pod_is_leaving(kube):
    kube.put({"apiVersion": API, "kind": "InferenceService",
              "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": 1},
              "spec": {"model": {"name": "org/m"}, "replicas": 1, "autoscaling": {"mode": "Manual"}}})
    kube.put(node("n1", unschedulable=True))
    kube.put(pod("a", "n1"))
    controller = Controller(kube, OperatorMetrics())

    await controller.reconcile_key("ml", "chat", apply_children=False)  # a pod event: applies all the same
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 2
    assert kube.obj("PodDisruptionBudget", "chat-engine")["spec"]["minAvailable"] == 1
    st = kube.obj("InferenceService", "chat")["status"]
    assert st["desiredReplicas"] == 1 and st["drain"]["pods"] == ["a"] and st["drain"]["nodes"] == ["n1"]
    assert c.get(st["conditions"], c.PROGRESSING)["reason"] == "NodeDrain"
    assert kube.event_reasons() == ["DrainSurge"] and "n1" in kube.events[-1]["message"]

    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.event_reasons() == ["DrainSurge"]  # once per change

    kube.put(pod("a", "n1", deleting=True))  # evicted: its replacement serves
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 1
    assert "drain" not in kube.obj("InferenceService", "chat")["status"]
    assert [r for r in kube.event_reasons() if r.startswith("Drain")] == ["DrainSurge", "DrainSurgeEnded"]


async def test_the_watch_knows_the_cordon_and_an_unknown_node_is_read_once(kube):
    kube.put({"apiVersion": API, "kind": "InferenceService",
              "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": 1},
              "spec": {"model": {"name": "org/m"}}})
    kube.put(node("n1"))
    kube.put(pod("a", "n1"))
    controller = Controller(kube, OperatorMetrics())
    await controller.reconcile_key("ml", "chat")
    assert controller.cordons.cordoned("n1") is False
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 1
    controller.cordons.node_seen("n1", True)  # the node watch shows the cordon
    await controller.reconcile_key("ml", "chat")
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 2


async def test_an_applying_reconcile_deletes_the_budget_of_the_shape_the_service_left(kube):
    body = {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": 1},
            "spec": {"model": {"name": "org/m"}, **PD}}
    kube.put(body)
    # The one budget over every pod that an older operator made: it would overlap the pools' own.
    old = children.build_pdb(body, "unified", 1)
    old["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels("chat")}}
    kube.put(old)
    await Controller(kube, OperatorMetrics()).reconcile_key("ml", "chat")
    assert kube.deleted("PodDisruptionBudget") == ["chat-engine"]
    assert sorted(n for k, _, n in kube.objects if k == "PodDisruptionBudget") == ["chat-decode", "chat-prefill"]


async def test_a_refused_deployment_leaves_the_surge_to_its_retry(kube):
    kube.put({"apiVersion": API, "kind": "InferenceService",
              "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": 1},
              "spec": {"model": {"name": "org/m"}}})
    kube.put(node("n1", unschedulable=True))
    kube.put(pod("a", "n1"))
    kube.reject[("Deployment", "chat-engine")] = Invalid(422, "Invalid", "refused")
    controller = Controller(kube, OperatorMetrics())
    await controller.reconcile_key("ml", "chat")
    assert "drain" not in kube.obj("InferenceService", "chat")["status"]
    assert "DrainSurge" not in kube.event_reasons()
    del kube.reject[("Deployment", "chat-engine")]
    await controller.reconcile_key("ml", "chat", apply_children=False)  # the surge still differs: applied
    assert kube.obj("Deployment", "chat-engine")["spec"]["replicas"] == 2
    assert kube.obj("InferenceService", "chat")["status"]["drain"]["pods"] == ["a"]
    assert kube.event_reasons().count("DrainSurge") == 1
