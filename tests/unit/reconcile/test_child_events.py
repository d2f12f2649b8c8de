"""Which child watch events re-apply a service's children (reconcile/child_events.py)."""
from gpufleet.reconcile.child_events import Action, AppliedChildren


def deployment(rv: str, generation: int, name: str = "svc-engine") -> dict:
    return {"kind": "Deployment", "metadata": {"namespace": "ns", "name": name, "resourceVersion": rv,
                                               "generation": generation}}


def configmap(rv: str) -> dict:
    return {"kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "svc-guard", "resourceVersion": rv}}


def test_the_operators_own_write_coming_back_asks_for_nothing():
    applied = AppliedChildren()
    applied.applied(deployment("10", 2))
    applied.applied(configmap("11"))
    assert applied.event("MODIFIED", deployment("10", 2)) is Action.NOTHING
    assert applied.event("ADDED", configmap("11")) is Action.NOTHING


def test_a_status_move_refreshes_status_only():
    applied = AppliedChildren()
    applied.applied(deployment("10", 2))
    assert applied.event("MODIFIED", deployment("14", 2)) is Action.STATUS


def test_a_spec_someone_else_changed_is_applied_again():
    applied = AppliedChildren()
    applied.applied(deployment("10", 2))
    assert applied.event("MODIFIED", deployment("15", 3)) is Action.APPLY   # kubectl scale, kubectl edit


def test_a_kind_without_generation_changed_by_someone_else_is_applied_again():
    applied = AppliedChildren()
    applied.applied(configmap("11"))
    assert applied.event("MODIFIED", configmap("12")) is Action.APPLY


def test_a_deleted_child_is_applied_again_and_forgotten():
    applied = AppliedChildren()
    applied.applied(deployment("10", 2))
    assert applied.event("DELETED", deployment("10", 2)) is Action.APPLY
    assert len(applied) == 0
    # Not stored any more: even its old version is applied again when it shows up.
    assert applied.event("ADDED", deployment("10", 2)) is Action.APPLY


def test_a_child_never_stored_is_applied_after_a_restart():
    applied = AppliedChildren()
    assert applied.event(None, deployment("10", 2)) is Action.APPLY
    assert applied.event("ADDED", configmap("3")) is Action.APPLY


def test_children_are_told_apart_by_kind_and_name():
    applied = AppliedChildren()
    applied.applied(deployment("10", 2))
    assert applied.event("MODIFIED", deployment("10", 2, name="svc-engine-canary")) is Action.APPLY


def owned(obj: dict, uid: str) -> dict:
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
                                           "name": "svc", "uid": uid, "controller": True}]
    return obj


def test_the_owner_of_a_child_is_known_from_the_apply_and_from_the_watch_until_it_is_deleted():
    applied = AppliedChildren()
    assert applied.owner("ConfigMap", "ns", "svc-guard") is None
    applied.applied(owned(configmap("11"), "u-1"))
    assert applied.owner("ConfigMap", "ns", "svc-guard") == "u-1"
    applied.event("ADDED", owned(deployment("12", 1), "u-1"))   # listed after a restart
    assert applied.owner("Deployment", "ns", "svc-engine") == "u-1"
    applied.event("DELETED", owned(configmap("13"), "u-1"))
    assert applied.owner("ConfigMap", "ns", "svc-guard") is None   # a foreign object may take the name now
    applied.event("MODIFIED", deployment("14", 2))                  # its owner reference removed
    assert applied.owner("Deployment", "ns", "svc-engine") is None
