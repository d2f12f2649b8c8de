"""The operator's side of name ownership: the claim index the watches feed (which objects a change touches),
the NameConflict condition a losing InferenceService or InferenceAdapter gets, its one Event, and its
clearing when the owner goes (reconcile/name_conflicts.py, the controller, the adapters' status writer)."""
from __future__ import annotations

from gpufleet.adapters.index import AdapterIndex
from gpufleet.fleet.adapter_sync import OrphanAdapters
from gpufleet.fleet.ports import ServicePorts
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.name_conflicts import NameClaimIndex, condition, started
from gpufleet.wiring.controller import Controller
from gpufleet_api.name_claims import ADAPTER, SERVICE
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"
T1, T2, T3 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"


def isvc(name: str, ns: str, created: str, served: str = "customer-a", generation: int = 1) -> dict:
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": name, "namespace": ns, "uid": f"u-{ns}-{name}", "generation": generation,
                         "creationTimestamp": created},
            "spec": {"model": {"name": "org/m", "servedName": served}}, "status": {}}


def adapter(name: str, ns: str, created: str, service: str = "base") -> dict:
    return {"apiVersion": API, "kind": "InferenceAdapter",
            "metadata": {"name": name, "namespace": ns, "generation": 1, "creationTimestamp": created},
            "spec": {"service": service, "source": {"uri": f"https://store/{name}.tar"}}}


def test_the_index_answers_which_objects_a_change_touched_and_deletion_frees_the_name():
    index = NameClaimIndex()
    assert index.upsert_service(isvc("a", "team-a", T1)) == set()
    assert index.upsert_service(isvc("b", "team-b", T2)) == {(SERVICE, "team-b", "b")}
    conflict = index.conflict(SERVICE, "team-b", "b")
    assert conflict is not None and conflict.owner.key == (SERVICE, "team-a", "a")
    # A status write (same generation) is not parsed again and changes nothing.
    assert index.upsert_service(isvc("b", "team-b", T2)) == set()
    assert index.upsert_service(isvc("other", "team-c", T1, served="other")) == set()
    # The owner deleted: team-b's service owns the name now.
    assert index.remove(SERVICE, "team-a", "a") == {(SERVICE, "team-b", "b")}
    assert index.conflict(SERVICE, "team-b", "b") is None


def test_an_older_adapter_elsewhere_makes_a_service_lose_and_renaming_the_service_ends_it():
    index = NameClaimIndex()
    index.upsert_adapter(adapter("customer-a", "team-a", T1))
    assert index.upsert_service(isvc("b", "team-b", T2)) == {(SERVICE, "team-b", "b")}
    assert index.upsert_service(isvc("b", "team-b", T2, served="customer-b", generation=2)) == \
        {(SERVICE, "team-b", "b")}
    assert index.conflict(SERVICE, "team-b", "b") is None
    assert index.conflict(ADAPTER, "team-a", "customer-a") is None


def test_the_condition_is_true_naming_the_owner_then_false_once_and_only_where_it_was_true():
    index = NameClaimIndex()
    index.upsert_service(isvc("a", "team-a", T1))
    index.upsert_service(isvc("b", "team-b", T2))
    on = condition(index.conflict(SERVICE, "team-b", "b"), [], 1)
    assert on == [{"type": "NameConflict", "status": "True", "reason": "NameClaimedElsewhere",
                   "message": "team-a/a already serves model 'customer-a'; give this InferenceService another "
                              "spec.model.servedName", "observedGeneration": 1}]
    assert started([], on) == on[0]["message"] and started(on, on) is None
    off = condition(None, on, 1)
    assert off[0]["status"] == "False" and off[0]["reason"] == "NameOwned"
    assert condition(None, off, 1) == [] and condition(None, [], 1) == []


