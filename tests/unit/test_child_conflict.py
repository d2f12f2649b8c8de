"""The controller never applies over an object it does not own (reconcile/ownership.py): an object
holding a child's name is left as it is, the service says ChildConflict naming it and the fix, with one
Event, and is reconciled once the name is free; its own children are applied without being read."""
import asyncio
import copy

import pytest

from gpufleet.manifests import names
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.ownership import CHILD_CONFLICT
from gpufleet.wiring.children import CONFLICT_RETRY_FIRST_S
from gpufleet.wiring.controller import Controller
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def isvc(generation=1, status=None, uid="u-chat"):
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": uid, "generation": generation},
            "spec": {"model": {"name": "org/m"}}, "status": status or {}}


TEAM_CONFIG = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "chat-guard", "namespace": "ml", "uid": "u-team",
                            "managedFields": [{"manager": "kubectl-create", "operation": "Update"}]},
               "data": {"settings.yaml": "the team's own"}}
TEAM_SERVICE = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "chat", "namespace": "ml", "uid": "u-web",
                             "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                                                  "uid": "u-web-dep", "controller": True}]},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}


@pytest.fixture
def kube():
    return FakeKube()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def controller(kube, clock):
    return Controller(kube, OperatorMetrics(), clock=clock)


def conditions(kube) -> dict:
    return {x["type"]: x for x in kube.obj("InferenceService", "chat")["status"].get("conditions") or []}


def applies(kube) -> list[tuple[str, str]]:
    return [(key[0], key[2]) for verb, key, _ in kube.writes if verb == "apply"]


async def test_an_unowned_configmap_with_the_guard_configs_name_is_left_alone_and_reported(kube, controller):
    kube.put(TEAM_CONFIG)
    before = kube.obj("ConfigMap", "chat-guard")
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert kube.obj("ConfigMap", "chat-guard") == before          # not a field of it changed
    assert applies(kube) == []                                    # and nothing else of the service applied
    conflict = conditions(kube)[CHILD_CONFLICT]
    assert conflict["status"] == "True" and conflict["reason"] == CHILD_CONFLICT
    assert conflict["message"].startswith("ConfigMap chat-guard (no owner; written by kubectl-create) already exists")
    assert "Delete or rename that object, or rename the InferenceService" in conflict["message"]
    ready = conditions(kube)[c.READY]
    assert ready["status"] == "False" and ready["reason"] == CHILD_CONFLICT
    assert conditions(kube)[c.PROGRESSING]["reason"] == CHILD_CONFLICT
    assert kube.event_reasons() == [CHILD_CONFLICT] and kube.events[0]["type"] == "Warning"
    assert "chat-guard" in kube.events[0]["message"]


async def test_a_service_of_the_same_name_owned_by_another_controller_is_left_alone(kube, controller):
    kube.put(TEAM_SERVICE)
    before = kube.obj("Service", "chat")
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert kube.obj("Service", "chat") == before
    assert applies(kube) == []
    assert "Service chat (controlled by Deployment web)" in conditions(kube)[CHILD_CONFLICT]["message"]


async def test_every_conflicting_object_is_named_at_once(kube, controller):
    kube.put(TEAM_CONFIG)
    kube.put(TEAM_SERVICE)
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    message = conditions(kube)[CHILD_CONFLICT]["message"]
    assert "ConfigMap chat-guard" in message and "Service chat" in message and "those objects" in message


async def test_the_conflict_is_not_reposted_or_rewritten_while_it_stands(kube, controller, clock):
    kube.put(TEAM_CONFIG)
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    status = copy.deepcopy(kube.obj("InferenceService", "chat")["status"])
    await controller.reconcile_key("ml", "chat", apply_children=False)   # a status refresh before the retry
    clock.now += CONFLICT_RETRY_FIRST_S
    await controller.reconcile_key("ml", "chat", apply_children=False)   # the retry: still there
    assert kube.obj("InferenceService", "chat")["status"] == status
    assert kube.event_reasons() == [CHILD_CONFLICT]
    assert applies(kube) == []


async def test_the_retry_backs_off_and_the_runtime_is_told_when(kube, controller, clock):
    kube.put(TEAM_CONFIG)
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert controller.conflict_retry_in("ml", "chat") == CONFLICT_RETRY_FIRST_S
    gets = kube.calls["get", "ConfigMap"]
    clock.now += 1
    await controller.reconcile_key("ml", "chat", apply_children=False)   # not due: nothing read
    assert kube.calls["get", "ConfigMap"] == gets
    clock.now += CONFLICT_RETRY_FIRST_S
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.calls["get", "ConfigMap"] == gets + 1
    assert controller.conflict_retry_in("ml", "chat") == 2 * CONFLICT_RETRY_FIRST_S   # doubled


