"""NetworkPolicies enforced for real (kube-network-policies on the real node) and cluster DNS
(CoreDNS behind the kube-dns Service), seen from pods: small probe pods of the operator image
(it has python3), one in a namespace of its own and one in the service's, connect with a
timeout to names and addresses, and so do the router's and the operator's pods.

A dropped connection times out; one the policy lets through to a port nothing listens on is
refused. vLLM listens on the pod's loopback only (the host sees its port on the pod's address
refuse, test_real_pods), so a timeout there is the engines' policy dropping it.

The guard's control routes on the same pods (docs/security.md, "The guard's control routes"): a
caller inside the engine pod from 127.0.0.6 (where Istio's inbound sidecar connects from) and a pod
beside the service with its own ServiceAccount token are refused; the operator's pod, with the
token the chart projects for it, is answered. These tests share the module's probe pods: the
service's engine pod and the probes hold the node's CPU only from here on (the LoRA module before
this one scales its own service to two replicas, which a third engine pod would not leave room for).
"""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import yaml

from gpufleet.manifests import names
from gpufleet_dev.devcluster import dns, node
from tests.realnode.product import SERVICE, _pods, _ready
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)

ROUTER = "gpufleet-router"
# Prints "open|refused|timeout|error <address>" or "unresolved <why>".
CONNECT = """
import socket, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    addr = socket.gethostbyname(host)
except OSError as e:
    print("unresolved", e); sys.exit()
s = socket.socket(); s.settimeout(timeout)
try:
    s.connect((addr, port)); print("open", addr)
except socket.timeout:
    print("timeout", addr)
except ConnectionRefusedError:
    print("refused", addr)
except OSError as e:
    print("error", addr, e)
"""
GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def connect(control_plane, ns: str, pod: str, host: str, port: int, timeout: float = 3) -> str:
    return control_plane.kubectl("-n", ns, "exec", pod, "--", "python3", "-c", CONNECT, host, str(port),
                                 str(timeout), check=False).stdout.strip()


async def connects(control_plane, ns: str, pod: str, host: str, port: int, expected: str) -> None:
    """``pod`` connects to ``host:port`` (the connect says ``expected``). A connection the policy admits is
    answered at once by the kernel, but the node's policy agent judges its first packet in user space: on a
    loaded node that can outlast a short connect timeout, which would read as a drop. So an admitted
    connection is tried until it opens, with a longer timeout; a drop is what a single short try shows."""
    await wait_for(lambda: connect(control_plane, ns, pod, host, port, timeout=10) == expected, timeout=60,
                   what=f"{ns}/{pod} connecting to {host}:{port} ({expected})",
                   describe=lambda: connect(control_plane, ns, pod, host, port, timeout=10))


def _probe_pod(image: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "labels": {"app": "probe"}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node.NODE_NAME},
                     "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
                     "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "probe", "image": image, "imagePullPolicy": "IfNotPresent",
                                     "command": ["python3", "-c", "import signal; signal.pause()"],
                                     "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                                                   "limits": {"memory": "64Mi"}}}]}}


@pytest.fixture(scope="module")
def probes(service, install, control_plane, built_images) -> dict[str, str]:
    """Probe pods, Running: 'outside' in a namespace of its own, 'beside' in the service's."""
    outside = f"rn-outside-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", outside)
    spec = yaml.safe_dump(_probe_pod(built_images["operator"]))
    namespaces = {"outside": outside, "beside": install.work_ns}
    for ns in namespaces.values():
        control_plane.kubectl("apply", "-n", ns, "-f", "-", input=spec)

    async def running():
        kube = control_plane.client()
        try:
            for ns in namespaces.values():
                await wait_for(lambda ns=ns: _probe_running(kube, ns), timeout=120, what=f"the probe pod in {ns}",
                               describe=lambda ns=ns: control_plane.kubectl("-n", ns, "describe", "pod", "probe",
                                                                            check=False).stdout[-2000:])
        finally:
            await kube.close()
    asyncio.run(running())
    yield namespaces
    control_plane.kubectl("delete", "namespace", outside, "--wait=false", check=False)
    control_plane.kubectl("-n", install.work_ns, "delete", "pod", "probe", "--wait=false", check=False)


