"""A real node beside the simulated ones: containerd, a kubelet, the CNI bridge and kube-proxy.

``gpufleet dev up --real-node`` runs the pod specs gpufleet writes for real:
images from ``gpufleet dev images`` imported into containerd's ``k8s.io``
namespace, container commands, probes, preStop hooks, grace periods,
volumes and securityContext executed by a kubelet of the control plane's
version, and Services and EndpointSlices programmed by kube-proxy
(iptables). Its addresses exist only inside this machine's network
namespaces:

- the node address ``NODE_IP`` on ``lo`` (a kubelet refuses loopback
  addresses; the kernel delivers any local address) — the apiserver binds
  and advertises it, so pods reach it through the ``kubernetes`` Service;
- pods on the bridge ``gpufleet0`` in ``POD_CIDR`` (no masquerade: pods
  reach nothing outside the machine);
- Services in the control plane's ``SERVICE_CIDR``.

The node carries the labels, ``nvidia.com/gpu`` capacity (an extended
resource, as the GPU operator's device plugin would advertise) and taints of
the simulated engine nodes, in its own pool ``real``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Callable

from . import binaries, dns, images, netpol, prune
from .fleet import GPU_TAINT, LOCAL_ENGINE_TAINT, POOL_LABEL
from .layout import ClusterError

Progress = Callable[[str], None]

NODE_NAME = "real-node-0"
NODE_POOL = "real"
NODE_IP = "10.213.0.1"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "gpufleet0"
RUN_DIR = Path("/run/gpufleet-containerd")  # short: containerd's sockets live here
SOCKET = RUN_DIR / "containerd.sock"
PAUSE_REF = "localhost/gpufleet/pause:1"
NAMESPACE = "k8s.io"
COMPONENTS = ("containerd", "kubelet", "kube-proxy", netpol.NAME, dns.NAME)


class RealNodeError(ClusterError):
    pass


def missing_prerequisites() -> list[str]:
    """What this machine lacks for a real node (empty when it can run one)."""
    missing = [tool for tool in ("containerd", "ctr", "runc", "iptables", "nft", "unshare")
               if shutil.which(tool) is None]
    if not Path("/usr/lib/cni/bridge").exists() and not Path("/opt/cni/bin/bridge").exists():
        missing.append("containernetworking-plugins")
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def cni_bin_dir() -> str:
    return "/usr/lib/cni" if Path("/usr/lib/cni/bridge").exists() else "/opt/cni/bin"


def containerd_root() -> Path:
    # Kept between runs: imported images stay imported.
    return binaries.cache_root() / "containerd"


# --- files ----------------------------------------------------------------------


def containerd_config(state: Path) -> str:
    return f"""version = 2
root = "{containerd_root()}"
state = "{RUN_DIR / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{SOCKET}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_REF}"
  # Without these two every pod sandbox fails on this machine kind with runc's
  # "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir()}"
    conf_dir = "{state / 'cni'}"
"""


def cni_config(state: Path) -> str:
    return json.dumps({
        "cniVersion": "0.4.0", "name": "gpufleet",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(state / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "loopback"},
        ]}, indent=2)


def kubelet_config(state: Path, pki: Path, healthz_port: int, port: int) -> str:
    taints = "\n".join(f"- {{key: {t['key']}, value: \"{t['value']}\", effect: {t['effect']}}}"
                       for t in (GPU_TAINT, LOCAL_ENGINE_TAINT))
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{SOCKET}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {pki / 'ca.crt'}}}
authorization: {{mode: AlwaysAllow}}
clusterDomain: {dns.CLUSTER_DOMAIN}
clusterDNS: [{dns.CLUSTER_DNS_IP}]
# The node's resolver for dnsPolicy Default pods; the others get clusterDNS and the cluster's search list only.
resolvConf: {state / 'resolv.conf'}
maxPods: 30
serializeImagePulls: false
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
# Absolute disk thresholds: a percentage of a large shared disk evicted the pods and garbage-collected
# every image (the pause image too) while other work filled the disk for a moment.
evictionHard: {{memory.available: 200Mi, nodefs.available: 1Gi, imagefs.available: 1Gi, nodefs.inodesFree: 1%}}
registerWithTaints:
{taints}
"""


def node_resolv_conf() -> str:
    """Pods with dnsPolicy Default inherit this: the cluster's DNS, no host search domains (pods
    reach nothing outside the machine, and the host's search list would only add refused lookups)."""
    return f"nameserver {NODE_IP}\n"


