"""Status derivation from observed children (no cluster)."""
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.replicas import target_replicas
from gpufleet.reconcile.status import Observed, child_rejected_conditions, derive_status, invalid_status, rejected_for
from gpufleet_api import parse_spec

SPEC = parse_spec({"model": {"name": "m"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}})


def dep(replicas, ready, updated=None, gen=1, seen=1):
    return {"metadata": {"generation": gen}, "status": {
        "replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas if updated is None else updated,
        "observedGeneration": seen}}


def pending(name, msg):
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}]}}


def derive(observed, desired=2, previous=None, spec=SPEC):
    return derive_status(service="chat", namespace="ml", generation=4, spec=spec, desired=desired,
                         observed=observed, previous=previous or {})


def cond(status, t):
    return c.get(status["conditions"], t)


def test_all_ready():
    st = derive(Observed(dep(2, 2), []))
    assert cond(st, "Ready")["status"] == "True" and cond(st, "Ready")["reason"] == "AllReplicasReady"
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert cond(st, "Degraded")["status"] == "False"
    assert st["observedGeneration"] == 4 and st["selector"].startswith("app.kubernetes.io/name=gpufleet-engine")
    assert st["endpoint"] == "http://chat.ml.svc:80/v1"


def test_unschedulable_replica_says_why():
    msg = "0/5 nodes are available: 4 node(s) didn't match pod anti-affinity rules."
    st = derive(Observed(dep(2, 1, updated=2), [pending("chat-engine-x", msg)]))
    assert cond(st, "Ready")["reason"] == "PartiallyReady"
    assert cond(st, "Degraded")["status"] == "True" and "1 unschedulable" in cond(st, "Degraded")["message"]
    assert cond(st, "Progressing")["reason"] == "InsufficientCapacity"
    assert msg in cond(st, "Progressing")["message"]
    none_ready = derive(Observed(dep(1, 0), [pending("p", msg)]), desired=1)
    assert cond(none_ready, "Ready")["status"] == "False" and cond(none_ready, "Ready")["reason"] == "Unschedulable"


