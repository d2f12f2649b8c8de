"""spec.rollout Canary against the real API server, the operator process and kwok pods: a change of
what a replica serves starts <svc>-canary beside the untouched stable, the steps advance (tiny holds;
the kwok pods report no SLIs, so no step is judged), and promotion ends with the stable on the new
revision and no canary; abort rolls the canary back; a canary whose replica reports SLI counters
over the budget (fake replica metrics on the kwok pod IPs) is rolled back. The API server refuses bad steps and
spec.rollout with spec.disaggregation, naming the field."""
import pytest
import yaml

from gpufleet_dev.fake_replicas import FakeReplicaMetrics, sli_counters
from tests.support.waiting import PODS_START_SECONDS, wait_for

API = "serving.gpufleet.dev/v1alpha1"
REVISION = "gpufleet.dev/revision"


def manifest(name, image="registry.example/engine:1", **rollout):
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"name": "org/canary-model"}, "engine": {"image": image},
                     "isolation": {"mode": "Shared"}, "autoscaling": {"mode": "Manual"}, "replicas": 1,
                     "rollout": {"strategy": "Canary", **rollout}}}


def apply(control_plane, namespace, obj, check=True):
    return control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=check)


async def rollout_of(kube, namespace, name):
    o = await kube.get(API, "InferenceService", name, namespace)
    return (o.get("status") or {}).get("rollout") or {}


def revision(dep):
    return dep["spec"]["template"]["metadata"]["labels"].get(REVISION)


async def stable_ready(kube, namespace, name):
    async def ready():
        d = await kube.get_or_none("apps/v1", "Deployment", f"{name}-engine", namespace)
        return d if d and (d.get("status") or {}).get("readyReplicas") == 1 and revision(d) else None
    return await wait_for(ready, timeout=PODS_START_SECONDS, what=f"{name}-engine ready")


async def describe(kube, namespace, name):
    deps = {d["metadata"]["name"]: (d["spec"]["replicas"], revision(d), (d.get("status") or {}).get("readyReplicas"))
            for d in await kube.list("apps/v1", "Deployment", namespace)}
    return f"rollout {await rollout_of(kube, namespace, name)}; deployments {deps}"


