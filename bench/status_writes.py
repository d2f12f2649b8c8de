"""Status writes under load: the operator's status PATCH/PUT requests per second and the API
server's CPU while N busy services' figures change every second, with the figures written on
every change (--status-figures-interval-seconds 0, the baseline, as before issue 34) and paced
(the default, 20 s), in the same run on the same services.

N InferenceServices of one replica each (minReplicas = maxReplicas = 1: no scaling decision is
possible, so every status write left is a figure's or a condition's) on simulated GPU nodes the
benchmark registers for itself (pool bench-status, 100 GPUs each; deleted at the end). Each
replica's pod IP answers the guard's and vLLM's /metrics from this process
(``gpufleet_dev.fake_replicas``), with a KV usage that moves every second, so the operator's
one-second read sees a new kvCacheUsagePercent for every service on nearly every tick.

Per arm: a fresh operator process (``--resync-seconds 3600``: no resync inside the window), a wait
until it has settled (every service Ready, and no write besides status for 10 s), one interval
more, then a fixed window (``--window``) over which it counts the operator's own requests
(``gpufleet_operator_api_requests_total{verb, resource}``: patch and update of
``inferenceservices/status``) and the CPU seconds of kube-apiserver, etcd and the operator.
Prints a table and the ratios interval 0 : interval 20.

    .venv/bin/python bench/status_writes.py [--n 100] [--window 60]   # N=100: ~10 min
    .venv/bin/python bench/status_writes.py --n 1000                   # the issue's figure: ~30 min
"""
from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import client, ensure_cluster, fresh_namespace  # noqa: E402
from operator_scale import api_requests, cpu_seconds  # noqa: E402

from gpufleet_dev.devcluster.fleet import build_node  # noqa: E402
from gpufleet_dev.devcluster.operator_process import OperatorProcess  # noqa: E402
from gpufleet_dev.fake_replicas import FakeReplicaMetrics  # noqa: E402
from gpufleet_kit.kube.client import KubeClient  # noqa: E402

API = "serving.gpufleet.dev/v1alpha1"
POOL = "bench-status"
GPUS_PER_NODE = 100
STATUS = "inferenceservices/status"
MEASURED = ("kube-apiserver", "etcd")
SETTLE_QUIET_S = 10.0
SETUP_TIMEOUT_S = 1800.0


def service(i: int, namespace: str) -> dict:
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": f"busy-{i:04d}", "namespace": namespace},
            "spec": {"model": {"name": f"org/model-{i % 50}"},
                     "isolation": {"mode": "Shared", "nodePool": POOL},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 1}}}


def bench_nodes(n: int) -> list[dict]:
    """Enough simulated GPU nodes for one replica of each of ``n`` services (the cluster's own four
    hold 32 GPUs), with room for their CPU and memory requests."""
    nodes = []
    for i in range(math.ceil(n / GPUS_PER_NODE)):
        node = build_node(f"{POOL}-{i}", gpus=GPUS_PER_NODE, product="NVIDIA-H100-80GB-HBM3", memory_mib=81559,
                          pool=POOL)
        node["status"]["capacity"].update({"cpu": "1000", "memory": "8Ti", "ephemeral-storage": "20Ti",
                                           "pods": str(GPUS_PER_NODE + 10)})
        nodes.append(node)
    return nodes


async def move_kv(fake: FakeReplicaMetrics, stop: asyncio.Event) -> None:
    """A KV usage that changes by a point every second, between the watermarks (40-59%)."""
    second = 0
    while not stop.is_set():
        fake.kv = 0.40 + 0.01 * (second % 20)
        second += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass


async def serve_replicas(kube: KubeClient, ns: str, fake: FakeReplicaMetrics) -> int:
    """Answer /metrics on every engine pod IP of the namespace; the pods with one."""
    served = 0
    for p in await kube.list("v1", "Pod", ns, label_selector="app.kubernetes.io/name=gpufleet-engine"):
        ip = (p.get("status") or {}).get("podIP")
        if ip:
            await fake.serve(ip)
            served += 1
    return served


def writes_besides_status(op: OperatorProcess) -> int:
    return sum(v for k, v in api_requests(op.metrics_text()).items()
               if k.split(" ", 1)[0] in ("create", "patch", "update", "delete") and not k.endswith("/status"))


async def settle(kube: KubeClient, ns: str, n: int, op: OperatorProcess, fake: FakeReplicaMetrics) -> float:
    """Wait until every service is Ready with its replica read, and the operator has written nothing
    but status for SETTLE_QUIET_S; the seconds it took."""
    start = time.monotonic()
    quiet_since, last_writes = None, -1
    while True:
        if time.monotonic() - start > SETUP_TIMEOUT_S:
            raise SystemExit(f"not settled after {SETUP_TIMEOUT_S:.0f}s; operator log {op.log_path}")
        served = await serve_replicas(kube, ns, fake)
        items = await kube.list(API, "InferenceService", ns)
        ready = sum(1 for o in items if (o.get("status") or {}).get("readyReplicas") == 1 and any(
            c["type"] == "Ready" and c["status"] == "True" for c in (o.get("status") or {}).get("conditions", [])))
        writes = writes_besides_status(op)
        now = time.monotonic()
        if ready < n or served < n or writes != last_writes:
            quiet_since, last_writes = None, writes
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= SETTLE_QUIET_S:
            return now - start
        print(f"  [{now - start:5.0f}s] {ready}/{n} ready, {served} replicas served, {writes} writes besides "
              f"status", flush=True)
        await asyncio.sleep(2.0)


