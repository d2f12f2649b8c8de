"""The shared fleet loop: who is ticked when, without a cluster."""
import asyncio

from gpufleet.fleet import fleet_loop
from gpufleet.fleet.fleet_loop import FleetLoop
from gpufleet.manifests import names


def svc(name, uid="u1", annotations=None, ns="ml"):
    return {"metadata": {"name": name, "namespace": ns, "uid": uid, "generation": 1,
                         "annotations": annotations or {}}, "spec": {}}


READY = {"ip": "10.0.0.1", "ready": True, "deleting": False}


def test_only_services_with_a_ready_replica_are_ticked_and_each_on_its_own_clock():
    fl = FleetLoop(ports=None, interval=1.0)
    for n in ("a", "b", "c"):
        fl.upsert_service(svc(n))
    fl.upsert_pod("ml", "a", "a-0", READY)
    fl.upsert_pod("ml", "b", "b-0", {**READY, "ready": False})
    fl.upsert_pod("ml", "c", "c-0", {**READY, "deleting": True})
    assert fl.due_now(100.0) == [("ml", "a")]
    assert fl.due_now(100.5) == []            # not due again before the interval
    assert fl.due_now(101.0) == [("ml", "a")]
    fl.upsert_pod("ml", "b", "b-0", READY)    # became ready: read at once
    assert fl.due_now(101.1) == [("ml", "b")]


def test_an_audit_request_is_answered_without_ready_replicas():
    fl = FleetLoop(ports=None, interval=1.0)
    fl.upsert_service(svc("a"))
    assert fl.due_now(10.0) == []
    fl.upsert_service(svc("a", annotations={names.ANNOTATION_AUDIT_REQUEST: "now"}))
    assert fl.due_now(10.1) == [("ml", "a")]


def test_deleted_services_and_pods_are_forgotten():
    fl = FleetLoop(ports=None, interval=1.0)
    fl.upsert_service(svc("a"))
    fl.upsert_pod("ml", "a", "a-0", READY)
    fl.upsert_pod("ml", "a", "a-0", None)
    assert fl.pods == {} and fl.due_now(5.0) == []
    fl.remove_service("ml", "a")
    assert fl.services == {}


async def test_a_slow_service_does_not_hold_back_the_others(monkeypatch):
    ticks: list[str] = []
    release, fifth_fast_tick = asyncio.Event(), asyncio.Event()

    class FakeLoop:
        def __init__(self, rt, ns, name, figures_interval=None):
            self.name = name

        async def tick(self, body, pods, now=None, demand=0, adapters=(), audits=True):
            ticks.append(self.name)
            if ticks.count("fast") == 5:
                fifth_fast_tick.set()
            if self.name == "slow":
                await release.wait()   # a replica that never answers

    monkeypatch.setattr(fleet_loop, "ServiceLoop", FakeLoop)
    fl = FleetLoop(ports=None, interval=0.05)
    for n in ("slow", "fast"):
        fl.upsert_service(svc(n))
        fl.upsert_pod("ml", n, f"{n}-0", READY)
    runner = asyncio.create_task(fl.run_forever())
    # The fast service keeps its 50 ms pace while the slow one's first tick hangs.
    await fifth_fast_tick.wait()
    release.set()
    runner.cancel()
    await fl.stop()
    assert ticks.count("slow") == 1          # one tick at a time per service


def test_service_loop_parses_the_spec_once_per_generation(monkeypatch):
    from gpufleet.fleet import service_loop
    calls = []
    real = service_loop.parse_spec
    monkeypatch.setattr(service_loop, "parse_spec", lambda s: calls.append(1) or real(s))
    from tests.support.fake_kube import FakeKube
    from tests.unit.fleet.test_service_loop import make_loop
    loop = make_loop(FakeKube())
    body = {"metadata": {"uid": "u", "generation": 1}, "spec": {"model": {"name": "org/m"}}}
    assert loop.spec_of(body) is loop.spec_of(body)
    body["metadata"]["generation"] = 2
    loop.spec_of(body)
    assert len(calls) == 2
    assert loop.spec_of({"metadata": {"uid": "u", "generation": 3}, "spec": {"model": 5}}) is None


async def test_a_service_deleted_unseen_is_forgotten_at_its_next_tick(monkeypatch):
    """Its DELETED event was lost (a watch stream broke as it went): the API's 404 naming it
    ends its ticks; a 404 about anything else, or about an older copy under that name, does not."""
    from gpufleet_kit.kube.errors import error_for

    def not_found(kind, name):
        return error_for(404, {"reason": "NotFound", "message": f'{kind} "{name}" not found',
                               "details": {"name": name, "kind": kind}}, "")

    raised = {"gone": not_found("inferenceservices", "gone"), "pod": not_found("pods", "pod-0"),
              "renamed": not_found("inferenceservices", "renamed")}

    class FakeLoop:
        def __init__(self, rt, ns, name, figures_interval=None):
            self.name = name

        async def tick(self, body, pods, now=None, demand=0, adapters=(), audits=True):
            if self.name == "renamed":  # re-created under its name while the tick was reading
                fl.upsert_service(svc("renamed", uid="u2"))
            raise raised[self.name]

    monkeypatch.setattr(fleet_loop, "ServiceLoop", FakeLoop)
    fl = FleetLoop(ports=None, interval=1.0)
    for n in ("gone", "pod", "renamed"):
        fl.upsert_service(svc(n))
        await fl._tick(("ml", n))
    assert set(fl.services) == {("ml", "pod"), ("ml", "renamed")}
    assert fl.services[("ml", "renamed")]["metadata"]["uid"] == "u2"


def test_a_services_copy_is_kept_without_its_managed_fields_and_apart_from_the_watch_events():
    fl = FleetLoop(ports=None, interval=1.0)
    body = svc("a")
    body["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:model": {}}}}]
    body["status"] = {"readyReplicas": 1}
    fl.upsert_service(body)
    stored = fl.services[("ml", "a")]
    assert "managedFields" not in stored["metadata"] and stored["status"] == {"readyReplicas": 1}
    assert stored["metadata"]["uid"] == "u1" and "managedFields" in body["metadata"]
    body["status"]["readyReplicas"] = 0        # the event's body is not the loop's copy
    assert stored["status"] == {"readyReplicas": 1}
