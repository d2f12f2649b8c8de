"""Operator scale: time to reconcile N InferenceServices on simulated nodes,
and the operator's peak RSS. Baseline in the same run: N=10, so the ratio
shows how per-service cost grows with N.

Where the time went: the CPU seconds of the operator and of the control
plane's processes over the run (on 2 cores they share the machine), and the
operator's API requests per service by verb and resource (its own counter,
gpufleet_operator_api_requests_total), and its reconciles with their mean
duration (gpufleet_reconcile_duration_seconds): long ones wait on the API
server, short ones in a slow run wait on the queue. The operator's own share
without a cluster: bench/operator_inprocess.py.

    .venv/bin/python bench/operator_scale.py [--n 100]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import client, ensure_cluster, fresh_namespace, peak_rss_mib  # noqa: E402
from _services import API, service  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpufleet.reconcile.desired import desired_children  # noqa: E402
from gpufleet.reconcile.replicas import desired_replicas  # noqa: E402
from gpufleet_api import parse_spec  # noqa: E402
from gpufleet_dev.devcluster.operator_process import OperatorProcess  # noqa: E402

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its reaped children so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICK


def cpu_now(state: dict, operator_pid: int | None) -> dict[str, float]:
    out = {} if operator_pid is None else {"operator": cpu_seconds(operator_pid)}
    for name, proc in state.get("processes", {}).items():
        if name in CONTROL_PLANE:
            try:
                out[name] = cpu_seconds(proc["pid"])
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def apiserver_figures(state: dict) -> dict[str, collections.Counter]:
    """The API server's own counters, all clients together: requests and the sum of their latencies by
    verb and resource (apiserver_request_total, apiserver_request_duration_seconds)."""
    env = {**os.environ, "KUBECONFIG": state["kubeconfig"]}
    return parse_apiserver(subprocess.run(["kubectl", "get", "--raw", "/metrics"], env=env, check=True,
                                          capture_output=True, text=True).stdout)


def parse_apiserver(text: str) -> dict[str, collections.Counter]:
    count: collections.Counter = collections.Counter()
    seconds: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        if family.name not in ("apiserver_request", "apiserver_request_duration_seconds"):
            continue
        for sample in family.samples:
            labels = sample.labels
            key = f"{labels.get('verb', '?')} {labels.get('resource', '?')}" + (
                f"/{labels['subresource']}" if labels.get("subresource") else "")
            if sample.name == "apiserver_request_total":
                count[key] += sample.value
            elif sample.name == "apiserver_request_duration_seconds_sum" and labels.get("verb") != "WATCH":
                seconds[key] += sample.value
    return {"count": count, "seconds": seconds}


def api_requests(text: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for family in text_string_to_metric_families(text):
        if family.name == "gpufleet_operator_api_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[f"{sample.labels['verb']} {sample.labels['resource']}"] += int(sample.value)
    return counts


def reconciles(text: str) -> tuple[int, float]:
    """How many reconciles the operator ran and their mean duration in seconds (its histogram): a long
    one waits on the API server, a short one with a slow run waits on the queue."""
    count, total = 0, 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "gpufleet_reconcile_duration_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count += int(sample.value)
                elif sample.name.endswith("_sum"):
                    total += sample.value
    return count, total / count if count else 0.0


async def reconcile_n(state: dict, n: int) -> dict:
    kube = client(state)
    ns = await fresh_namespace(kube, f"bench-scale-{n}")
    log = Path(tempfile.mkdtemp()) / "operator.log"
    op = OperatorProcess(state["kubeconfig"], log, ("--namespace", ns)).start()
    try:
        start = time.monotonic()
        cpu_before = cpu_now(state, op.proc.pid)
        api_before = await asyncio.to_thread(apiserver_figures, state)
        sem = asyncio.Semaphore(20)

        async def create(i):
            async with sem:
                obj = service(i)
                obj["metadata"]["namespace"] = ns
                await kube.create(obj)
        await asyncio.gather(*(create(i) for i in range(n)))
        created = time.monotonic() - start
        while True:
            items = await kube.list(API, "InferenceService", ns)
            done = sum(1 for o in items if (o.get("status") or {}).get("observedGeneration") == 1
                       and any(c["type"] == "Ready" for c in o["status"].get("conditions", [])))
            if done == n:
                break
            if time.monotonic() - start > 600:
                raise SystemExit(f"only {done}/{n} reconciled after 600s; operator log {log}")
            await asyncio.sleep(0.5)
        total = time.monotonic() - start
        cpu_after = cpu_now(state, op.proc.pid)
        api_after = await asyncio.to_thread(apiserver_figures, state)
        apiserver = {k: api_after[k] - api_before[k] for k in api_after}
        text = op.metrics_text()
        requests, (count, mean) = api_requests(text), reconciles(text)
        deployments = len(await kube.list("apps/v1", "Deployment", ns))
        rss = peak_rss_mib(op.proc.pid)
        return {"n": n, "seconds": total, "create_seconds": created, "per_service_ms": 1000 * total / n,
                "deployments": deployments, "peak_rss_mib": rss,
                "cpu": {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}, "requests": requests,
                "reconciles": count, "reconcile_mean_s": mean, "apiserver": apiserver}
    finally:
        op.stop()
        await delete_namespace(kube, ns)
        await kube.close()


async def delete_namespace(kube, ns: str, timeout: float = 900) -> None:
    """Delete ``ns`` and wait until it is gone: the cluster removing 1000 services' objects would
    otherwise take the CPU from the next measurement."""
    await kube.delete("v1", "Namespace", ns)
    deadline = time.monotonic() + timeout
    while await kube.get_or_none("v1", "Namespace", ns) is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"namespace {ns} still there {timeout:.0f}s after its deletion")
        await asyncio.sleep(1.0)


FLOOR_CONCURRENCY = 16  # the operator's reconciles at once (runtime.TRIGGERED_CONCURRENCY)


async def floor_n(state: dict, n: int) -> dict:
    """The cluster's floor for the same work: each service created, its children as the operator renders
    them applied and its status written, by a bare client, FLOOR_CONCURRENCY services at a time, with
    nothing read and nothing decided. The cluster's controllers react as they do to the operator's writes
    (ReplicaSets, pods, scheduling, endpoints), so this is the least any operator could take here."""
    kube = client(state)
    ns = await fresh_namespace(kube, f"bench-floor-{n}")
    try:
        start = time.monotonic()
        cpu_before = cpu_now(state, None)
        api_before = await asyncio.to_thread(apiserver_figures, state)
        sem = asyncio.Semaphore(FLOOR_CONCURRENCY)

        async def one(i: int) -> None:
            async with sem:
                obj = service(i)
                obj["metadata"]["namespace"] = ns
                isvc = await kube.create(obj)
                spec = parse_spec(isvc["spec"])
                for child in desired_children(isvc, spec, desired_replicas(spec, {}), with_podmonitor=False):
                    await kube.apply(child)
                await kube.merge_patch(API, "InferenceService", isvc["metadata"]["name"], {"status": {
                    "observedGeneration": 1, "conditions": [{
                        "type": "Ready", "status": "False", "reason": "Floor", "message": "bench floor",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}]}}, ns,
                    subresource="status")
        await asyncio.gather(*(one(i) for i in range(n)))
        total = time.monotonic() - start
        cpu_after = cpu_now(state, None)
        api_after = await asyncio.to_thread(apiserver_figures, state)
        return {"n": n, "seconds": total, "cpu": {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after},
                "apiserver": {k: api_after[k] - api_before[k] for k in api_after}}
    finally:
        await delete_namespace(kube, ns)
        await kube.close()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--baseline-n", type=int, default=10)
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the cluster's floor (the same writes by a bare client, no operator)")
    args = p.parse_args()
    state = await asyncio.to_thread(ensure_cluster)  # `up` runs its own event loop
    base = await reconcile_n(state, args.baseline_n)
    big = await reconcile_n(state, args.n)
    floor = await floor_n(state, args.n) if args.floor else None
    print("| N | time to all reconciled | per service | Deployments | operator peak RSS |")
    print("|---|---|---|---|---|")
    for r in (base, big):
        print(f"| {r['n']} | {r['seconds']:.1f} s | {r['per_service_ms']:.0f} ms | {r['deployments']} | "
              f"{r['peak_rss_mib']:.0f} MiB |")
    print(f"\nper-service cost ratio N={args.n} vs N={args.baseline_n}: "
          f"{big['per_service_ms'] / base['per_service_ms']:.2f}x (1.0 = linear scaling)")
    if floor is not None:
        served = sum(floor["apiserver"]["count"].values())
        print(f"\nthe cluster's floor at N={args.n} (the same writes by a bare client, {FLOOR_CONCURRENCY} services "
              f"at a time, no operator): {floor['seconds']:.1f} s; the operator takes "
              f"{big['seconds'] / floor['seconds']:.2f}x that. CPU seconds: " +
              ", ".join(f"{k} {v:.1f}" for k, v in sorted(floor["cpu"].items(), key=lambda kv: -kv[1])) +
              f"; the API server answered {served / args.n:.1f} requests a service")
    for r in (base, big):
        print(f"\nN={r['n']}: CPU seconds over the run ({r['seconds']:.1f} s wall, 2 cores = "
              f"{2 * r['seconds']:.0f} CPU s): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                       sorted(r["cpu"].items(), key=lambda kv: -kv[1])))
        total = sum(r["requests"].values())
        print(f"N={r['n']}: the operator's API requests: {total} ({total / r['n']:.1f} per service): " +
              ", ".join(f"{k} {v / r['n']:.2f}" for k, v in r["requests"].most_common()))
        api = r["apiserver"]
        served = sum(api["count"].values())
        print(f"N={r['n']}: the API server answered {served:.0f} requests from all clients ({served / r['n']:.1f} per "
              f"service; the operator's share {total / max(served, 1):.0%}): " +
              ", ".join(f"{k} {v / r['n']:.2f}" for k, v in api["count"].most_common(12)))
        print(f"N={r['n']}: the API server's request seconds (latency summed, not CPU; WATCH left out) "
              f"{sum(api['seconds'].values()):.1f}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in api["seconds"].most_common(10)))
        print(f"N={r['n']}: {r['reconciles']} reconciles ({r['reconciles'] / r['n']:.1f} per service), "
              f"{1000 * r['reconcile_mean_s']:.0f} ms each on average")


if __name__ == "__main__":
    asyncio.run(main())
