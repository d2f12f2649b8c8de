"""The fleet loop and the cluster audits on a disaggregated service: each pool autoscaled by its
own signals into its own Deployment, the live prefill:decode ratio and its bound, the answer
lengths shared with new guards read from decode pods, a fragmented replica judged against its own
pool, and stranded GPUs judged against each pool's shape."""
from gpufleet.audit.fragmentation import may_restart
from gpufleet.autoscale.signals import ReplicaSample, RequestTokens
from gpufleet.fleet.autoscaler import HELD_BY_RATIO
from gpufleet.fleet.cluster_audit import audit_report
from gpufleet.fleet.ratio_meter import RATIO_UPDATE_S
from gpufleet.manifests import names
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.status import POOLS_NOT_AUTOSCALED
from gpufleet_api import parse_spec
from tests.support.fake_kube import FakeKube
from tests.unit.fleet.test_audits import node
from tests.unit.fleet.test_audits import pod as node_pod
from tests.unit.fleet.test_service_loop import FakeReader, isvc, make_loop, pod, pod_object, scale_events, status

PD = {"disaggregation": {"prefill": {"minReplicas": 1, "maxReplicas": 4},
                         "decode": {"minReplicas": 2, "maxReplicas": 4}},
      "engine": {"kvTransfer": {"connector": "Nixl"}}}
INF = float("inf")


def role_pods(prefill=1, decode=2):
    return [{**pod(f"p-{i}"), "role": "prefill"} for i in range(prefill)] + \
        [{**pod(f"d-{i}"), "role": "decode"} for i in range(decode)]


def pd_isvc(prefill=1, decode=2, **spec):
    body = isvc(desired=prefill + decode, ready=prefill + decode, **{**PD, **spec})
    body["status"]["pools"] = [
        {"role": "prefill", "replicas": prefill, "readyReplicas": prefill, "desiredReplicas": prefill},
        {"role": "decode", "replicas": decode, "readyReplicas": decode, "desiredReplicas": decode}]
    return body


def pool_deployment(role, replicas):
    """A pool's Deployment with every replica ready (the reconcile after an action reads it)."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": f"chat-{role}", "namespace": "ml", "generation": 1,
                         "labels": names.selector_labels("chat"), "ownerReferences": [names.owner_reference(isvc())]},
            "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": replicas,
                       "updatedReplicas": replicas}}


def cluster(kube, prefill=1, decode=2, **spec):
    kube.put(pd_isvc(prefill, decode, **spec))
    kube.put(pool_deployment("prefill", prefill))
    kube.put(pool_deployment("decode", decode))


class PoolReader(FakeReader):
    """Each pod's sample as the test sets it (``reads[pod]``: ReplicaSample fields)."""

    def __init__(self, reads=None):
        super().__init__({})
        self.reads = reads or {}
        self.asked: list[str] = []

    async def sample(self, pod, ip):
        fields = {"kv_usage": 0.5, **self.reads.get(pod, {})}
        return ReplicaSample(pod=pod, ok=True, **fields)

    async def demand(self, pod, ip):
        self.asked.append(pod)
        return None


def ttft(fast, slow):
    """The guard's cumulative TTFT buckets with the objective (2 s, the default) a bound."""
    return ((0.5, fast), (2.0, fast), (8.0, fast + slow), (INF, fast + slow))


def scaling(kube):
    return c.get(status(kube).get("conditions"), c.SCALING) or {}


def pools(kube):
    return {p["role"]: p["desiredReplicas"] for p in status(kube)["pools"]}


async def test_a_slow_prefill_pool_is_scaled_out_alone_and_the_decision_names_it():
    kube = FakeKube()
    cluster(kube)
    reader = PoolReader({"p-0": {"ttft_buckets": ttft(0, 0), "kv_usage": 0.99}})
    loop = make_loop(kube, reader=reader)
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=100.0)
    reader.reads["p-0"] = {"ttft_buckets": ttft(50, 10), "kv_usage": 0.99}
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=101.0)
    assert kube.obj("Deployment", "chat-prefill")["spec"]["replicas"] == 2
    assert kube.obj("Deployment", "chat-decode")["spec"]["replicas"] == 2
    assert pools(kube) == {"prefill": 2, "decode": 2} and status(kube)["desiredReplicas"] == 4
    last = status(kube)["lastScaling"]
    assert (last["role"], last["from"], last["to"], last["reason"]) == ("prefill", 1, 2, "TTFT")
    assert scaling(kube)["status"] == "True" and scaling(kube)["message"].startswith("prefill 1 -> 2: TTFT p99")
    events = [e["message"] for e in kube.events if e["reason"] == "ScaledUp"]
    assert len(events) == 1 and events[0].startswith("prefill: 1 -> 2 replicas (TTFT)")


