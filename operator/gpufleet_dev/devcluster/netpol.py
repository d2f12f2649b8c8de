"""NetworkPolicy enforcement on the real node: kube-network-policies as a host process.

kube-network-policies (a Kubernetes SIG project, sigs.k8s.io/kube-network-policies)
watches NetworkPolicies, Namespaces and Pods and programs an nftables table
(``inet kube-network-policies``) on the node: the first packet of each new
connection from or to a pod that some policy selects goes to an nfqueue, where
the process decides it against the policies and accepts or drops it.
Established connections, the node's root processes (the kubelet's probes) and
ICMPv6 pass. Its chain sits in POSTROUTING before kube-proxy's SNAT, so it sees
a Service connection after the Service address is translated to a pod, and with
the original pod source; UDP DNS is decided in PREROUTING after DNAT.

On a kernel without nftables' ``queue`` expression (CONFIG_NFT_QUEUE unset,
as on this development machine's: its batch fails with "netlink receive: no
such file or directory"), the same steering goes into iptables' mangle table
with the xtables NFQUEUE target (``steering_rules``): the decisions are still
kube-network-policies', read from the same queue. Without its set of
policy-selected pods, every pod's new connections are queued; one no policy
selects is accepted.

It logs in as a pod would (``rest.InClusterConfig``, no kubeconfig flag): the
process runs in its own mount namespace where a tmpfs on ``/run`` holds the
ServiceAccount token at ``/run/secrets/kubernetes.io/serviceaccount``, and
``KUBERNETES_SERVICE_HOST``/``_PORT`` name the API server.
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

from . import accounts, binaries

NAME = "kube-network-policies"
TABLE = "kube-network-policies"  # its nftables table (family inet)
# From its install.yaml: what the controller lists and watches.
RULES = [{"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
         {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "watch"]}]
SA_MOUNT = "/run/secrets/kubernetes.io/serviceaccount"
QUEUE = 100  # its --nfqueue-id default
CHAIN = "GPUFLEET-NETPOL"          # mangle POSTROUTING: new connections from or to pods
DNS_CHAIN = "GPUFLEET-NETPOL-DNS"  # mangle INPUT and FORWARD: UDP DNS after DNAT


def argv(binary: Path, account_dir: Path, node_name: str, metrics_port: int) -> list[str]:
    """The command: a private mount namespace showing ``account_dir`` where in-cluster login reads it."""
    flags = [f"--hostname-override={node_name}", f"--metrics-bind-address=127.0.0.1:{metrics_port}",
             # containerd 1.6 has no NRI: pod IPs come from the API server's pod status.
             "--disable-nri", "--v=1"]
    script = (f"mount -t tmpfs -o size=1m,mode=0755 gpufleet-netpol /run && mkdir -p {SA_MOUNT} && "
              f"mount --bind {shlex.quote(str(account_dir))} {SA_MOUNT} && "
              f"exec {shlex.quote(str(binary))} {' '.join(flags)}")
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]


def environment(api_host: str, api_port: int) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": str(api_port)}


def steering_rules(pod_cidr: str, queue: int = QUEUE) -> list[list[str]]:
    """iptables arguments for what its nftables table does: the same order of exceptions, the same
    hooks (POSTROUTING before SNAT; UDP DNS after DNAT: INPUT and FORWARD are where PREROUTING's
    packets go), the queue without bypass (fail closed)."""
    to_queue = ["-j", "NFQUEUE", "--queue-num", str(queue)]
    post = [["-p", "udp", "--dport", "53", "-j", "RETURN"],
            ["-m", "owner", "--uid-owner", "0", "-j", "RETURN"],  # the node's root processes: probes
            ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"],
            ["-s", pod_cidr, *to_queue], ["-d", pod_cidr, *to_queue]]
    dns = [["-p", "udp", "--dport", "53", "-m", "conntrack", "--ctstate", "NEW", "-s", pod_cidr, *to_queue],
           ["-p", "udp", "--dport", "53", "-m", "conntrack", "--ctstate", "NEW", "-d", pod_cidr, *to_queue]]
    return ([["-t", "mangle", "-N", CHAIN]] + [["-t", "mangle", "-A", CHAIN, *r] for r in post]
            + [["-t", "mangle", "-N", DNS_CHAIN]] + [["-t", "mangle", "-A", DNS_CHAIN, *r] for r in dns]
            + [["-t", "mangle", "-A", "POSTROUTING", "-j", CHAIN]]
            + [["-t", "mangle", "-A", hook, "-j", DNS_CHAIN] for hook in ("INPUT", "FORWARD")])


def nft_queue_supported() -> bool:
    """Whether the kernel has nftables' queue expression (``nft -c`` asks it, applying nothing)."""
    probe = ("table inet gpufleet-probe {\n chain c {\n  type filter hook postrouting priority 95;\n"
             f"  meta l4proto tcp queue num {QUEUE}\n }}\n}}\n")
    return subprocess.run(["nft", "-c", "-f", "-"], input=probe, capture_output=True, text=True).returncode == 0