def kube_proxy_config(kubeconfig: Path, healthz_port: int, metrics_port: int) -> str:
    from .layout import SERVICE_CIDR
    return f"""apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: {NODE_NAME}
bindAddress: {NODE_IP}
healthzBindAddress: 127.0.0.1:{healthz_port}
metricsBindAddress: 127.0.0.1:{metrics_port}
clusterCIDR: {POD_CIDR}
clientConnection: {{kubeconfig: {kubeconfig}}}
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
iptables: {{masqueradeAll: true, syncPeriod: 10s, minSyncPeriod: 0s}}
# {SERVICE_CIDR} is the control plane's Service range.
"""


def node_labels(fleet) -> dict[str, str]:
    return {
        POOL_LABEL: NODE_POOL, "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": fleet.gpu_product,
        "nvidia.com/gpu.count": str(fleet.gpus_per_node), "nvidia.com/gpu.memory": str(fleet.gpu_memory_mib),
        "gpufleet.dev/real-node": "true",
    }


# --- the pause image ------------------------------------------------------------

PAUSE_GO = """package main

import (
	"os"
	"os/signal"
	"syscall"
)

// The pod sandbox's process: holds the pod's namespaces until told to stop.
func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
"""


def ensure_pause_archive(progress: Progress) -> Path:
    """The sandbox image, built from a few lines of Go into a docker-archive (no registry, no daemon)."""
    out = images.images_dir() / "pause-1.tar"
    if out.exists():
        return out
    import hashlib
    import io
    work = binaries.cache_root() / "build" / "pause"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "go.mod").write_text("module gpufleet.local/pause\n\ngo 1.24\n")
    (work / "main.go").write_text(PAUSE_GO)
    progress("building the pod sandbox (pause) image")
    subprocess.run(["go", "build", "-trimpath", "-ldflags=-s -w", "-o", "pause", "."], cwd=work, check=True,
                   env={**os.environ, "CGO_ENABLED": "0"})
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tar.gettarinfo(str(work / "pause"), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        with open(work / "pause", "rb") as fh:
            tar.addfile(info, fh)
    layer_bytes = layer.getvalue()
    layer_id = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
                         "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]}}).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{config_id}.json", "RepoTags": [PAUSE_REF],
                            "Layers": [f"{layer_id}/layer.tar"]}]).encode()
    images.images_dir().mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name, data in ((f"{layer_id}/layer.tar", layer_bytes), (f"{config_id}.json", config),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


# --- host networking ------------------------------------------------------------


def ensure_node_address() -> None:
    have = subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
    if f" {NODE_IP}/" not in have:
        subprocess.run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo"], check=True)


def remove_node_address() -> None:
    subprocess.run(["ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo"], capture_output=True)


def enable_forwarding() -> None:
    # The kernel routes pod -> ClusterIP -> pod back out of the bridge; bridged replies go through
    # iptables so kube-proxy's NAT is undone for them too.
    for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
        path = Path("/proc/sys") / key
        if path.exists():
            path.write_text(value)


# --- containerd -----------------------------------------------------------------


def ctr(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "--address", str(SOCKET), "-n", NAMESPACE, *args], **kw)


def imported_refs() -> set[str]:
    out = ctr("images", "ls", "-q", capture_output=True, text=True, check=True).stdout
    return set(out.split())


def import_images(progress: Progress) -> dict[str, str]:
    """Import the pause image and the images of the last `make images` (missing ones only);
    returns name -> ref. Whether they match the sources is `make images`' business."""
    have = imported_refs()
    refs = {"pause": PAUSE_REF}
    wanted = [(PAUSE_REF, ensure_pause_archive(progress))]
    built = images.latest()
    if images.ENGINE_CPU.name not in built:
        raise RealNodeError(f"image {images.ENGINE_CPU.name} is not built: run `make images` (or `gpufleet dev "
                            f"images`) first")
    # The operator image only where it was built: the demo runs its operator as a local process.
    for name in (i.name for i in images.IMAGES if i.name in built):
        refs[name] = built[name]["ref"]
        wanted.append((built[name]["ref"], Path(built[name]["archive"])))
    for ref, archive in wanted:
        if ref in have:
            continue
        started = time.monotonic()
        progress(f"importing {ref} into containerd ({archive.stat().st_size / 2**20:.0f} MiB)")
        ctr("images", "import", str(archive), check=True, capture_output=True)
        progress(f"  imported in {time.monotonic() - started:.0f}s")
    prune_images({ref for ref, _archive in wanted} | {f"{i.repository()}:dev" for i in images.IMAGES}, progress)
    return refs