async def test_a_full_decode_pool_is_scaled_out_alone():
    kube = FakeKube()
    cluster(kube)
    loop = make_loop(kube, reader=PoolReader({"p-0": {"kv_usage": 0.1}, "d-0": {"kv_usage": 0.95},
                                              "d-1": {"kv_usage": 0.95}}))
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=100.0)
    assert kube.obj("Deployment", "chat-decode")["spec"]["replicas"] == 3
    assert kube.obj("Deployment", "chat-prefill")["spec"]["replicas"] == 1
    assert status(kube)["lastScaling"]["role"] == "decode" and status(kube)["lastScaling"]["reason"] == \
        "KVHighWatermark"
    assert [e["message"][:41] for e in kube.events if e["reason"] == "ScaledUp"] == [
        "decode: 2 -> 3 replicas (KVHighWatermark)"]


async def test_both_pools_under_load_are_each_scaled_in_one_pass():
    kube = FakeKube()
    cluster(kube)
    loop = make_loop(kube, reader=PoolReader({"p-0": {"engine_waiting": 20}, "d-0": {"kv_usage": 0.95},
                                              "d-1": {"kv_usage": 0.95}}))
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=100.0)
    assert pools(kube) == {"prefill": 2, "decode": 3}
    assert [e["message"].split(":")[0] for e in kube.events if e["reason"] == "ScaledUp"] == ["prefill", "decode"]
    assert status(kube)["lastScaling"]["role"] == "decode"


async def test_an_idle_decode_pool_scales_in_its_own_least_loaded_pod_and_not_below_its_minimum():
    kube = FakeKube()
    cluster(kube, decode=3, autoscaling={"scaleDownStabilizationSeconds": 0})
    for name in ("p-0", "d-0", "d-1", "d-2"):
        kube.put(pod_object(name))
    reader = PoolReader({"p-0": {"kv_usage": 0.0}, "d-0": {"kv_usage": 0.2}, "d-1": {"kv_usage": 0.1},
                         "d-2": {"kv_usage": 0.2}})
    loop = make_loop(kube, reader=reader)
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(decode=3), now=100.0)
    assert pools(kube) == {"prefill": 1, "decode": 2}
    assert kube.obj("Pod", "d-1")["metadata"]["annotations"] == {names.ANNOTATION_DELETION_COST: "-1000"}
    assert loop.marks.removals == {"d-1": ("decode", 2)}
    # The ReplicaSet took d-1: the next passes find every pool at its floor.
    kube.put(pool_deployment("decode", 2))
    for now in (200.0, 300.0):
        await loop.tick(kube.obj("InferenceService", "chat"), role_pods(decode=2), now=now)
    assert pools(kube) == {"prefill": 1, "decode": 2} and scale_events(kube) == ["ScaledDown"]


async def test_a_scale_out_of_one_pool_keeps_the_scale_in_mark_of_the_other():
    kube = FakeKube()
    cluster(kube, decode=3)
    kube.put(pod_object("d-2", {names.ANNOTATION_DELETION_COST: "-1000"}))
    loop = make_loop(kube, reader=PoolReader({"p-0": {"engine_waiting": 20}}))
    loop.marks.removals = {"d-2": ("decode", 2)}
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(decode=3), now=100.0)
    assert pools(kube)["prefill"] == 2
    assert kube.obj("Pod", "d-2")["metadata"]["annotations"] == {names.ANNOTATION_DELETION_COST: "-1000"}


async def test_an_unreadable_decode_pod_is_named_in_the_scaling_condition():
    kube = FakeKube()
    cluster(kube)

    class OneUnreadable(PoolReader):
        async def sample(self, pod, ip):
            if pod == "d-1":
                return ReplicaSample(pod=pod, ok=False, error="timeout")
            return await super().sample(pod, ip)
    loop = make_loop(kube, reader=OneUnreadable({"p-0": {"kv_usage": 0.0}, "d-0": {"kv_usage": 0.0}}))
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=100.0)
    assert scaling(kube)["status"] == "False" and scaling(kube)["reason"] == "MetricsUnavailable"
    assert "cannot read d-1" in scaling(kube)["message"] and scale_events(kube) == []


async def test_manual_pools_are_not_autoscaled():
    kube = FakeKube()
    cluster(kube, autoscaling={"mode": "Manual"})
    loop = make_loop(kube, reader=PoolReader({p: {"kv_usage": 0.99} for p in ("p-0", "d-0", "d-1")}))
    for now in (100.0, 200.0):
        await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=now)
    assert scale_events(kube) == [] and pools(kube) == {"prefill": 1, "decode": 2}