async def _probe_running(kube, ns: str) -> bool:
    pod = await kube.get_or_none("v1", "Pod", "probe", ns)
    return bool(pod) and _ready(pod)


async def _one_ready(kube, ns: str, selector: str) -> dict:
    async def ready():
        return next((p for p in await _pods(kube, ns, selector) if _ready(p)), None)
    return await wait_for(ready, timeout=180, what=f"a Ready pod {selector} in {ns}")


async def test_a_pod_in_another_namespace_reaches_the_router_by_name_but_not_the_engines(
        service, install, probes, control_plane, kube):
    engine = (await _pods(kube, install.work_ns, names.selector_string(SERVICE)))[0]["status"]["podIP"]
    outside = probes["outside"]
    router = f"{ROUTER}.{install.operator_ns}"
    # The router's policy admits every namespace by default: the probe has a network and DNS.
    await wait_for(lambda: connect(control_plane, outside, "probe", router, 80, timeout=10).startswith("open"),
                   timeout=60, what=f"the outside probe connecting to {router}:80")
    models = control_plane.kubectl("-n", outside, "exec", "probe", "--", "python3", "-c", GET,
                                   f"http://{router}/v1/models").stdout
    assert "tiny-llama" in models
    # The engines admit only the operator, the router's namespace and their own: dropped, by Service
    # name (translated to the pod before the policy sees it) and by the pod's address.
    assert connect(control_plane, outside, "probe", f"{SERVICE}.{install.work_ns}", 80) == f"timeout {service}"
    assert connect(control_plane, outside, "probe", engine, names.GUARD_PORT) == f"timeout {engine}"


async def test_the_router_operator_and_services_namespace_reach_the_guard_and_nothing_reaches_vllm(
        service, install, probes, control_plane, kube):
    engine = (await _pods(kube, install.work_ns, names.selector_string(SERVICE)))[0]["status"]["podIP"]
    router = (await _one_ready(kube, install.operator_ns, f"app.kubernetes.io/name={ROUTER}"))["metadata"]["name"]
    operator = (await _one_ready(kube, install.operator_ns, "app.kubernetes.io/name=gpufleet-operator"))[
        "metadata"]["name"]
    for ns, pod in ((install.operator_ns, router), (install.operator_ns, operator), (install.work_ns, "probe")):
        await connects(control_plane, ns, pod, engine, names.GUARD_PORT, f"open {engine}")
        # vLLM's port: the policy drops it (without the policy the pod's kernel would refuse it).
        assert connect(control_plane, ns, pod, engine, names.ENGINE_PORT) == f"timeout {engine}", pod
    # Beside the service, by its short name.
    await connects(control_plane, install.work_ns, "probe", SERVICE, 80, f"open {service}")


async def test_pods_resolve_services_by_name_through_kube_dns(service, install, probes, control_plane, kube):
    outside, beside = probes["outside"], install.work_ns
    fqdn = f"{SERVICE}.{beside}.svc.cluster.local"
    resolv = control_plane.kubectl("-n", outside, "exec", "probe", "--", "cat", "/etc/resolv.conf").stdout
    assert f"nameserver {dns.CLUSTER_DNS_IP}" in resolv and f"search {outside}.svc.cluster.local" in resolv

    def resolve(ns: str, pod: str, name: str) -> str:
        return control_plane.kubectl("-n", ns, "exec", pod, "--", "python3", "-c",
                                     "import socket, sys; print(socket.gethostbyname(sys.argv[1]))", name,
                                     check=False).stdout.strip()
    for ns, name in ((beside, SERVICE), (outside, f"{SERVICE}.{beside}"), (outside, fqdn)):
        assert resolve(ns, "probe", name) == service, (ns, name)
    assert resolve(outside, "probe", "kubernetes.default") == "10.96.0.1"
    # Names outside the cluster are refused, not forwarded anywhere.
    assert resolve(outside, "probe", "example.com") == ""
    # Pods under an egress policy (the router's) still reach DNS: the policy sees the query after the
    # kube-dns address is translated to CoreDNS's on the node.
    router = (await _one_ready(kube, install.operator_ns, f"app.kubernetes.io/name={ROUTER}"))["metadata"]["name"]
    assert resolve(install.operator_ns, router, fqdn) == service