async def test_the_losing_service_gets_name_conflict_with_one_event_and_it_clears_when_the_owner_goes():
    kube = FakeKube()
    controller = Controller(kube, OperatorMetrics())
    kube.put(isvc("a", "team-a", T1))
    kube.put(isvc("b", "team-b", T2))
    for key in (("team-a", "a"), ("team-b", "b")):
        controller.names.upsert_service(kube.obj("InferenceService", key[1], key[0]))
    for _ in range(2):   # a second reconcile repeats neither the condition's change nor the Event
        await controller.reconcile_key("team-b", "b")
        await controller.reconcile_key("team-a", "a")
    lost = c.get(kube.obj("InferenceService", "b", "team-b")["status"]["conditions"], c.NAME_CONFLICT)
    assert lost is not None and lost["status"] == "True" and "team-a/a" in lost["message"]
    assert "spec.model.servedName" in lost["message"]
    assert c.get(kube.obj("InferenceService", "a", "team-a")["status"]["conditions"], c.NAME_CONFLICT) is None
    warnings = [e for e in kube.events if e["reason"] == "NameConflict"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning" and "team-a/a" in warnings[0]["message"]
    controller.names.remove(SERVICE, "team-a", "a")
    await controller.reconcile_key("team-b", "b")
    cleared = c.get(kube.obj("InferenceService", "b", "team-b")["status"]["conditions"], c.NAME_CONFLICT)
    assert cleared is not None and cleared["status"] == "False"
    assert len([e for e in kube.events if e["reason"] == "NameConflict"]) == 1


async def test_a_losing_adapter_gets_name_conflict_beside_its_ready_condition_and_one_event():
    kube = FakeKube()
    names = NameClaimIndex()
    names.upsert_service(isvc("a", "team-a", T1))
    body = kube.put(adapter("customer-a", "team-b", T2, service="missing"))
    names.upsert_adapter(body)
    ports = ServicePorts(events=kube, status=None, locks=None, objects=kube, replicas=None,  # type: ignore[arg-type]
                         metrics=OperatorMetrics(), names=names)
    orphans, index = OrphanAdapters(ports), AdapterIndex()
    index.upsert(body)
    for _ in range(2):
        await orphans.tick([index.get("team-b", "customer-a")], watching_for=60.0)   # type: ignore[list-item]
    conditions = kube.obj("InferenceAdapter", "customer-a", "team-b")["status"]["conditions"]
    lost = c.get(conditions, c.NAME_CONFLICT)
    assert lost is not None and lost["status"] == "True" and "team-a/a already serves model" in lost["message"]
    assert "rename this InferenceAdapter" in lost["message"]
    assert c.get(conditions, c.READY)["reason"] == "ServiceNotFound"   # type: ignore[index]
    assert [e["reason"] for e in kube.events].count("NameConflict") == 1
    names.remove(SERVICE, "team-a", "a")
    await orphans.tick([index.get("team-b", "customer-a")], watching_for=60.0)   # type: ignore[list-item]
    conditions = kube.obj("InferenceAdapter", "customer-a", "team-b")["status"]["conditions"]
    assert c.get(conditions, c.NAME_CONFLICT)["status"] == "False"   # type: ignore[index]


async def test_the_runtime_refreshes_the_loser_when_a_watch_shows_a_claim_come_or_go(tmp_path):
    from gpufleet.settings import OperatorSettings
    from gpufleet.wiring.runtime import OperatorRuntime
    from gpufleet_kit.kube.config import KubeConfig
    from tests.unit.test_settings import KUBECONFIG
    (tmp_path / "config").write_text(KUBECONFIG)
    rt = OperatorRuntime(KubeConfig.from_file(str(tmp_path / "config")), OperatorSettings())
    try:
        assert rt.fleet is not None and rt.fleet.ports.names is rt.controller.names
        rt.service_seen(isvc("b", "team-b", T2))
        rt.drain_triggered()
        rt.adapter_changed("team-a", "customer-a", adapter("customer-a", "team-a", T1))   # older: b loses
        assert rt.drain_triggered() == {("team-b", "b"): False}
        rt.adapter_changed("team-a", "customer-a", None)                                  # deleted: b owns it
        assert rt.drain_triggered() == {("team-b", "b"): False}
        rt.service_seen(isvc("a", "team-a", T1))                                          # an older service
        assert rt.drain_triggered() == {("team-b", "b"): False}
        rt.forget("team-a", "a")
        assert rt.drain_triggered() == {("team-b", "b"): False}
    finally:
        await rt.kube.close()