async def test_the_answer_lengths_shared_with_new_guards_are_read_from_decode_pods():
    kube = FakeKube()
    kube.put(pd_isvc())
    reader = PoolReader()
    loop = make_loop(kube, reader=reader)
    for now in (100.0, 200.0):
        await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=now)
    assert reader.asked and set(reader.asked) <= {"d-0", "d-1"}


# --- the live prefill:decode ratio ------------------------------------------------------------

# A service the planner has profiles for: Llama-3.1-8B on one H100 per replica of each pool.
PROFILED = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "resources": {"gpuProduct": "NVIDIA-H100-80GB-HBM3"}}


def finished(requests, prompt, output):
    """vLLM's cumulative token counts after ``requests`` requests of ``prompt`` and ``output`` tokens."""
    return RequestTokens(requests, requests * prompt, requests * output, ((prompt, requests), (INF, requests)),
                         ((output, requests), (INF, requests)))


async def run_traffic(kube, loop, reader, seconds, rps, prompt, output, start=100.0):
    """Each decode pod finishes rps/2 requests a second for ``seconds``, one read a second."""
    for i in range(seconds + 1):
        done = i * rps / 2
        for name in ("d-0", "d-1"):
            reader.reads.setdefault(name, {})["request_tokens"] = finished(done, prompt, output)
        await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=start + i)


async def test_the_ratio_is_measured_from_the_decode_pods_and_written_to_status():
    kube = FakeKube()
    cluster(kube, autoscaling={"mode": "Manual"}, **PROFILED)
    reader = PoolReader()
    loop = make_loop(kube, reader=reader)
    await run_traffic(kube, loop, reader, 60, rps=20, prompt=2000, output=500)
    ratio = status(kube)["prefillDecodeRatio"]
    # Measured 30 s after the first read (the first measurement had nothing yet), and the same since.
    assert ratio["reason"] == "Measured" and ratio["requests"] == 600 and ratio["windowSeconds"] == 30
    # 40,000 prompt tokens/s on replicas that prefill ~20,000: 2; 10,000 output tokens/s: several decode.
    assert ratio["prefill"] == 2 and ratio["decode"] > ratio["prefill"]
    assert float(ratio["decodePerPrefill"]) > 1 and "40000.0 prompt and 10000.0 output tokens/s" in ratio["message"]
    assert "H100-80GB" in ratio["message"] and "Llama-3.1-8B" in ratio["message"]


async def test_the_ratio_is_rewritten_only_when_it_moves():
    kube = FakeKube()
    cluster(kube, autoscaling={"mode": "Manual"}, **PROFILED)
    reader = PoolReader()
    loop = make_loop(kube, reader=reader)
    await run_traffic(kube, loop, reader, 60, rps=20, prompt=2000, output=500)
    first = status(kube)["prefillDecodeRatio"]
    writes = [w for w in kube.writes if w[0] == "patch/status" and "prefillDecodeRatio" in w[2]["status"]]
    await run_traffic(kube, loop, reader, 3 * int(RATIO_UPDATE_S), rps=20, prompt=2000, output=500, start=160.0)
    again = [w for w in kube.writes if w[0] == "patch/status" and "prefillDecodeRatio" in w[2]["status"]]
    assert status(kube)["prefillDecodeRatio"] == first and len(again) == len(writes)


async def test_a_service_without_a_profile_says_which_field_to_set():
    kube = FakeKube()
    cluster(kube)
    loop = make_loop(kube, reader=PoolReader())
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=100.0)
    ratio = status(kube)["prefillDecodeRatio"]
    assert ratio["reason"] == "NoProfile" and "spec.model.name org/m has no planner profile" in ratio["message"]


async def test_under_ratio_bound_decode_follows_the_measured_ratio_of_the_prefill_pool():
    kube = FakeKube()
    cluster(kube, disaggregation={**PD["disaggregation"], "decode": {"minReplicas": 1, "maxReplicas": 8},
                                  "ratioPolicy": "Bound", "ratioTolerancePercent": 0}, **PROFILED)
    body = kube.obj("InferenceService", "chat")
    body["status"]["prefillDecodeRatio"] = {"reason": "Measured", "prefill": 1, "decode": 3, "message": "",
                                            "time": "2026-01-01T00:00:00Z"}
    kube.put(body)
    loop = make_loop(kube, reader=PoolReader({"p-0": {"engine_waiting": 20}}))
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=100.0)
    # Prefill goes to 2 on its queue; decode, calm, is raised to 3 x 2 in the same pass.
    assert pools(kube) == {"prefill": 2, "decode": 6}
    last = status(kube)["lastScaling"]
    assert (last["role"], last["reason"]) == ("decode", "RatioBound")
    assert "ratio bound 1:3 (prefill:decode) x 2 prefill replica(s) ± 0%: decode 6..6" in last["message"]