def cpu(state: dict, op: OperatorProcess) -> dict[str, float]:
    assert op.proc is not None
    out = {"operator": cpu_seconds(op.proc.pid)}
    for name in MEASURED:
        proc = state.get("processes", {}).get(name)
        if proc:
            out[name] = cpu_seconds(proc["pid"])
    return out


def status_writes(op: OperatorProcess) -> int:
    counts = api_requests(op.metrics_text())
    return counts[f"patch {STATUS}"] + counts[f"update {STATUS}"]


async def arm(state: dict, kube: KubeClient, ns: str, n: int, interval: float, window: float,
              fake: FakeReplicaMetrics) -> dict:
    log = Path(tempfile.mkdtemp()) / "operator.log"
    op = OperatorProcess(state["kubeconfig"], log, (
        "--namespace", ns, "--status-figures-interval-seconds", f"{interval:g}", "--resync-seconds", "3600")).start()
    try:
        print(f"interval {interval:g}s: operator log {log}", flush=True)
        settled = await settle(kube, ns, n, op, fake)
        await asyncio.sleep(max(interval, 5.0))  # past each service's first write of this operator
        writes0, cpu0, t0 = status_writes(op), cpu(state, op), time.monotonic()
        await asyncio.sleep(window)
        writes1, cpu1, seconds = status_writes(op), cpu(state, op), time.monotonic() - t0
        return {"interval": interval, "settle_seconds": settled, "seconds": seconds,
                "writes_per_second": (writes1 - writes0) / seconds,
                "cpu_percent": {k: 100 * (cpu1[k] - cpu0.get(k, 0.0)) / seconds for k in cpu1}}
    finally:
        op.stop()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100, help="busy InferenceServices (default 100; the issue's: 1000)")
    p.add_argument("--window", type=float, default=60.0, help="seconds measured per arm (default 60)")
    p.add_argument("--intervals", type=float, nargs="+", default=[0.0, 20.0],
                   help="--status-figures-interval-seconds of each arm; the first is the baseline (default 0 20)")
    args = p.parse_args()
    state = await asyncio.to_thread(ensure_cluster)  # `up` runs its own event loop
    kube = client(state)
    nodes = bench_nodes(args.n)
    fake = FakeReplicaMetrics(kv=0.4)
    stop = asyncio.Event()
    mover = asyncio.create_task(move_kv(fake, stop))
    ns = ""
    try:
        for node in nodes:
            if await kube.get_or_none("v1", "Node", node["metadata"]["name"]) is None:
                await kube.create(node)
        ns = await fresh_namespace(kube, "bench-status")
        sem = asyncio.Semaphore(20)

        async def create(i: int) -> None:
            async with sem:
                await kube.create(service(i, ns))
        await asyncio.gather(*(create(i) for i in range(args.n)))
        results = [await arm(state, kube, ns, args.n, interval, args.window, fake) for interval in args.intervals]
    finally:
        stop.set()
        await mover
        await fake.close()
        if ns:
            await kube.delete("v1", "Namespace", ns)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and await kube.list("v1", "Pod", ns):
                await asyncio.sleep(2.0)
        for node in nodes:
            await kube.delete("v1", "Node", node["metadata"]["name"])
        await kube.close()

    print(f"\nN={args.n} busy services (KV usage moving every second), {args.window:.0f} s window per arm\n")
    print("| --status-figures-interval-seconds | status writes/s | per service per minute | kube-apiserver CPU | "
          "etcd CPU | operator CPU |")
    print("|---|---|---|---|---|---|")
    for r in results:
        c = r["cpu_percent"]
        print(f"| {r['interval']:g} | {r['writes_per_second']:.1f} | {60 * r['writes_per_second'] / args.n:.2f} | "
              f"{c.get('kube-apiserver', float('nan')):.0f}% | {c.get('etcd', float('nan')):.0f}% | "
              f"{c['operator']:.0f}% |")
    base = results[0]
    for r in results[1:]:
        ratio = base["writes_per_second"] / r["writes_per_second"] if r["writes_per_second"] else float("inf")
        api_base, api = base["cpu_percent"].get("kube-apiserver"), r["cpu_percent"].get("kube-apiserver")
        print(f"\nstatus writes, interval {base['interval']:g} s : {r['interval']:g} s = {ratio:.1f}x "
              f"(expected about {r['interval'] or 1:g}x: one write a second against one an interval)")
        if api_base and api:
            print(f"kube-apiserver CPU, interval {base['interval']:g} s : {r['interval']:g} s = {api_base / api:.2f}x")
    print("\n(CPU: % of one core over the window; 2 cores = 200%. The operator reads every replica every "
          "second in every arm.)")


if __name__ == "__main__":
    asyncio.run(main())