# The guard's control routes ---------------------------------------------------------------------

# Prints "<status> <body>": one request from a chosen source address, with an optional bearer token
# read from a file (the pod's own token, or the operator's projected one).
REQUEST = """
import http.client, sys
source, host, port, method, path, token_file = sys.argv[1:7]
headers = {"Content-Type": "application/json"}
if token_file != "-":
    headers["Authorization"] = "Bearer " + open(token_file).read().strip()
c = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0) if source != "-" else None)
c.request(method, path, body=sys.argv[7] if len(sys.argv) > 7 else None, headers=headers)
r = c.getresponse()
print(r.status, r.read().decode())
"""
ADAPTERS = json.dumps({"adapters": [{"name": "tenant-a", "source": {"uri": "https://attacker.example/w.tar"}}]})
POD_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
OPERATOR_TOKEN = "/var/run/secrets/gpufleet/guard/token"


def request(control_plane, ns: str, pod: str, container: str | None, source: str, host: str, method: str,
            path: str, token_file: str = "-", body: str | None = None) -> tuple[int, str]:
    where = ["-c", container] if container else []
    out = control_plane.kubectl("-n", ns, "exec", pod, *where, "--", "python3", "-c", REQUEST, source, host,
                                str(names.GUARD_PORT), method, path, token_file, *([body] if body else [])
                                ).stdout.strip()
    status, _, text = out.partition(" ")
    return int(status), text


async def engine_pod(kube, ns: str) -> dict:
    return (await _pods(kube, ns, names.selector_string(SERVICE)))[0]


async def test_a_caller_on_the_pods_loopback_from_a_sidecars_address_is_refused(service, install, control_plane,
                                                                               kube):
    pod = (await engine_pod(kube, install.work_ns))["metadata"]["name"]
    ns = install.work_ns
    for source in ("127.0.0.6", "127.0.0.1"):
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "PUT", "/adapters",
                               body=ADAPTERS)
        assert status == 401 and "accepts the gpufleet operator only" in text, text
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "GET", "/audit")
        assert status == 401 and "no Authorization header" in text, text
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "POST", "/drain")
        assert status == 403 and "admin socket" in text, text
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "POST", "/reset_prefix_cache")
        assert status == 401, text
    status, text = request(control_plane, ns, pod, "guard", "-", "127.0.0.1", "GET", "/drain")
    assert status == 200 and json.loads(text)["draining"] is False


async def test_a_pod_beside_the_service_with_its_own_token_is_refused(service, install, probes,
                                                                       control_plane, kube):
    engine = (await engine_pod(kube, install.work_ns))["status"]["podIP"]
    # The probe's automounted token is for the API server's audience, not the guard's.
    status, text = request(control_plane, install.work_ns, "probe", None, "-", engine, "GET", "/audit", POD_TOKEN)
    assert status == 401 and "audience" in text, text
    status, text = request(control_plane, install.work_ns, "probe", None, "-", engine, "POST", "/drain", POD_TOKEN)
    assert status == 403, text


async def test_the_operators_pod_is_answered_with_its_projected_token(service, install, control_plane, kube):
    engine = (await engine_pod(kube, install.work_ns))["status"]["podIP"]
    operator = (await _one_ready(kube, install.operator_ns, "app.kubernetes.io/name=gpufleet-operator"))[
        "metadata"]["name"]
    status, text = request(control_plane, install.operator_ns, operator, None, "-", engine, "GET", "/audit",
                           OPERATOR_TOKEN)
    assert status == 200 and json.loads(text)["kv"], text
    status, text = request(control_plane, install.operator_ns, operator, None, "-", engine, "GET", "/audit")
    assert status == 401, text
    logs = control_plane.kubectl("-n", install.operator_ns, "logs", operator, check=False).stdout
    assert "answered 401" not in logs and "refuse the operator" not in logs, logs[-3000:]