async def test_a_decode_pool_held_by_the_ratio_bound_says_so_and_clears_it():
    kube = FakeKube()
    cluster(kube, decode=3, disaggregation={**PD["disaggregation"], "ratioPolicy": "Bound",
                                            "ratioTolerancePercent": 0}, **PROFILED)
    body = kube.obj("InferenceService", "chat")
    body["status"]["prefillDecodeRatio"] = {"reason": "Measured", "prefill": 1, "decode": 3, "message": "",
                                            "time": "2026-01-01T00:00:00Z"}
    kube.put(body)
    reader = PoolReader({"p-0": {"kv_usage": 0.0}, **{f"d-{i}": {"kv_usage": 0.95} for i in range(3)}})
    loop = make_loop(kube, reader=reader)
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(decode=3), now=100.0)
    assert scale_events(kube) == [] and pools(kube)["decode"] == 3
    assert scaling(kube)["reason"] == HELD_BY_RATIO and "below the 4 its signals ask for" in scaling(kube)["message"]
    writes = len(kube.writes)
    reader.reads.update({f"d-{i}": {"kv_usage": 0.97} for i in range(3)})
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(decode=3), now=100.5)
    assert [w for w in kube.writes[writes:] if "conditions" in w[2].get("status", {})] == []  # still held: no churn
    reader.reads.update({f"d-{i}": {"kv_usage": 0.5} for i in range(3)})
    await loop.tick(kube.obj("InferenceService", "chat"), role_pods(decode=3), now=101.0)
    assert scaling(kube)["reason"] == "WithinRatioBound"


async def test_the_condition_an_older_operator_left_is_replaced():
    kube = FakeKube()
    cluster(kube)
    body = kube.obj("InferenceService", "chat")
    body["status"]["conditions"] = [c.condition(c.SCALING, False, POOLS_NOT_AUTOSCALED, "not yet",
                                                generation=1) | {"lastTransitionTime": "2026-01-01T00:00:00Z"}]
    kube.put(body)
    await make_loop(kube).ports.locks.controller.reconcile_key("ml", "chat")
    assert scaling(kube)["status"] == "True" and scaling(kube)["reason"] == "PoolsAutoscaled"
    assert POOLS_NOT_AUTOSCALED not in kube.event_reasons()


def test_a_replica_is_judged_against_the_other_replicas_of_its_pool():
    loop = make_loop(None)
    body = pd_isvc()
    spec = loop.spec_of(body)
    pods = role_pods()
    samples = [ReplicaSample(pod=p["name"], ok=True, kv_usage=0.2) for p in pods]
    prefill = loop.fragmentation.restart_context(body, spec, samples, pods, 10_000.0, "p-0")
    assert (prefill.ready_replicas, prefill.desired_replicas, set(prefill.kv_usage)) == (1, 1, {"p-0"})
    decode = loop.fragmentation.restart_context(body, spec, samples, pods, 10_000.0, "d-1")
    assert (decode.ready_replicas, decode.desired_replicas, set(decode.kv_usage)) == (2, 2, {"d-0", "d-1"})


def test_free_gpus_a_pool_of_a_disaggregated_service_can_use_are_not_stranded():
    service = {"metadata": {"name": "chat", "namespace": "ml"}, "spec": {
        "model": {"name": "org/m"}, "resources": {"gpusPerReplica": 4}, "engine": {"kvTransfer": {}},
        "disaggregation": {"decode": {"resources": {"gpusPerReplica": 1}}}}}
    parse_spec(service["spec"])
    model = names.model_label("org/m")
    nodes = [node("n0")]
    pods = [node_pod("a", "n0", 6, model=model)]  # 2 free: too few for a prefill replica, enough for decode
    assert audit_report(nodes, pods, [service])["stranded"] == []
    unified = {**service, "spec": {k: v for k, v in service["spec"].items() if k != "disaggregation"}}
    assert [s.free for s in audit_report(nodes, pods, [unified])["stranded"]] == [2]


def test_the_only_replica_of_a_pool_is_never_restarted_for_fragmentation_whatever_the_other_pool():
    """Remediation must not take a pool to zero ready replicas: its only prefill pod stays, though
    the service has three ready pods."""
    loop = make_loop(None)
    loop.fragmentation.watching_since = 0.0
    body = pd_isvc()
    spec = loop.spec_of(body)
    pods = role_pods()
    samples = [ReplicaSample(pod=p["name"], ok=True, kv_usage=0.1) for p in pods]
    ok, why = may_restart("p-0", loop.fragmentation.restart_context(body, spec, samples, pods, 10_000.0, "p-0"))
    assert not ok and "only ready replica" in why
    ok, _ = may_restart("d-1", loop.fragmentation.restart_context(body, spec, samples, pods, 10_000.0, "d-1"))
    assert ok
