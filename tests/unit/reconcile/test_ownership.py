"""Whose an object holding a child's name is (reconcile/ownership.py): the operator's own, adopted, or
another's it must not apply over; and that no two InferenceServices of a namespace derive one name."""
import functools
import itertools

import pytest

from gpufleet.manifests import names, pools
from gpufleet.manifests.network_policy import EngineIngress
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.desired import CanaryChildren, desired_children
from gpufleet.reconcile.ownership import CHILD_CONFLICT, Foreign, cleared, conflict_conditions, holder, owned_by
from gpufleet_api import parse_spec

API = "serving.gpufleet.dev/v1alpha1"


def isvc(name="chat", uid="u-chat"):
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name, "namespace": "ml", "uid": uid}}


def existing(kind="ConfigMap", name="chat-guard", *, owners=(), labels=None, managers=()):
    meta = {"name": name, "namespace": "ml", "ownerReferences": list(owners), "labels": labels or {},
            "managedFields": [{"manager": m, "operation": "Update"} for m in managers]}
    return {"apiVersion": "v1", "kind": kind, "metadata": meta}


def ref(kind="InferenceService", name="chat", uid="u-chat", api=API, controller=True):
    return {"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": controller}


def test_a_configmap_someone_created_with_the_guard_configs_name_is_not_the_services():
    cm = existing(managers=["kubectl-create"])
    assert holder(isvc(), cm) == "no owner; written by kubectl-create"


def test_a_service_of_the_same_name_run_by_another_controller_is_not_the_services():
    svc = existing("Service", "chat", owners=[ref("Deployment", "web", "u-web", "apps/v1")])
    assert holder(isvc(), svc) == "controlled by Deployment web"


def test_an_object_with_no_owner_and_no_manager_is_still_not_the_services():
    assert holder(isvc(), existing("Service", "chat")) == "no owner"


def test_a_non_controller_owner_is_named():
    svc = existing("Service", "chat", owners=[ref("Application", "shop", "u-shop", "argoproj.io/v1alpha1",
                                                  controller=False)])
    assert holder(isvc(), svc) == "owned by Application shop"


def test_the_services_own_child_is_applied_over():
    assert holder(isvc(), existing(owners=[ref()])) is None


def test_a_child_of_a_former_service_of_the_same_name_is_adopted():
    # Deleted and created again before the garbage collector removed its children.
    assert holder(isvc(uid="u-new"), existing(owners=[ref(uid="u-old")])) is None


def test_another_inference_services_child_is_not_taken():
    other = existing(owners=[ref(name="other", uid="u-other")])
    assert holder(isvc(), other) == "controlled by InferenceService other"


def test_a_same_named_owner_of_another_group_is_not_the_service():
    foreign = existing(owners=[ref(uid="u-kserve", api="example.com/v1")])
    assert holder(isvc(), foreign) == "controlled by InferenceService chat"


def test_an_orphaned_child_with_the_services_labels_is_adopted():
    orphan = existing(labels=names.common_labels("chat"), managers=["gpufleet"])
    assert holder(isvc(), orphan) is None


def test_the_labels_of_another_service_do_not_make_an_orphan_this_ones():
    assert holder(isvc(), existing(labels=names.common_labels("other"))) == "no owner"


def test_owned_by_reads_only_an_inference_service_controller():
    assert owned_by(existing(owners=[ref(uid="u-1")])) == "u-1"
    assert owned_by(existing(owners=[ref(uid="u-1", controller=False)])) is None
    assert owned_by(existing(owners=[ref("Deployment", "web", "u-web", "apps/v1")])) is None
    assert owned_by(existing()) is None


def test_the_conflict_names_the_object_its_holder_and_the_fix():
    conflict, ready, progressing = conflict_conditions(
        isvc(), [Foreign("ConfigMap", "chat-guard", "no owner; written by kubectl-create")], 4)
    assert conflict["type"] == CHILD_CONFLICT and conflict["status"] == "True" and conflict["observedGeneration"] == 4
    assert conflict["message"] == (
        "ConfigMap chat-guard (no owner; written by kubectl-create) already exists and is not this "
        "InferenceService's: nothing of chat is applied while it does. Delete or rename that object, or rename "
        "the InferenceService")
    assert ready["status"] == "False" and ready["reason"] == CHILD_CONFLICT and ready["message"] == conflict["message"]
    assert progressing["status"] == "False" and progressing["reason"] == CHILD_CONFLICT


def test_the_condition_clears_only_where_it_was_set():
    assert cleared({}, 2) == []
    before = {"conditions": conflict_conditions(isvc(), [Foreign("Service", "chat", "no owner")], 2)}
    after, = cleared(before, 2)
    assert after["type"] == CHILD_CONFLICT and after["status"] == "False" and after["reason"] == "NoConflict"
    assert cleared({"conditions": [after]}, 2) == []


# --- no two services of a namespace derive the same child name --------------------------------------

INGRESS = EngineIngress(operator_namespace="gpufleet", operator_pod_labels={"app": "gpufleet"})
SHAPES = {
    # unified, with a claim for the model cache, and a canary beside the stable Deployment
    "unified": ({"model": {"name": "org/m", "cache": {"persistentVolumeClaim": {"size": "100Gi"}}}},
                CanaryChildren(canary_replicas=1, canary_key=True)),
    # prefill and decode pools with the KV store's claim
    "disaggregated": ({"model": {"name": "org/m"}, "disaggregation": {}, "engine": {"kvTransfer": {
        "connector": "SharedStorage", "sharedStorage": {"persistentVolumeClaim": {"size": "10Gi"}}}}}, None),
}


@functools.cache
def child_keys(service: str, shape: str) -> frozenset[tuple[str, str]]:
    raw, canary = SHAPES[shape]
    spec = parse_spec(raw)
    objs = desired_children(isvc(service, f"u-{service}"), spec, {p.role: 1 for p in pools.pools(spec)},
                            with_podmonitor=True, engine_ingress=INGRESS, canary=canary)
    return frozenset((o["kind"], o["metadata"]["name"]) for o in objs)


def test_every_shape_renders_every_kind_of_child():
    kinds = {kind for shape in SHAPES for kind, _ in child_keys("a", shape)}
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor", "NetworkPolicy",
                     "PersistentVolumeClaim"}


# Service names built from another's children's suffixes: "a-guard" is a's ConfigMap's name,
# "a-engine" its Deployment's, and so on.
TRICKY = ["a", "a-guard", "a-engine", "a-prefill", "a-decode", "a-canary", "a-kv-store", "a-model-cache",
          "a-engine-engine", "engine", "guard"]


@pytest.mark.parametrize("first,second", list(itertools.combinations(TRICKY, 2)))
def test_two_services_of_one_namespace_never_derive_the_same_child(first, second):
    """Within a kind every child name ends in a suffix of its own (or is the service's name), so two
    services, whatever their shapes, cannot claim one object: a conflict is always with a foreign object."""
    for a_shape, b_shape in itertools.product(SHAPES, repeat=2):
        assert not child_keys(first, a_shape) & child_keys(second, b_shape), (first, a_shape, second, b_shape)


def test_a_condition_of_the_conflict_type_sorts_after_the_summary():
    merged = c.merge([], conflict_conditions(isvc(), [Foreign("Service", "chat", "no owner")], 1), "now")
    assert merged[0]["type"] == c.READY
