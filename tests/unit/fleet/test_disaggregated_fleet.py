"""The fleet loop and the cluster audits on a disaggregated service: its pools are not autoscaled
(yet), the answer lengths shared with new guards are the decode pods', a fragmented replica is
judged against its own pool, and stranded GPUs are judged against each pool's shape."""
from gpufleet.api import parse_spec
from gpufleet.autoscale.signals import ReplicaSample
from gpufleet.fleet.cluster_audit import audit_report
from gpufleet.manifests import names
from tests.support.fake_kube import FakeKube
from tests.unit.fleet.test_audits import node
from tests.unit.fleet.test_audits import pod as node_pod
from tests.unit.fleet.test_service_loop import FakeReader, isvc, make_loop, pod, scale_events, status

PD = {"disaggregation": {"prefill": {"minReplicas": 1, "maxReplicas": 4},
                         "decode": {"minReplicas": 2, "maxReplicas": 4}},
      "engine": {"kvTransfer": {"connector": "Nixl"}}}


def role_pods():
    return [{**pod("p-0"), "role": "prefill"}, {**pod("d-0"), "role": "decode"}, {**pod("d-1"), "role": "decode"}]


def pd_isvc():
    body = isvc(desired=3, ready=3, **PD)
    body["status"]["pools"] = [{"role": "prefill", "replicas": 1, "readyReplicas": 1, "desiredReplicas": 1},
                               {"role": "decode", "replicas": 2, "readyReplicas": 2, "desiredReplicas": 2}]
    return body


class LengthsReader(FakeReader):
    def __init__(self, kv):
        super().__init__(kv)
        self.asked: list[str] = []

    async def demand(self, pod, ip):
        self.asked.append(pod)
        return None


async def test_a_disaggregated_service_under_load_is_not_scaled_by_the_unified_autoscaler():
    kube = FakeKube()
    kube.put(pd_isvc())
    loop = make_loop(kube, kv={"p-0": 0.99, "d-0": 0.99, "d-1": 0.99})
    for now in (100.0, 200.0, 300.0):
        await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=now)
    assert scale_events(kube) == []
    assert status(kube)["desiredReplicas"] == 3 and status(kube)["kvCacheUsagePercent"] == 99


async def test_the_answer_lengths_shared_with_new_guards_are_read_from_decode_pods():
    kube = FakeKube()
    kube.put(pd_isvc())
    reader = LengthsReader({})
    loop = make_loop(kube, reader=reader)
    for now in (100.0, 200.0):
        await loop.tick(kube.obj("InferenceService", "chat"), role_pods(), now=now)
    assert reader.asked and set(reader.asked) <= {"d-0", "d-1"}


def test_a_replica_is_judged_against_the_other_replicas_of_its_pool():
    loop = make_loop(None)
    body = pd_isvc()
    spec = loop.spec_of(body)
    pods = role_pods()
    samples = [ReplicaSample(pod=p["name"], ok=True, kv_usage=0.2) for p in pods]
    prefill = loop.restart_context(body, spec, samples, pods, 10_000.0, 1, "p-0")
    assert (prefill.ready_replicas, prefill.desired_replicas, set(prefill.kv_usage)) == (1, 1, {"p-0"})
    decode = loop.restart_context(body, spec, samples, pods, 10_000.0, 1, "d-1")
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