def prune_images(keep: set[str], progress: Progress) -> None:
    """Remove the versions of our images that ``keep`` and the node's containers do not use
    (prune.py decides which); containerd's garbage collector then frees their content and
    snapshots (``--sync`` waits for it)."""
    listing = ctr("images", "ls", capture_output=True, text=True, check=True).stdout
    containers = ctr("containers", "ls", capture_output=True, text=True).stdout.splitlines()[1:]
    in_use = {fields[1] for fields in (line.split() for line in containers) if len(fields) >= 2}
    stale = prune.stale_containerd_refs(prune.parse_ctr_images(listing), images.REPOSITORY_PREFIX, keep, in_use)
    if stale:
        ctr("images", "rm", "--sync", *stale, capture_output=True)
        progress(f"containerd: removed {len(stale)} superseded image ref(s)")


def stop_pods() -> None:
    """Kill every container containerd runs for the node (``down`` is not a drain)."""
    if not SOCKET.exists():
        return
    tasks = set(ctr("tasks", "ls", "-q", capture_output=True, text=True).stdout.split())
    for task in tasks:
        ctr("tasks", "kill", "-s", "SIGKILL", task, capture_output=True)
    # Deleted here or gone already: the shim of a killed task may clean it up first, and deleting a task that
    # no longer exists fails (this loop once spent its whole 15 s retrying such a one on every down).
    deadline = time.monotonic() + 15
    while tasks and time.monotonic() < deadline:
        tasks = {task for task in tasks if ctr("tasks", "delete", task, capture_output=True).returncode != 0}
        if tasks:
            tasks &= set(ctr("tasks", "ls", "-q", capture_output=True, text=True).stdout.split())
        if tasks:
            time.sleep(0.2)
    for container in ctr("containers", "ls", "-q", capture_output=True, text=True).stdout.split():
        ctr("containers", "delete", container, capture_output=True)


