"""Takeover at scale: from the instant a follower acquires the Lease to its first scale-out,
with N InferenceServices (default 1000) present.

Each service has one ready replica on the simulated GPU nodes (nodes are added for them), and
every replica's pod IP (loopback) answers the guard's and vLLM's /metrics from a small server
(``gpufleet_dev.fake_replicas``). Two operators run with leader election, as
tests/integration/test_leader_election.py runs them, each behind nothing but its own process:
op-a leads, op-b follows. Once op-a has reconciled every service and op-b has followed for a
while, op-a is killed with SIGKILL and one service's replica goes over its KV watermark at
that instant, so the surge is op-b's to answer. Measured: op-b holds the Lease → that service's
Deployment has 2 replicas.

Warm (op-b reads every replica every 5 s while following, the default) against cold (0: it
reads nothing until it leads) in the same run, on the same services; the ratio is cold / warm.
Target: warm ≤ 5 s. Also printed: kill → Lease acquired (the lease duration, 15 s) and the
follower's CPU while following, the cost of keeping warm.

    .venv/bin/python bench/takeover_scale.py [--n 1000] [--follower-interval 5] [--settle 60]

Needs the local control plane (started if it is not running); ~15-25 min at N=1000 on 2 cores,
most of it creating the services and waiting for their replicas.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import client, ensure_cluster, fresh_namespace  # noqa: E402
from operator_scale import cpu_seconds  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpufleet.manifests import names  # noqa: E402
from gpufleet_dev.devcluster.fleet import build_node  # noqa: E402
from gpufleet_dev.devcluster.operator_process import OperatorProcess  # noqa: E402
from gpufleet_dev.fake_replicas import FakeReplicaMetrics  # noqa: E402
from gpufleet_kit.kube.client import KubeClient  # noqa: E402

API = "serving.gpufleet.dev/v1alpha1"
LEASE = "gpufleet-operator"
GPUS_PER_NODE = 100  # the bench's nodes: one replica per GPU, room for 100 on each
PRODUCT, MEMORY_MIB = "NVIDIA-H100-80GB-HBM3", 81559
CALM, SURGE = 0.5, 0.95  # between the 40%/80% watermarks; over the high one


def service(i: int, namespace: str) -> dict:
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": f"svc-{i:04d}", "namespace": namespace},
            "spec": {"model": {"name": f"org/model-{i % 50}"}, "isolation": {"mode": "Shared"},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "maxScaleUpStep": 1,
                                     "scaleDownStabilizationSeconds": 3600}}}


async def add_nodes(kube: KubeClient, n: int) -> list[str]:
    """Simulated GPU nodes (kwok) with room for ``n`` one-GPU replicas."""
    names = []
    for i in range(math.ceil(n / GPUS_PER_NODE)):
        node = build_node(f"bench-takeover-{i}", gpus=GPUS_PER_NODE, product=PRODUCT, memory_mib=MEMORY_MIB,
                          pool="gpu")
        # Room for every replica's CPU, memory and ephemeral-storage requests too: with build_node's defaults
        # (sized for 8 GPUs) 100 replicas a node stayed Pending on "Insufficient ephemeral-storage".
        room = {"cpu": "1000", "memory": "8Ti", "ephemeral-storage": "20Ti", "pods": str(GPUS_PER_NODE + 10)}
        node["status"]["capacity"].update(room)
        node["status"]["allocatable"].update(room)
        if await kube.get_or_none("v1", "Node", node["metadata"]["name"]) is None:
            await kube.create(node)
        names.append(node["metadata"]["name"])
    return names


async def until(check, timeout: float, what: str, step: float = 0.1) -> float:
    """Poll ``check`` until it holds; the monotonic time it first did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return time.monotonic()
        await asyncio.sleep(step)
    raise SystemExit(f"not within {timeout:.0f}s: {what}")


