"""The canary end to end against the in-memory API server: the Controller's reconciles and the
CanaryLoop's ticks with fabricated replica samples (SLI counters). A spec change starts
<svc>-canary beside the untouched stable, steps advance, promotion ends on the new revision; an
SLI breach rolls back; abort rolls back; an admission-only change starts no canary."""
import copy
import json
from datetime import datetime, timedelta, timezone

import pytest

from gpufleet.autoscale.signals import ReplicaSample
from gpufleet.fleet.canary import CanaryLoop
from gpufleet.fleet.ports import ServicePorts
from gpufleet.manifests import names
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.wiring.controller import Controller
from gpufleet_api import parse_spec
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"
T0 = datetime(2026, 12, 4, 12, 0, 0, tzinfo=timezone.utc)


class Wall:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now


class Reader:
    def __init__(self):
        self.sli: dict[str, tuple] = {}

    async def sample(self, pod, ip):
        return ReplicaSample(pod=pod, ok=True, sli=self.sli.get(pod, ()))


STEPS = [{"weightPercent": 50, "holdSeconds": 10}, {"weightPercent": 100, "holdSeconds": 10}]


def isvc_body(image="engine:1", **rollout):
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": 1},
            "spec": {"model": {"name": "org/m"}, "engine": {"image": image}, "autoscaling": {"mode": "Manual"},
                     "replicas": 2, "rollout": {"strategy": "Canary", "steps": STEPS, **rollout}},
            "status": {}}


@pytest.fixture
def env():
    kube = FakeKube()
    wall = Wall()
    controller = Controller(kube, OperatorMetrics(), wall=wall)
    ports = ServicePorts(events=kube, status=controller, locks=controller, objects=kube, replicas=Reader(),
                         metrics=OperatorMetrics())
    return kube, controller, CanaryLoop(ports, "ml", "chat", wall=wall), wall


def obj(kube, kind="InferenceService", name="chat"):
    return kube.obj(kind, name)


def revision_of(dep):
    return dep["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION]


def set_spec(kube, **spec):
    o = obj(kube)
    o["spec"] = {**o["spec"], **spec}
    o["metadata"]["generation"] += 1


def roll_out(kube, name="chat-engine"):
    """The Deployment controller's part: every replica on the current template and ready."""
    d = obj(kube, "Deployment", name)
    n = d["spec"]["replicas"]
    d["status"] = {"observedGeneration": d["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                   "readyReplicas": n}


def pods_of(kube, ready=True):
    """Pod views (as the fleet loop keeps them) of what the Deployments run."""
    out = []
    for name in ("chat-engine", "chat-canary"):
        d = obj(kube, "Deployment", name)
        if d is None:
            continue
        labels = d["spec"]["template"]["metadata"]["labels"]
        for i in range(d["spec"]["replicas"]):
            out.append({"name": f"{name}-{i}", "ip": f"10.0.{len(out)}.1", "ready": ready, "deleting": False,
                        "role": "unified", "revision": labels[names.LABEL_REVISION],
                        "track": labels.get(names.LABEL_TRACK)})
    return out


async def tick(loop, kube, reader_sli=None):
    body = copy.deepcopy(obj(kube))
    pods = pods_of(kube)
    if reader_sli is not None:
        loop.ports.replicas.sli = reader_sli
    samples = [await loop.ports.replicas.sample(p["name"], p["ip"]) for p in pods]
    spec = parse_spec(body["spec"])
    await loop.tick(body, spec, pods, samples)


async def start_canary(kube, controller, **rollout):
    kube.put(isvc_body(**rollout))
    await controller.reconcile_key("ml", "chat")
    roll_out(kube)
    stable = copy.deepcopy(obj(kube, "Deployment", "chat-engine"))
    set_spec(kube, engine={"image": "engine:2"})
    await controller.reconcile_key("ml", "chat")
    return stable


async def test_a_new_revision_runs_as_a_canary_beside_the_untouched_stable_then_is_promoted(env):
    kube, controller, loop, wall = env
    stable = await start_canary(kube, controller)
    now_stable = obj(kube, "Deployment", "chat-engine")
    assert now_stable["spec"]["template"] == stable["spec"]["template"]  # not rolled
    canary = obj(kube, "Deployment", "chat-canary")
    assert canary["spec"]["replicas"] == 1 and revision_of(canary) != revision_of(stable)
    rollout = obj(kube)["status"]["rollout"]
    assert rollout == {**rollout, "stableRevision": revision_of(stable), "canaryRevision": revision_of(canary),
                       "canaryWeightPercent": 50, "phase": "Progressing", "step": 0}
    cm = obj(kube, "ConfigMap", "chat-guard")
    assert json.loads(cm["data"]["guard.json"])["engine"] == json.loads(cm["data"]["guard-canary.json"])["engine"]
    assert "CanaryStarted" in kube.event_reasons()
    assert c.get(obj(kube)["status"]["conditions"], c.PROGRESSING)["reason"] == "Canary"

    await tick(loop, kube)            # the hold has not passed
    assert obj(kube)["status"]["rollout"]["step"] == 0
    wall.now += timedelta(seconds=11)
    await tick(loop, kube)
    assert obj(kube)["status"]["rollout"]["step"] == 1
    assert obj(kube, "Deployment", "chat-canary")["spec"]["replicas"] == 2
    wall.now += timedelta(seconds=11)
    await tick(loop, kube)
    assert obj(kube)["status"]["rollout"]["phase"] == "Promoting"
    promoted = obj(kube, "Deployment", "chat-engine")
    assert revision_of(promoted) == revision_of(canary)
    assert promoted["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert obj(kube, "Deployment", "chat-canary")["spec"]["replicas"] == 2  # carries the traffic meanwhile

    roll_out(kube)                    # the stable's replicas are all on the new revision
    # What the stable Deployment's status move asks for (reconcile/child_events.py): a status refresh,
    # which runs the canary's plan while a canary is there.
    await controller.reconcile_key("ml", "chat", apply_children=False)
    rollout = obj(kube)["status"]["rollout"]
    assert rollout["phase"] == "Promoted" and "canaryRevision" not in rollout
    assert rollout["stableRevision"] == revision_of(canary) and rollout["canaryWeightPercent"] == 0
    assert obj(kube, "Deployment", "chat-canary") is None
    assert obj(kube, "Deployment", "chat-engine")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1
    assert kube.event_reasons().count("CanaryStep") == 2 and "CanaryPromoted" in kube.event_reasons()


async def test_an_sli_breach_of_the_canary_rolls_it_back_and_is_not_retried(env):
    kube, controller, loop, wall = env
    stable = await start_canary(kube, controller)
    canary_pod = next(p["name"] for p in pods_of(kube) if p["track"] == "canary")
    # The first step counts the canary's replicas from zero (they started with it).
    await tick(loop, kube, {canary_pod: (("availability", 100.0, 100.0),)})
    assert obj(kube)["status"]["rollout"]["phase"] == "Progressing"
    await tick(loop, kube, {canary_pod: (("availability", 130.0, 120.0),),     # 10 of 130 failed
                            "chat-engine-0": (("availability", 500.0, 500.0),)})
    rollout = obj(kube)["status"]["rollout"]
    assert rollout["phase"] == "RolledBack" and "canaryRevision" not in rollout
    assert rollout["canaryWeightPercent"] == 0
    assert "availability: 10 of 130 events bad" in rollout["message"]
    assert obj(kube, "Deployment", "chat-canary") is None
    assert obj(kube, "Deployment", "chat-engine")["spec"]["template"] == stable["spec"]["template"]
    degraded = c.get(obj(kube)["status"]["conditions"], c.DEGRADED)
    assert degraded["status"] == "True" and degraded["reason"] == "CanaryRolledBack"
    assert "availability" in degraded["message"]
    assert kube.event_reasons().count("CanaryRolledBack") == 1
    await controller.reconcile_key("ml", "chat")     # the same spec: not tried again
    assert obj(kube, "Deployment", "chat-canary") is None
    set_spec(kube, engine={"image": "engine:3"})      # a new revision is
    await controller.reconcile_key("ml", "chat")
    assert obj(kube, "Deployment", "chat-canary") is not None
    assert obj(kube)["status"]["rollout"]["phase"] == "Progressing"


async def test_abort_rolls_the_canary_back_and_starts_none_while_true(env):
    kube, controller, loop, wall = env
    await start_canary(kube, controller)
    set_spec(kube, rollout={"strategy": "Canary", "steps": STEPS, "abort": True})
    await controller.reconcile_key("ml", "chat")
    assert obj(kube, "Deployment", "chat-canary") is None
    assert obj(kube)["status"]["rollout"]["phase"] == "Aborted"
    assert "CanaryAborted" in kube.event_reasons()
    set_spec(kube, rollout={"strategy": "Canary", "steps": STEPS, "abort": False})
    await controller.reconcile_key("ml", "chat")
    assert obj(kube, "Deployment", "chat-canary") is not None


async def test_an_admission_only_change_reloads_live_and_starts_no_canary(env):
    kube, controller, loop, wall = env
    kube.put(isvc_body())
    await controller.reconcile_key("ml", "chat")
    roll_out(kube)
    before = copy.deepcopy(obj(kube, "Deployment", "chat-engine")["spec"]["template"])
    set_spec(kube, admission={"kvWatermarkPercent": 11})
    await controller.reconcile_key("ml", "chat")
    assert obj(kube, "Deployment", "chat-canary") is None
    assert obj(kube, "Deployment", "chat-engine")["spec"]["template"] == before
    assert json.loads(obj(kube, "ConfigMap", "chat-guard")["data"]["guard.json"])["kvWatermarkPercent"] == 11
    assert "CanaryStarted" not in kube.event_reasons()


async def test_the_rolling_strategy_writes_no_rollout_status_and_rolls_the_stable(env):
    kube, controller, loop, wall = env
    body = isvc_body()
    del body["spec"]["rollout"]
    kube.put(body)
    await controller.reconcile_key("ml", "chat")
    roll_out(kube)
    first = revision_of(obj(kube, "Deployment", "chat-engine"))
    set_spec(kube, engine={"image": "engine:2"})
    await controller.reconcile_key("ml", "chat")
    assert revision_of(obj(kube, "Deployment", "chat-engine")) != first
    assert obj(kube, "Deployment", "chat-canary") is None and "rollout" not in obj(kube)["status"]


async def test_a_later_step_judges_only_what_the_canary_served_since_the_step_began(env):
    kube, controller, loop, wall = env
    await start_canary(kube, controller)
    canary_pod = next(p["name"] for p in pods_of(kube) if p["track"] == "canary")
    wall.now += timedelta(seconds=11)
    await tick(loop, kube, {canary_pod: (("availability", 100.0, 90.0),)})   # step 0 ends: 10 of 100 bad...
    rollout = obj(kube)["status"]["rollout"]
    assert rollout["phase"] == "RolledBack"                                    # ...which is a breach there
    # A fresh canary whose first step was clean reaches step 1 with its counters as the baseline.
    set_spec(kube, engine={"image": "engine:3"})
    await controller.reconcile_key("ml", "chat")
    canary_pod = next(p["name"] for p in pods_of(kube) if p["track"] == "canary")
    wall.now += timedelta(seconds=11)
    await tick(loop, kube, {canary_pod: (("availability", 100.0, 100.0),)})
    assert obj(kube)["status"]["rollout"]["step"] == 1
    pods = [p["name"] for p in pods_of(kube) if p["track"] == "canary"]
    # Half of these failed before step 1 began (it would be a breach counted from zero)...
    await tick(loop, kube, {p: (("availability", 100.0, 50.0),) for p in pods})
    # ...but over step 1 all 30 of each replica's new requests succeeded.
    await tick(loop, kube, {p: (("availability", 130.0, 80.0),) for p in pods})
    assert obj(kube)["status"]["rollout"]["phase"] == "Progressing"
    await tick(loop, kube, {p: (("availability", 160.0, 100.0),) for p in pods})   # 10 of 60 bad: breach
    rollout = obj(kube)["status"]["rollout"]
    assert rollout["phase"] == "RolledBack" and f"10 of {30 * len(pods)} events bad" not in rollout["message"]
    assert f"{10 * len(pods)} of {60 * len(pods)} events bad" in rollout["message"]