def cleanup_network(state: Path, bins: dict[str, Path]) -> None:
    subprocess.run([str(bins["kube-proxy"]), "--cleanup"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    # The pods' network namespaces: killed containers never had their sandboxes' CNI DEL, so each
    # ``down`` would leave a namespace and a veth per pod behind (deleting one deletes its veth pair).
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.startswith("cni-")):
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    shutil.rmtree(state / "ipam", ignore_errors=True)
    for mnt in reversed(_mounts_under(state / "kubelet")):
        subprocess.run(["umount", "-l", mnt], capture_output=True)


def _mounts_under(root: Path) -> list[str]:
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [ln.split()[1] for ln in lines
            if ln.split()[1] == str(root) or ln.split()[1].startswith(str(root) + "/")]


# --- lifecycle (called by cluster.up / cluster.down) ----------------------------


def start(state: dict, fleet, root: Path, logs: Path, spawn, wait, progress: Progress) -> None:
    """Start containerd, the kubelet and kube-proxy; returns when the node is Ready with its GPUs."""
    from .layout import free_port, kubeconfig_path
    bins = binaries.ensure_node_agents(progress)
    node_dir = root / "real-node"
    shutil.rmtree(node_dir / "cni", ignore_errors=True)
    shutil.rmtree(node_dir / "ipam", ignore_errors=True)
    (node_dir / "cni").mkdir(parents=True)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    enable_forwarding()
    procs = state["processes"]
    pki = root / "pki"

    (node_dir / "containerd.toml").write_text(containerd_config(node_dir))
    (node_dir / "cni" / "10-gpufleet.conflist").write_text(cni_config(node_dir))
    progress("starting containerd (CRI, runc, CNI bridge)")
    procs["containerd"] = spawn("containerd", [shutil.which("containerd") or "containerd", "--config",
                                               str(node_dir / "containerd.toml")], logs)
    wait("containerd", lambda: ctr("version", capture_output=True).returncode == 0, 30, ("containerd",))
    refs = import_images(progress)
    state["images"] = refs

    ports = {"kubelet": free_port(), "kubelet-healthz": free_port(), "kube-proxy-healthz": free_port(),
             "kube-proxy-metrics": free_port()}
    state["ports"].update(ports)
    (node_dir / "resolv.conf").write_text(node_resolv_conf())
    (node_dir / "kubelet.yaml").write_text(kubelet_config(node_dir, pki, ports["kubelet-healthz"], ports["kubelet"]))
    labels = ",".join(f"{k}={v}" for k, v in node_labels(fleet).items())
    progress(f"starting the kubelet ({binaries.KUBERNETES_VERSION}) of {NODE_NAME} at {NODE_IP}")
    procs["kubelet"] = spawn("kubelet", [
        str(bins["kubelet"]), f"--config={node_dir / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig_path()}",
        f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", f"--node-labels={labels}",
        f"--root-dir={node_dir / 'kubelet'}", f"--cert-dir={node_dir / 'kubelet' / 'pki'}", "--v=1",
    ], logs)
    wait(f"{NODE_NAME} to register and be Ready", lambda: _node_ready(str(kubeconfig_path())), 120,
         ("containerd", "kubelet"))
    _advertise_gpus(str(kubeconfig_path()), fleet.gpus_per_node)

    (node_dir / "kube-proxy.yaml").write_text(kube_proxy_config(
        kubeconfig_path(), ports["kube-proxy-healthz"], ports["kube-proxy-metrics"]))
    progress("starting kube-proxy (iptables)")
    procs["kube-proxy"] = spawn("kube-proxy", [str(bins["kube-proxy"]), f"--config={node_dir / 'kube-proxy.yaml'}",
                                               "--v=1"], logs)
    wait("kube-proxy", lambda: _http_ok(f"http://127.0.0.1:{ports['kube-proxy-healthz']}/healthz"), 60,
         ("kube-proxy",))
    netpol.start(state, root, logs, spawn, wait, progress, NODE_NAME, NODE_IP, POD_CIDR)
    dns.start(state, root, logs, spawn, wait, progress, NODE_IP)


def _http_ok(url: str) -> bool:
    import httpx
    return httpx.get(url, timeout=2, trust_env=False).status_code == 200


def _node_ready(kubeconfig: str) -> bool:
    import asyncio

    from gpufleet_kit.kube.client import KubeClient
    from gpufleet_kit.kube.config import KubeConfig

    async def go() -> bool:
        async with KubeClient(KubeConfig.from_file(kubeconfig)) as kube:
            node = await kube.get_or_none("v1", "Node", NODE_NAME)
            conds = {c["type"]: c["status"] for c in (node or {}).get("status", {}).get("conditions", [])}
            return conds.get("Ready") == "True"
    return asyncio.run(go())


def _advertise_gpus(kubeconfig: str, gpus: int) -> None:
    """nvidia.com/gpu as an extended resource: what the device plugin would report (the kubelet keeps it)."""
    import asyncio

    from gpufleet_kit.kube.client import KubeClient
    from gpufleet_kit.kube.config import KubeConfig

    async def go() -> None:
        async with KubeClient(KubeConfig.from_file(kubeconfig)) as kube:
            await kube.merge_patch("v1", "Node", NODE_NAME, {"status": {"capacity": {"nvidia.com/gpu": str(gpus)}}},
                                   subresource="status")
            for _ in range(100):
                node = await kube.get("v1", "Node", NODE_NAME)
                if node["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(gpus):
                    return
                await asyncio.sleep(0.2)
            raise RealNodeError(f"{NODE_NAME} did not report nvidia.com/gpu as allocatable")
    asyncio.run(go())


def stop(state: dict, root: Path, stop_process) -> list[str]:
    """Stop CoreDNS, kube-network-policies (removing its nftables table), kube-proxy and the kubelet,
    kill the pods' containers, stop containerd, clean the network."""
    procs = state.get("processes", {})
    stopped = [name for name, service in ((dns.NAME, dns), (netpol.NAME, netpol)) if service.stop(state, stop_process)]
    stopped += [name for name in ("kube-proxy", "kubelet") if name in procs and stop_process(procs[name], 5)]
    stop_pods()
    if "containerd" in procs and stop_process(procs["containerd"], 5):
        stopped.append("containerd")
    bins = {name: binaries.KUBERNETES_NODE.binary(name) for name in binaries.KUBERNETES_NODE.outputs}
    cleanup_network(root / "real-node", bins)
    remove_node_address()
    return stopped