async def test_once_the_object_is_gone_the_service_reconciles_and_the_condition_clears(kube, controller, clock):
    kube.put(TEAM_CONFIG)
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    await kube.delete("v1", "ConfigMap", "chat-guard", "ml")
    clock.now += CONFLICT_RETRY_FIRST_S
    await controller.reconcile_key("ml", "chat", apply_children=False)   # the runtime's timed retry
    assert kube.obj("Deployment", "chat-engine") is not None
    cm = kube.obj("ConfigMap", "chat-guard")
    assert names.guard_config_key() in cm["data"]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "u-chat"
    conflict = conditions(kube)[CHILD_CONFLICT]
    assert conflict["status"] == "False" and conflict["reason"] == "NoConflict"
    assert conditions(kube)[c.READY]["reason"] != CHILD_CONFLICT
    assert controller.conflict_retry_in("ml", "chat") is None


async def test_a_new_spec_looks_again_at_once(kube, controller):
    kube.put(TEAM_CONFIG)
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    await kube.delete("v1", "ConfigMap", "chat-guard", "ml")
    kube.put(isvc(generation=2, status=kube.obj("InferenceService", "chat")["status"]))
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.obj("ConfigMap", "chat-guard") is not None
    assert conditions(kube)[CHILD_CONFLICT]["status"] == "False"


async def test_a_service_that_never_conflicted_gets_no_conflict_condition(kube, controller):
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert CHILD_CONFLICT not in conditions(kube)
    assert kube.obj("Deployment", "chat-engine") is not None


async def test_the_services_own_children_are_not_read_again_before_each_apply(kube, controller):
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")    # first apply: each child's name is looked at once
    first = sum(n for (verb, _), n in kube.calls.items() if verb == "get")
    await controller.reconcile_key("ml", "chat", apply_children=True)
    assert sum(n for (verb, _), n in kube.calls.items() if verb == "get") - first == 1   # the service itself only


async def test_children_of_a_former_service_of_the_same_name_are_adopted(kube, controller):
    kube.put(isvc(uid="u-old"))
    await controller.reconcile_key("ml", "chat")
    kube.objects.pop(("InferenceService", "ml", "chat"))
    kube.put(isvc(uid="u-new"))                      # deleted and created again before the collector ran
    await controller.reconcile_key("ml", "chat")
    assert CHILD_CONFLICT not in conditions(kube)
    assert kube.obj("ConfigMap", "chat-guard")["metadata"]["ownerReferences"][0]["uid"] == "u-new"


async def test_an_orphaned_child_with_the_services_labels_is_adopted(kube, controller):
    kube.put({"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "chat-guard", "namespace": "ml", "labels": names.common_labels("chat")},
              "data": {}})
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert CHILD_CONFLICT not in conditions(kube)
    assert kube.obj("ConfigMap", "chat-guard")["metadata"]["ownerReferences"][0]["uid"] == "u-chat"


async def test_a_foreign_canary_named_deployment_is_not_deleted(kube, controller):
    """``<service>-canary`` is removed when no canary runs, only when it is the service's."""
    kube.put({"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "chat-canary", "namespace": "ml", "labels": names.selector_labels("chat")},
              "spec": {}})
    kube.put(isvc())
    await controller.reconcile_key("ml", "chat")
    assert kube.deleted("Deployment") == []


async def test_the_runtime_looks_again_when_the_conflict_is_due(tmp_path, monkeypatch):
    """The object holding the name is not watched: the runtime sets a timer for the controller's retry."""
    from gpufleet.settings import OperatorSettings
    from gpufleet.wiring.runtime import OperatorRuntime
    from gpufleet_kit.kube.config import KubeConfig
    from tests.unit.test_settings import KUBECONFIG
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    rt = OperatorRuntime(KubeConfig.from_file(str(path)), OperatorSettings(fleet_loops=False))
    try:
        rt.known.add(("ml", "chat"))
        retry_in = {"chat": 0.0}

        async def reconcile_key(ns, name, apply_children=True):
            pass
        monkeypatch.setattr(rt.controller, "reconcile_key", reconcile_key)
        monkeypatch.setattr(rt.controller, "conflict_retry_in", lambda ns, name: retry_in.get(name))
        await rt._reconcile("ml", "chat", True)
        assert ("ml", "chat") in rt._retries
        assert await asyncio.wait_for(rt.next_triggered(), 5) == {("ml", "chat"): False}   # the timer asked
        assert ("ml", "chat") not in rt._retries
        retry_in.clear()
        await rt._reconcile("ml", "chat", False)
        assert ("ml", "chat") not in rt._retries   # no conflict: no timer
    finally:
        await rt.kube.close()