class Fleet:
    """N services in one namespace, each with one ready replica served by ``fake``."""

    def __init__(self, kube: KubeClient, namespace: str, n: int, fake: FakeReplicaMetrics):
        self.kube, self.ns, self.n, self.fake = kube, namespace, n, fake
        self.ips: dict[str, str] = {}  # service -> its replica's pod IP

    async def create(self) -> None:
        sem = asyncio.Semaphore(20)

        async def one(i: int) -> None:
            async with sem:
                await self.kube.create(service(i, self.ns))
        await asyncio.gather(*(one(i) for i in range(self.n)))

    async def all_ready_and_served(self) -> bool:
        pods = await self.kube.list("v1", "Pod", self.ns, label_selector=f"{names.LABEL_NAME}={names.ENGINE_APP}")
        for p in pods:
            ip = p.get("status", {}).get("podIP")
            svc = p["metadata"].get("labels", {}).get(names.LABEL_SERVICE)
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            if ip and svc and ready and not p["metadata"].get("deletionTimestamp"):
                await self.fake.serve(ip)
                self.ips[svc] = ip
        return len(self.ips) >= self.n

    async def replicas(self, svc: str) -> int:
        d = await self.kube.get_or_none("apps/v1", "Deployment", f"{svc}-engine", self.ns)
        return d["spec"]["replicas"] if d else 0


async def holder(kube: KubeClient, namespace: str) -> str | None:
    lease = await kube.get_or_none("coordination.k8s.io/v1", "Lease", LEASE, namespace)
    return (lease or {}).get("spec", {}).get("holderIdentity") or None


def leader_elected(state: dict, namespace: str, name: str, follower_interval: float, logs: Path) -> OperatorProcess:
    return OperatorProcess(state["kubeconfig"], logs / f"{name}.log", (
        "--namespace", namespace, "--leader-elect", "--leader-elect-resource-namespace", namespace,
        "--leader-elect-identity", name, "--follower-interval-seconds", str(follower_interval)))


async def trial(state: dict, fleet: Fleet, hot: str, follower_interval: float, settle: float, logs: Path) -> dict:
    """op-a leads, op-b follows with ``follower_interval``; op-a is killed as ``hot`` surges."""
    kube, ns = fleet.kube, fleet.ns
    await fleet.all_ready_and_served()  # a replica added by the trial before is answered too
    name_a, name_b = f"op-a-{follower_interval:g}", f"op-b-{follower_interval:g}"
    a = await asyncio.to_thread(leader_elected(state, ns, name_a, follower_interval, logs).start)
    b = None
    try:
        await until(lambda: _is(holder(kube, ns), name_a), 60, "op-a leading")
        b = await asyncio.to_thread(leader_elected(state, ns, name_b, follower_interval, logs).start)
        # op-a has reconciled as many times as there are services (each once, on its listing or by
        # its takeover's reconciles); over the settle time op-b lists them all and, warm, reads every
        # replica several times.
        await until(lambda: _reconciles(a, fleet.n), 1800, "op-a reconciling every service", step=1.0)
        cpu_before, started = cpu_seconds(b.proc.pid), time.monotonic()
        await asyncio.sleep(settle)
        follower_cpu = (cpu_seconds(b.proc.pid) - cpu_before) / (time.monotonic() - started)
        assert await fleet.replicas(hot) == 1, f"{hot} was scaled before the surge"

        killed = time.monotonic()
        a.stop(sig_kill=True)
        fleet.fake.kv_by_ip[fleet.ips[hot]] = SURGE  # a surge nobody acts on until op-b leads
        acquired = await until(lambda: _is(holder(kube, ns), name_b), 60,
                               "op-b taking the Lease over", step=0.05)
        scaled = await until(lambda: _at_least(fleet.replicas(hot), 2), 120, f"{hot} scaled out", step=0.05)
        return {"interval": follower_interval, "kill_to_lease_s": acquired - killed,
                "lease_to_scale_s": scaled - acquired, "follower_cpu": follower_cpu,
                "logs": [str(a.log_path), str(b.log_path)]}
    finally:
        a.stop(sig_kill=True)
        if b is not None:
            await asyncio.to_thread(b.stop)
        fleet.fake.kv_by_ip.clear()