def test_a_container_that_cannot_start_says_why():
    # What a real kubelet reports for a pod whose Secret does not exist (tests/realnode).
    msg = 'secret "hf-token" not found'
    pod = {"metadata": {"name": "chat-engine-x"}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "guard", "ready": False, "state": {"waiting": {"reason": "ContainerCreating"}}},
        {"name": "vllm", "ready": False, "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                "message": msg}}}]}}
    st = derive(Observed(dep(1, 0), [pod]), desired=1)
    ready = cond(st, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ContainersCannotStart"
    assert msg in ready["message"] and "CreateContainerConfigError" in ready["message"]
    starting = {"metadata": {"name": "p"}, "status": {"containerStatuses": [
        {"name": "vllm", "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    assert cond(derive(Observed(dep(1, 0), [starting]), desired=1), "Ready")["reason"] == "EngineStarting"


def test_rollout_in_progress():
    st = derive(Observed(dep(3, 2, updated=1, gen=2, seen=2), []))
    assert cond(st, "Progressing")["status"] == "True" and cond(st, "Progressing")["reason"] == "RollingOut"


def test_transition_time_moves_only_when_status_changes():
    first = c.merge([], derive(Observed(dep(2, 2), []))["conditions"], "2026-01-01T00:00:00Z")
    same = c.merge(first, derive(Observed(dep(2, 2), []))["conditions"], "2026-01-01T01:00:00Z")
    assert c.get(same, "Ready")["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    down = c.merge(same, derive(Observed(dep(2, 0), []))["conditions"], "2026-01-01T02:00:00Z")
    assert c.get(down, "Ready")["lastTransitionTime"] == "2026-01-01T02:00:00Z"


def test_every_condition_carries_the_generation_it_describes():
    st = derive(Observed(dep(2, 2), []))
    assert {u["type"] for u in st["conditions"]} == {"Ready", "Progressing", "Degraded", "Isolated"}
    assert all(u["observedGeneration"] == 4 for u in st["conditions"])


def test_merge_by_type_keeps_what_other_writers_own():
    theirs = [{"type": "Scaling", "status": "True", "reason": "KVHighWatermark", "message": "2 -> 3",
               "lastTransitionTime": "t0", "observedGeneration": 4}]
    merged = c.merge(theirs, derive(Observed(dep(2, 2), []))["conditions"], "t1")
    assert c.get(merged, "Scaling") == theirs[0]
    assert [x["type"] for x in merged] == ["Ready", "Progressing", "Degraded", "Isolated", "Scaling"]


def test_verified_isolation_is_not_overwritten_by_reconcile():
    prev = {"conditions": [{"type": "Isolated", "status": "False", "reason": "ViolationFound",
                            "message": "pod x", "lastTransitionTime": "t"}]}
    st = derive(Observed(dep(2, 2), []), previous=prev)
    assert cond(st, "Isolated") is None   # the audit's finding stands


def test_a_service_switched_to_shared_is_no_longer_reported_verified():
    prev = {"conditions": [{"type": "Isolated", "status": "True", "reason": "Verified", "message": "",
                            "lastTransitionTime": "t"}]}
    shared = parse_spec({"model": {"name": "m"}, "isolation": {"mode": "Shared"}})
    assert cond(derive(Observed(dep(2, 2), []), previous=prev, spec=shared), "Isolated")["reason"] == \
        "SharedByRequest"


def test_invalid_spec_status():
    st = invalid_status(generation=7, problems=["spec.engine.extraArgs[0]: --port is managed"])
    assert cond(st, "Ready")["reason"] == "InvalidSpec" and "--port" in cond(st, "Ready")["message"]
    assert cond(st, "Ready")["observedGeneration"] == 7


def test_a_refused_child_is_named_with_the_servers_words():
    ready, progressing = child_rejected_conditions(
        kind="Deployment", name="chat-engine", generation=3,
        message='Deployment.apps "chat-engine" is invalid: spec.template.spec.containers[0].resources')
    assert ready["status"] == "False" and ready["reason"] == "ChildRejected"
    assert ready["message"].startswith('Deployment chat-engine rejected by the API server: Deployment.apps '
                                       '"chat-engine" is invalid')
    assert progressing["reason"] == "ChildRejected" and ready["observedGeneration"] == 3
    status = {"conditions": c.merge([], [ready, progressing], "t")}
    assert rejected_for(status, 3) and not rejected_for(status, 4)


def test_target_replicas_manual_and_auto():
    manual = parse_spec({"model": {"name": "m"}, "autoscaling": {"mode": "Manual"}, "replicas": 3})
    assert target_replicas(manual, {}) == 3
    assert target_replicas(SPEC, {}) == 1
    assert target_replicas(SPEC, {"desiredReplicas": 9}) == 3


def test_namespace_terminating_is_recognised_from_the_status_cause():
    from gpufleet_kit.kube.errors import error_for
    body = {"reason": "Forbidden", "message": 'configmaps "a" is forbidden: unable to create new content in '
            'namespace t because it is being terminated',
            "details": {"causes": [{"reason": "NamespaceTerminating", "field": "metadata.namespace"}]}}
    assert error_for(403, body, "").namespace_terminating
    assert not error_for(403, {"reason": "Forbidden", "message": "RBAC says no"}, "").namespace_terminating


def test_replicas_downloading_the_weights_say_so():
    pod = {"metadata": {"name": "chat-engine-x"}, "status": {"phase": "Pending", "initContainerStatuses": [
        {"name": "model-fetch", "state": {"running": {"startedAt": "2026-11-30T18:00:00Z"}}}],
        "containerStatuses": [{"name": "vllm", "state": {"waiting": {"reason": "PodInitializing"}}}]}}
    ready = cond(derive(Observed(dep(1, 0), [pod]), desired=1), "Ready")
    assert ready["status"] == "False" and ready["reason"] == "DownloadingModel"
    assert "chat-engine-x" in ready["message"] and "since 2026-11-30T18:00:00Z" in ready["message"]
    assert "kubectl logs chat-engine-x -c model-fetch" in ready["message"]


def test_a_download_that_cannot_start_says_why():
    # A gated model whose token Secret is missing stops the init container first.
    pod = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [
        {"name": "model-fetch", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                      "message": 'secret "hf-token" not found'}}}]}}
    ready = cond(derive(Observed(dep(1, 0), [pod]), desired=1), "Ready")
    assert ready["reason"] == "ContainersCannotStart" and 'secret "hf-token" not found' in ready["message"]


def test_a_failing_download_gives_its_error():
    error = "Error: cannot download meta-llama/Llama-3.1-8B-Instruct: 401 Client Error. Access to model is restricted."
    pod = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [
        {"name": "model-fetch", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": error}}}]}}
    ready = cond(derive(Observed(dep(1, 0), [pod]), desired=1), "Ready")
    assert ready["reason"] == "ModelDownloadFailed" and "Access to model is restricted" in ready["message"]