async def test_a_canary_steps_to_100_and_is_promoted(control_plane, operator, kube, namespace):
    steps = [{"weightPercent": 50, "holdSeconds": 1}, {"weightPercent": 100, "holdSeconds": 1}]
    apply(control_plane, namespace, manifest("chat", steps=steps))
    before = await stable_ready(kube, namespace, "chat")
    old = revision(before)

    apply(control_plane, namespace, manifest("chat", image="registry.example/engine:2", steps=steps))

    async def canary_beside_stable():
        canary = await kube.get_or_none("apps/v1", "Deployment", "chat-canary", namespace)
        stable = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
        return (canary, stable) if canary else None
    canary, stable = await wait_for(canary_beside_stable, timeout=60, what="chat-canary created",
                                    describe=lambda: describe(kube, namespace, "chat"))
    new = revision(canary)
    assert new != old
    assert stable["spec"]["template"] == before["spec"]["template"]  # the stable is not rolled
    assert canary["spec"]["selector"]["matchLabels"]["gpufleet.dev/track"] == "canary"
    cm = await kube.get("v1", "ConfigMap", "chat-guard", namespace)
    assert "guard-canary.json" in cm["data"]

    async def promoted():
        r = await rollout_of(kube, namespace, "chat")
        gone = await kube.get_or_none("apps/v1", "Deployment", "chat-canary", namespace) is None
        return r if r.get("phase") == "Promoted" and gone else None
    r = await wait_for(promoted, timeout=PODS_START_SECONDS * 2, what="chat promoted, canary gone",
                       describe=lambda: describe(kube, namespace, "chat"))
    assert r["stableRevision"] == new and "canaryRevision" not in r and r["canaryWeightPercent"] == 0
    stable = await kube.get("apps/v1", "Deployment", "chat-engine", namespace)
    assert revision(stable) == new and stable["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example/engine:2"
    reasons = [e.get("reason") for e in await kube.list("v1", "Event", namespace)]
    for reason in ("CanaryStarted", "CanaryStep", "CanaryPromoted"):
        assert reason in reasons, reasons
    table = control_plane.kubectl("get", "inferenceservice", "chat", "-n", namespace).stdout
    assert "CANARY%" in table.split("\n")[0] and "ROLLOUT" in table.split("\n")[0] and "Promoted" in table


async def test_abort_rolls_the_canary_back(control_plane, operator, kube, namespace):
    steps = [{"weightPercent": 10, "holdSeconds": 3600}, {"weightPercent": 100, "holdSeconds": 60}]
    apply(control_plane, namespace, manifest("ab", steps=steps))
    before = await stable_ready(kube, namespace, "ab")
    apply(control_plane, namespace, manifest("ab", image="registry.example/engine:2", steps=steps))

    async def progressing():
        r = await rollout_of(kube, namespace, "ab")
        canary = await kube.get_or_none("apps/v1", "Deployment", "ab-canary", namespace)
        return r if canary and r.get("phase") == "Progressing" and r.get("canaryWeightPercent") == 10 else None
    await wait_for(progressing, timeout=60, what="ab canary at 10%", describe=lambda: describe(kube, namespace, "ab"))

    control_plane.kubectl("patch", "inferenceservice", "ab", "-n", namespace, "--type", "merge",
                          "-p", '{"spec":{"rollout":{"abort":true}}}')

    async def aborted():
        r = await rollout_of(kube, namespace, "ab")
        gone = await kube.get_or_none("apps/v1", "Deployment", "ab-canary", namespace) is None
        return r if r.get("phase") == "Aborted" and gone else None
    r = await wait_for(aborted, timeout=60, what="ab aborted, canary gone",
                       describe=lambda: describe(kube, namespace, "ab"))
    assert "canaryRevision" not in r and r["canaryWeightPercent"] == 0
    stable = await kube.get("apps/v1", "Deployment", "ab-engine", namespace)
    assert stable["spec"]["template"] == before["spec"]["template"]


@pytest.fixture
async def fake_metrics():
    fake = FakeReplicaMetrics()
    yield fake
    await fake.close()


async def test_a_canary_over_its_error_budget_is_rolled_back(control_plane, operator, kube, namespace, fake_metrics):
    steps = [{"weightPercent": 10, "holdSeconds": 3600}, {"weightPercent": 100, "holdSeconds": 60}]
    apply(control_plane, namespace, manifest("slo", steps=steps))
    before = await stable_ready(kube, namespace, "slo")
    apply(control_plane, namespace, manifest("slo", image="registry.example/engine:2", steps=steps))

    async def canary_pod():
        pods = await kube.list("v1", "Pod", namespace, label_selector="gpufleet.dev/track=canary")
        ready = [p for p in pods if p["status"].get("podIP") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
        return ready[0] if ready else None
    pod = await wait_for(canary_pod, timeout=PODS_START_SECONDS, what="a ready canary pod",
                         describe=lambda: describe(kube, namespace, "slo"))
    ip = pod["status"]["podIP"]
    # 10 of 40 requests failed since the step began: error ratio 0.25, 250x the 0.001 budget of 99.9%.
    fake_metrics.guard_extra[ip] = sli_counters({"availability": (40, 30), "ttft": (40, 40)})
    await fake_metrics.serve(ip)

    async def rolled_back():
        r = await rollout_of(kube, namespace, "slo")
        gone = await kube.get_or_none("apps/v1", "Deployment", "slo-canary", namespace) is None
        return r if r.get("phase") == "RolledBack" and gone else None
    r = await wait_for(rolled_back, timeout=60, what="slo canary rolled back",
                       describe=lambda: describe(kube, namespace, "slo"))
    assert "availability: 10 of 40 events bad" in r["message"] and "maxBurnRate 14.4" in r["message"]
    assert r["rolledBackRevision"] == pod["metadata"]["labels"][REVISION] and "canaryRevision" not in r
    o = await kube.get(API, "InferenceService", "slo", namespace)
    degraded = next(c for c in o["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "CanaryRolledBack"
    stable = await kube.get("apps/v1", "Deployment", "slo-engine", namespace)
    assert stable["spec"]["template"] == before["spec"]["template"]
    assert "CanaryRolledBack" in [e.get("reason") for e in await kube.list("v1", "Event", namespace)]


@pytest.mark.parametrize("rollout, extra, message", [
    ({"strategy": "Canary", "steps": [{"weightPercent": 50}, {"weightPercent": 20}, {"weightPercent": 100}]}, {},
     "spec.rollout.steps: weightPercent must increase"),
    ({"strategy": "Canary", "steps": [{"weightPercent": 50}, {"weightPercent": 50}, {"weightPercent": 100}]}, {},
     "spec.rollout.steps: weightPercent must increase"),
    ({"strategy": "Canary", "steps": [{"weightPercent": 10}, {"weightPercent": 50}]}, {},
     "the last step's weightPercent must be 100"),
    ({"strategy": "Canary"}, {"disaggregation": {}, "engine": {"kvTransfer": {"connector": "Nixl"}}},
     "spec.rollout cannot be combined with spec.disaggregation"),
])
async def test_the_api_server_refuses_bad_rollouts_naming_the_field(control_plane, crds_installed, namespace,
                                                                    rollout, extra, message):
    obj = {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "bad"},
           "spec": {"model": {"name": "org/m"}, "rollout": rollout, **extra}}
    out = apply(control_plane, namespace, obj, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr
