"""A disaggregated InferenceService against the real API server and the real operator process, on the
simulated GPU nodes: its prefill and decode pools come up as two Deployments of their own, status counts
each, and a change of shape leaves only the new shape's Deployments; a KV store claim the operator creates
passes the API server and every pod mounts it."""
from gpufleet.manifests import names
from tests.integration.test_inferenceservice import apply, brief, cond, isvc, manifest
from tests.support.waiting import PODS_START_SECONDS, wait_for

PD = {"engine": {"kvTransfer": {"connector": "Nixl"}},
      "autoscaling": {"mode": "Manual"},
      "disaggregation": {"prefill": {"replicas": 1, "maxReplicas": 2}, "decode": {"replicas": 2, "maxReplicas": 3}}}


async def test_pools_come_up_counted_and_a_change_of_shape_leaves_only_the_new_deployments(
        control_plane, operator, kube, namespace):
    apply(control_plane, namespace, manifest("pd", **PD))

    async def pools_ready():
        o = await isvc(kube, namespace, "pd")
        pools = {p["role"]: p for p in (o.get("status") or {}).get("pools") or []}
        ready = cond(o, "Ready").get("status") == "True" and \
            [pools.get(r, {}).get("readyReplicas") for r in ("prefill", "decode")] == [1, 2]
        return o if ready else None
    obj = await wait_for(pools_ready, timeout=PODS_START_SECONDS, what="pd Ready with 1 prefill and 2 decode",
                         describe=lambda: brief(kube, namespace, "pd"))
    assert obj["status"]["readyReplicas"] == 3
    for role, replicas in (("prefill", 1), ("decode", 2)):
        dep = await kube.get("apps/v1", "Deployment", f"pd-{role}", namespace)
        assert dep["spec"]["replicas"] == replicas
        assert dep["spec"]["template"]["metadata"]["labels"][names.LABEL_ROLE] == role
        assert dep["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert await kube.get_or_none("apps/v1", "Deployment", "pd-engine", namespace) is None
    # A budget per pool (docs/drains.md): selectors that never overlap, minAvailable the pool's replicas.
    budgets = {b["metadata"]["name"]: b["spec"]["minAvailable"]
               for b in await kube.list("policy/v1", "PodDisruptionBudget", namespace)}
    assert budgets == {"pd-prefill": 1, "pd-decode": 2}
    wide = control_plane.kubectl("get", "inferenceservice", "pd", "-n", namespace, "-o", "wide").stdout
    header = wide.split("\n")[0].split()
    assert "PREFILL" in header and "DECODE" in header, wide

    # Back to one unified pool: its Deployment, then the pools' go.
    apply(control_plane, namespace, manifest("pd", engine=PD["engine"], autoscaling={"mode": "Manual"}, replicas=1))

    async def unified():
        gone = [await kube.get_or_none("apps/v1", "Deployment", f"pd-{r}", namespace) for r in ("prefill", "decode")]
        engine = await kube.get_or_none("apps/v1", "Deployment", "pd-engine", namespace)
        return engine if engine is not None and gone == [None, None] else None
    engine = await wait_for(unified, timeout=PODS_START_SECONDS, what="pd-engine alone",
                            describe=lambda: brief(kube, namespace, "pd"))
    assert names.LABEL_ROLE not in engine["spec"]["template"]["metadata"]["labels"]

    async def one_budget():
        got = {b["metadata"]["name"] for b in await kube.list("policy/v1", "PodDisruptionBudget", namespace)}
        return got == {"pd-engine"}
    await wait_for(one_budget, timeout=30, what="the pools' budgets replaced by pd-engine's",
                   describe=lambda: kube.list("policy/v1", "PodDisruptionBudget", namespace))
    events = control_plane.kubectl("get", "events", "-n", namespace, "--field-selector",
                                   "involvedObject.name=pd", "-o", "jsonpath={.items[*].reason}").stdout
    assert "PoolRemoved" in events.split(), events


async def test_a_kv_store_claim_is_created_owned_and_mounted_by_both_pools(control_plane, operator, kube, namespace):
    """(No volume provisioner runs here: the claim stays Pending and so do the pods.)"""
    apply(control_plane, namespace, manifest("pdkv", engine={"kvTransfer": {
        "connector": "SharedStorage", "sharedStorage": {"persistentVolumeClaim": {"size": "20Gi"}}}},
        disaggregation={}))
    claim = await wait_for(lambda: kube.get_or_none("v1", "PersistentVolumeClaim", "pdkv-kv-store", namespace),
                           timeout=60, what="the KV store claim", describe=lambda: brief(kube, namespace, "pdkv"))
    owner = await isvc(kube, namespace, "pdkv")
    assert claim["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for role in ("prefill", "decode"):
        dep = await wait_for(lambda r=role: kube.get_or_none("apps/v1", "Deployment", f"pdkv-{r}", namespace),
                             timeout=60, what=f"the {role} Deployment")
        assert {"name": "kv-store", "persistentVolumeClaim": {"claimName": "pdkv-kv-store"}} in \
            dep["spec"]["template"]["spec"]["volumes"]