def install_steering(pod_cidr: str) -> None:
    remove_steering()
    for rule in steering_rules(pod_cidr):
        subprocess.run(["iptables", "-w", *rule], check=True, capture_output=True)


def remove_steering() -> None:
    for hook, chain in (("POSTROUTING", CHAIN), ("INPUT", DNS_CHAIN), ("FORWARD", DNS_CHAIN)):
        while subprocess.run(["iptables", "-w", "-t", "mangle", "-D", hook, "-j", chain],
                             capture_output=True).returncode == 0:
            pass
    for chain in (CHAIN, DNS_CHAIN):
        subprocess.run(["iptables", "-w", "-t", "mangle", "-F", chain], capture_output=True)
        subprocess.run(["iptables", "-w", "-t", "mangle", "-X", chain], capture_output=True)


def queue_bound(queue: int = QUEUE) -> bool:
    """Whether a process reads ``queue`` (it binds it once its informers have synced)."""
    try:
        lines = Path("/proc/net/netfilter/nfnetlink_queue").read_text().splitlines()
    except OSError:
        return False
    return any(line.split()[:1] == [str(queue)] for line in lines)


def table_present() -> bool:
    return subprocess.run(["nft", "list", "table", "inet", TABLE], capture_output=True).returncode == 0


def remove_table() -> None:
    """What the process removes on SIGINT; after SIGTERM, SIGKILL or a crash its table would keep
    queueing pod packets to a queue nobody reads (dropping them), so ``stop`` always removes it
    (and the iptables steering, for the same reason)."""
    if shutil.which("nft") and table_present():
        subprocess.run(["nft", "delete", "table", "inet", TABLE], capture_output=True)


def _exec_done(pid: int, binary: Path, timeout: float = 10) -> bool:
    """Whether ``pid`` has exec'd ``binary`` (past unshare and the shell) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            return False
        if Path(cmd).name == binary.name:
            return True
        time.sleep(0.05)
    return False


def start(state: dict, root: Path, logs: Path, spawn: Callable, wait: Callable, progress: Callable,
          node_name: str, api_host: str, pod_cidr: str) -> None:
    from .layout import ClusterError, free_port, kubeconfig_path
    binary = binaries.NETWORK_POLICIES.binary(NAME)
    remove_table()  # an earlier run's, if it was killed
    remove_steering()
    own_table = nft_queue_supported()
    state["netpol_steering"] = "nftables" if own_table else "iptables"
    account = accounts.issue(str(kubeconfig_path()), NAME, RULES, root / "real-node" / "netpol-account",
                             root / "pki" / "ca.crt")
    port = free_port()
    state["ports"]["kube-network-policies-metrics"] = port
    progress(f"starting kube-network-policies {binaries.NETWORK_POLICIES_VERSION} (NetworkPolicy enforcement, "
             f"nftables + nfqueue)")
    proc = state["processes"][NAME] = spawn(NAME, argv(binary, account, node_name, port), logs,
                                            env=environment(api_host, state["ports"]["apiserver"]))
    proc["binary"] = str(binary)  # what /proc shows after the exec: the liveness check compares it
    if not _exec_done(proc["pid"], binary):
        raise ClusterError(f"kube-network-policies did not start; log {proc['log']}")
    wait("kube-network-policies reading its nfqueue", queue_bound, 60, (NAME,))
    if own_table:
        wait("kube-network-policies' nftables table", table_present, 60, (NAME,))
    else:
        progress("  this kernel has no nftables queue expression: iptables NFQUEUE rules steer pod traffic to it")
        install_steering(pod_cidr)


def stop(state: dict, stop_process: Callable) -> bool:
    proc = state.get("processes", {}).get(NAME)
    stopped = bool(proc) and stop_process(proc, 5)
    remove_steering()
    remove_table()
    return stopped
