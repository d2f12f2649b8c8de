"""Against the real API server: the engines' NetworkPolicy is accepted and its
selectors pick exactly the service's pods and the operator's namespace (the
server's own selector semantics), and engine pods pass Pod Security admission
in namespaces that enforce the baseline and restricted standards.

What this cannot show: that traffic is dropped. The local control plane's
network (loopback pod IPs, and the real node's CNI bridge) enforces no
NetworkPolicy; docs/security.md says what is and is not tested."""
import pytest

from gpufleet.manifests import children
from gpufleet.manifests.network_policy import EngineIngress, build_network_policy
from gpufleet_api import parse_spec
from gpufleet_kit.kube.errors import ApiError
from tests.support.waiting import PODS_START_SECONDS, wait_for

OPERATOR_LABELS = {"app.kubernetes.io/name": "gpufleet-operator", "app.kubernetes.io/instance": "gpufleet"}


def isvc(namespace: str, name: str) -> dict:
    return {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"}}


def unowned(obj: dict) -> dict:
    """Without the owner reference: there is no InferenceService here for the garbage collector to find."""
    obj["metadata"].pop("ownerReferences", None)
    return obj


def deployment(namespace: str, name: str) -> dict:
    spec = parse_spec({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}})
    _cm, config_hash = children.build_configmap(isvc(namespace, name), spec)
    return unowned(children.build_deployment(isvc(namespace, name), spec, 1, config_hash["unified"]))


def selector_string(selector: dict) -> str:
    terms = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        terms.append(f"{e['key']} in ({','.join(e['values'])})")
    return ",".join(terms)


async def pod_names(kube, namespace: str, label_selector: str) -> set[str]:
    return {p["metadata"]["name"] for p in await kube.list("v1", "Pod", namespace, label_selector=label_selector)}


async def test_the_policy_is_accepted_and_selects_exactly_the_services_pods(kube, namespace):
    for name in ("chat", "chat-2"):
        await kube.apply(deployment(namespace, name))
    ingress = EngineIngress(namespace, OPERATOR_LABELS, client_namespaces=("kube-system",),
                            prometheus_namespaces=("default",))
    policy = unowned(build_network_policy(isvc(namespace, "chat"), ingress))
    stored = await kube.apply(policy)
    assert stored["spec"]["podSelector"] == policy["spec"]["podSelector"]

    async def both_created():
        pods = await pod_names(kube, namespace, "")
        return pods if len(pods) == 2 else None
    everything = await wait_for(both_created, timeout=PODS_START_SECONDS, what="one pod of each Deployment")
    selected = await pod_names(kube, namespace, selector_string(stored["spec"]["podSelector"]))
    assert len(selected) == 1 and selected < everything
    chat_pods = await pod_names(kube, namespace, "gpufleet.dev/service=chat")
    assert selected == chat_pods

    operator_peer, others, _same = stored["spec"]["ingress"][0]["from"]
    namespaces = {n["metadata"]["name"] for n in await kube.list(
        "v1", "Namespace", label_selector=selector_string(operator_peer["namespaceSelector"]))}
    assert namespaces == {namespace}
    namespaces = {n["metadata"]["name"] for n in await kube.list(
        "v1", "Namespace", label_selector=selector_string(others["namespaceSelector"]))}
    assert namespaces == {"kube-system", "default"}


@pytest.fixture(params=["baseline", "restricted"])
async def enforcing_namespace(request, kube, namespace):
    await kube.merge_patch("v1", "Namespace", namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": request.param}}})
    return namespace


def pod_of(dep: dict) -> dict:
    template = dep["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "psa-", "namespace": dep["metadata"]["namespace"],
                         "labels": template["metadata"]["labels"]},
            "spec": template["spec"]}


async def test_engine_pods_pass_pod_security_admission(kube, enforcing_namespace):
    ns = enforcing_namespace
    dep = deployment(ns, "chat")
    path = await kube.path("v1", "Pod", ns)
    await kube.request("POST", path, params={"dryRun": "All"}, body=pod_of(dep))
    # The Deployment's own pods: the ReplicaSet creates them through the same admission.
    await kube.apply(dep)
    await wait_for(lambda: pod_names(kube, ns, "gpufleet.dev/service=chat"), timeout=PODS_START_SECONDS,
                   what="the ReplicaSet to create an engine pod")


async def test_admission_is_really_enforcing_a_root_vllm_is_refused_under_restricted(kube, namespace):
    await kube.merge_patch("v1", "Namespace", namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted"}}})
    pod = pod_of(deployment(namespace, "chat"))
    vllm = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
    vllm["securityContext"] = {"allowPrivilegeEscalation": False}  # what engine pods had before
    with pytest.raises(ApiError) as refused:
        await kube.request("POST", await kube.path("v1", "Pod", namespace), params={"dryRun": "All"}, body=pod)
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.message