async def _reconciles(op: OperatorProcess, at_least: int) -> bool:
    text = await asyncio.to_thread(op.metrics_text)
    done = sum(s.value for f in text_string_to_metric_families(text) if f.name == "gpufleet_reconcile"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("kind") == "InferenceService"
               and s.labels.get("result") == "ok")
    return done >= at_least


async def _is(value, wanted) -> bool:
    return (await value) == wanted


async def _at_least(value, wanted) -> bool:
    return (await value) >= wanted


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="InferenceServices present (default 1000)")
    p.add_argument("--follower-interval", type=float, default=5.0,
                   help="the warm follower's --follower-interval-seconds (default 5); the baseline runs with 0")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds op-b follows before op-a is killed (default 60)")
    p.add_argument("--target", type=float, default=5.0, help="Lease acquired -> scale-out, warm (default 5 s)")
    args = p.parse_args()
    # One listening socket per replica, and the operators' connections to them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.n + 1024)), hard))
    state = await asyncio.to_thread(ensure_cluster)  # `up` runs its own event loop
    kube = client(state)
    fake = FakeReplicaMetrics(kv=CALM)
    logs = Path(tempfile.mkdtemp(prefix="gpufleet-bench-takeover-"))
    ns = await fresh_namespace(kube, "bench-takeover")
    nodes: list[str] = []
    try:
        nodes = await add_nodes(kube, args.n)
        fleet = Fleet(kube, ns, args.n, fake)
        # A leader to create the replicas; the trials start operators of their own.
        creator = await asyncio.to_thread(leader_elected(state, ns, "op-setup", 0.0, logs).start)
        try:
            t0 = time.monotonic()
            await fleet.create()
            await until(fleet.all_ready_and_served, 1800, f"{args.n} ready replicas", step=2.0)
            print(f"{args.n} services with a ready replica each in {time.monotonic() - t0:.0f}s", flush=True)
        finally:
            await asyncio.to_thread(creator.stop)
        results = []
        for i, interval in enumerate((args.follower_interval, 0.0)):
            hot = f"svc-{i:04d}"
            r = await trial(state, fleet, hot, interval, args.settle, logs)
            print(f"  follower interval {interval:g}s: kill -9 -> Lease {r['kill_to_lease_s']:.2f}s; "
                  f"Lease -> {hot} scaled out {r['lease_to_scale_s']:.2f}s", flush=True)
            results.append(r)
    finally:
        await kube.delete("v1", "Namespace", ns)
        for name in nodes:
            await kube.delete("v1", "Node", name)
        await fake.close()
        await kube.close()
    warm, cold = results
    print(f"\nN = {args.n} InferenceServices, one ready replica each; operator logs in {logs}\n")
    print("| follower | kill -9 → Lease acquired | Lease acquired → first scale-out | follower CPU while following |")
    print("|---|---|---|---|")
    for r, label in ((warm, f"warm (--follower-interval-seconds {warm['interval']:g})"),
                     (cold, "cold (--follower-interval-seconds 0), baseline")):
        print(f"| {label} | {r['kill_to_lease_s']:.2f} s | {r['lease_to_scale_s']:.2f} s | "
              f"{100 * r['follower_cpu']:.0f}% of a core |")
    ratio = cold["lease_to_scale_s"] / warm["lease_to_scale_s"] if warm["lease_to_scale_s"] > 0 else float("inf")
    met = warm["lease_to_scale_s"] <= args.target
    print(f"\ncold / warm (Lease acquired → first scale-out): {ratio:.1f}x; target warm ≤ {args.target:g} s — "
          f"{'met' if met else 'NOT met'}")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    asyncio.run(main())
