"""The local control plane is a real Kubernetes: schema validation, scheduling
onto simulated GPU nodes, and RBAC are the API server's and scheduler's own."""
from gpufleet_kit.kube.config import KubeConfig
from tests.support.waiting import PODS_START_SECONDS, wait_for

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.harness.gpufleet.dev}
spec:
  group: harness.gpufleet.dev
  scope: Namespaced
  names: {kind: Widget, plural: widgets, singular: widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [size]
            properties:
              size: {type: integer, minimum: 1, maximum: 10}
"""


def gpu_deployment(name, gpus, replicas=1):
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{
                     "name": "c", "image": "registry.invalid/cuda:12",
                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}},
    }


def test_crd_is_served_and_schema_violations_are_rejected_by_the_apiserver(control_plane, namespace):
    control_plane.kubectl("apply", "-f", "-", input=CRD)

    control_plane.wait_established("widgets.harness.gpufleet.dev", timeout=30)
    ok = control_plane.kubectl("apply", "-n", namespace, "-f", "-",
                               input="apiVersion: harness.gpufleet.dev/v1\nkind: Widget\n"
                                     "metadata: {name: good}\nspec: {size: 3}\n")
    assert "widget.harness.gpufleet.dev/good created" in ok.stdout
    bad = control_plane.kubectl("apply", "-n", namespace, "-f", "-", check=False,
                                input="apiVersion: harness.gpufleet.dev/v1\nkind: Widget\n"
                                      "metadata: {name: bad}\nspec: {size: 99}\n")
    assert bad.returncode != 0
    assert "spec.size: Invalid value: 99: spec.size in body should be less than or equal to 10" in bad.stderr


async def test_gpu_deployment_is_scheduled_onto_a_simulated_gpu_node_and_runs(kube, namespace):
    dep = gpu_deployment("one-gpu", 1)
    dep["metadata"]["namespace"] = namespace
    await kube.create(dep)

    async def running_pod():
        pods = await kube.list("v1", "Pod", namespace, label_selector="app=one-gpu")
        return [p for p in pods if p["status"].get("phase") == "Running"]
    pods = await wait_for(running_pod, timeout=PODS_START_SECONDS, what="a Running pod of the GPU deployment")
    rs = await kube.list("apps/v1", "ReplicaSet", namespace, label_selector="app=one-gpu")
    assert len(rs) == 1
    node = await kube.get("v1", "Node", pods[0]["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    # ExtendedResourceToleration let the GPU pod past the GPU nodes' taint.
    assert any(t.get("key") == "nvidia.com/gpu" for t in pods[0]["spec"]["tolerations"])


async def test_pod_asking_more_gpus_than_any_node_has_stays_pending_with_failed_scheduling(kube, namespace):
    await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big", "namespace": namespace},
                       "spec": {"containers": [{"name": "c", "image": "registry.invalid/cuda:12",
                                                "resources": {"limits": {"nvidia.com/gpu": "9"}}}]}})

    async def failed_scheduling():
        evs = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=too-big")
        return [e for e in evs if e["reason"] == "FailedScheduling"]
    evs = await wait_for(failed_scheduling, timeout=60, what="a FailedScheduling event")
    assert "Insufficient nvidia.com/gpu" in evs[0]["message"]
    pod = await kube.get("v1", "Pod", "too-big", namespace)
    assert pod["status"]["phase"] == "Pending"


def test_rbac_denies_a_service_account_outside_its_role(control_plane, namespace, tmp_path):
    k = control_plane.kubectl
    k("-n", namespace, "create", "serviceaccount", "narrow")
    k("-n", namespace, "create", "role", "read-pods", "--verb=get,list", "--resource=pods")
    k("-n", namespace, "create", "rolebinding", "narrow-read-pods", "--role=read-pods",
      f"--serviceaccount={namespace}:narrow")
    token = k("-n", namespace, "create", "token", "narrow").stdout.strip()
    ca = KubeConfig.from_file(control_plane.kubeconfig).ca_file
    as_sa = tmp_path / "sa.kubeconfig"
    as_sa.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{control_plane.server}", certificate-authority: "{ca}"}}}}]
users: [{{name: sa, user: {{token: "{token}"}}}}]
contexts: [{{name: c, context: {{cluster: c, user: sa, namespace: {namespace}}}}}]
current-context: c
""")
    allowed = k("--kubeconfig", str(as_sa), "get", "pods", check=False)
    assert allowed.returncode == 0, allowed.stderr
    denied = k("--kubeconfig", str(as_sa), "get", "secrets", check=False)
    assert denied.returncode != 0
    assert f'User "system:serviceaccount:{namespace}:narrow" cannot list resource "secrets"' in denied.stderr


def test_second_up_while_running_says_so(control_plane):
    from click.testing import CliRunner

    from gpufleet.cli import main
    result = CliRunner().invoke(main, ["dev", "up"])
    assert result.exit_code == 1
    assert "already running" in result.output


def test_status_lists_every_component(control_plane):
    from click.testing import CliRunner

    from gpufleet.cli import main
    result = CliRunner().invoke(main, ["dev", "status"])
    assert result.exit_code == 0, result.output
    for comp in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
        assert comp in result.output
    assert "gpu-node-3" in result.output
