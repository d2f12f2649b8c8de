"""Cluster DNS for the real node: CoreDNS as a host process, exposed as ``kube-dns``.

As on a real cluster: the ``kube-dns`` Service in ``kube-system`` holds a fixed
ClusterIP (``CLUSTER_DNS_IP``, in the control plane's Service range), the
kubelet writes it into every pod's ``/etc/resolv.conf`` (``clusterDNS``, with
the ``<ns>.svc.cluster.local svc.cluster.local cluster.local`` search list), and
kube-proxy translates it to the Service's endpoint: here a selector-less
Service whose EndpointSlice names CoreDNS's address on the node, ``NODE_IP:53``.

CoreDNS answers ``cluster.local`` from the API server (its ``kubernetes``
plugin, logged in with a ServiceAccount token of the ``system:coredns`` rules)
and refuses every other name: nothing is forwarded off the machine, and pods
reach nothing outside it anyway.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from . import accounts, binaries

NAME = "coredns"
CLUSTER_DOMAIN = "cluster.local"
CLUSTER_DNS_IP = "10.96.0.10"  # kubeadm's choice: the tenth address of the Service range
SERVICE = "kube-dns"
# system:coredns, as kubeadm and CoreDNS's deployment manifests grant it.
RULES = [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
          "verbs": ["list", "watch"]},
         {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]


def corefile(bind: str, kubeconfig: Path, health_port: int, ready_port: int) -> str:
    """Only the cluster's zone (and reverse lookups of its addresses): other names get REFUSED,
    as CoreDNS answers a name no server block serves."""
    return f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {bind}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} gpufleet-local
        pods insecure
        ttl 5
    }}
    cache 5
    loadbalance
}}
"""


def kubeconfig(server: str, account_dir: Path) -> str:
    """CoreDNS's login: the ServiceAccount token (re-read from its file) and the cluster CA."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: gpufleet-local
  cluster: {{server: "{server}", certificate-authority: "{account_dir / 'ca.crt'}"}}
users:
- name: {NAME}
  user: {{tokenFile: "{account_dir / 'token'}"}}
contexts:
- name: gpufleet-local
  context: {{cluster: gpufleet-local, user: {NAME}}}
current-context: gpufleet-local
"""


def service_objects(node_ip: str) -> list[dict]:
    """``kube-dns`` at ``CLUSTER_DNS_IP`` and the EndpointSlice that points it at CoreDNS on the node."""
    labels = {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS", "app.kubernetes.io/managed-by": "gpufleet-dev"}
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": SERVICE, "namespace": "kube-system", "labels": labels},
         "spec": {"clusterIP": CLUSTER_DNS_IP, "ports": [
             {"name": name, "protocol": proto, "port": 53, "targetPort": 53} for name, proto in ports]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"{SERVICE}-node", "namespace": "kube-system",
                      # Not the EndpointSlice controller's: a selector-less Service's slices are their owner's.
                      "labels": {"kubernetes.io/service-name": SERVICE,
                                 "endpointslice.kubernetes.io/managed-by": "gpufleet-dev"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": [node_ip], "conditions": {"ready": True}}],
         "ports": [{"name": name, "protocol": proto, "port": 53} for name, proto in ports]},
    ]


def _http_ok(url: str) -> bool:
    import httpx
    return httpx.get(url, timeout=2, trust_env=False).status_code == 200


def _apply(kubeconfig_file: str, objects: list[dict]) -> None:
    import asyncio

    from gpufleet_kit.kube.client import KubeClient
    from gpufleet_kit.kube.config import KubeConfig

    async def go() -> None:
        async with KubeClient(KubeConfig.from_file(kubeconfig_file)) as kube:
            for obj in objects:
                await kube.apply(obj, field_manager="gpufleet-dev")
    asyncio.run(go())


def start(state: dict, root: Path, logs: Path, spawn: Callable, wait: Callable, progress: Callable,
          node_ip: str) -> None:
    from .layout import free_port, kubeconfig_path
    # The Service first: its fixed ClusterIP must not be handed to another Service meanwhile.
    _apply(str(kubeconfig_path()), service_objects(node_ip))
    work = root / "real-node" / "coredns"
    account = accounts.issue(str(kubeconfig_path()), NAME, RULES, work / "account", root / "pki" / "ca.crt")
    (work / "kubeconfig").write_text(kubeconfig(state["server"], account))
    ports = {"coredns-health": free_port(), "coredns-ready": free_port()}
    state["ports"].update(ports)
    (work / "Corefile").write_text(corefile(node_ip, work / "kubeconfig", ports["coredns-health"],
                                            ports["coredns-ready"]))
    progress(f"starting CoreDNS {binaries.COREDNS_VERSION} ({CLUSTER_DOMAIN} at {node_ip}:53, the kube-dns "
             f"Service {CLUSTER_DNS_IP})")
    state["processes"][NAME] = spawn(NAME, [str(binaries.COREDNS.binary(NAME)), "-conf", str(work / "Corefile")],
                                     logs)
    wait("CoreDNS ready (its kubernetes plugin synced)",
         lambda: _http_ok(f"http://127.0.0.1:{ports['coredns-ready']}/ready"), 60, (NAME,))


def stop(state: dict, stop_process: Callable) -> bool:
    proc = state.get("processes", {}).get(NAME)
    return bool(proc) and stop_process(proc, 5)
