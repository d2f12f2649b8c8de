"""Operator scale: time to reconcile N InferenceServices on simulated nodes,
and the operator's peak RSS. Baseline in the same run: N=10, so the ratio
shows how per-service cost grows with N.

    .venv/bin/python bench/operator_scale.py [--n 100]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import client, ensure_cluster, fresh_namespace, peak_rss_mib  # noqa: E402
from gpufleet_dev.devcluster.operator_process import OperatorProcess  # noqa: E402

API = "serving.gpufleet.dev/v1alpha1"


def service(i: int) -> dict:
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": f"svc-{i:04d}"},
            "spec": {"model": {"name": f"org/model-{i % 50}"}, "isolation": {"mode": "Shared"},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}}


async def reconcile_n(state: dict, n: int) -> dict:
    kube = client(state)
    ns = await fresh_namespace(kube, f"bench-scale-{n}")
    log = Path(tempfile.mkdtemp()) / "operator.log"
    op = OperatorProcess(state["kubeconfig"], log, ("--namespace", ns)).start()
    try:
        start = time.monotonic()
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
        deployments = len(await kube.list("apps/v1", "Deployment", ns))
        rss = peak_rss_mib(op.proc.pid)
        return {"n": n, "seconds": total, "create_seconds": created, "per_service_ms": 1000 * total / n,
                "deployments": deployments, "peak_rss_mib": rss}
    finally:
        op.stop()
        await kube.delete("v1", "Namespace", ns)
        await kube.close()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--baseline-n", type=int, default=10)
    args = p.parse_args()
    state = await asyncio.to_thread(ensure_cluster)  # `up` runs its own event loop
    base = await reconcile_n(state, args.baseline_n)
    big = await reconcile_n(state, args.n)
    print("| N | time to all reconciled | per service | Deployments | operator peak RSS |")
    print("|---|---|---|---|---|")
    for r in (base, big):
        print(f"| {r['n']} | {r['seconds']:.1f} s | {r['per_service_ms']:.0f} ms | {r['deployments']} | "
              f"{r['peak_rss_mib']:.0f} MiB |")
    print(f"\nper-service cost ratio N={args.n} vs N={args.baseline_n}: "
          f"{big['per_service_ms'] / base['per_service_ms']:.2f}x (1.0 = linear scaling)")


if __name__ == "__main__":
    asyncio.run(main())
