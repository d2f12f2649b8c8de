"""Autoscaler decision latency: from the instant a replica's KV usage crosses
the high watermark to the Deployment's new replica count.

Replicas run on the simulated GPU nodes; each pod IP (loopback) answers the
vLLM and guard /metrics endpoints from a small server whose KV usage the
benchmark steps at a known instant (real vLLM cannot be made to cross a
watermark at an exact moment; tests/e2e drives the real engines). The
operator, API server and controllers are the real ones.

Baseline in the same run: the same operator polling every 15 s, HPA's default
sync period (KEDA polls every 30 s by default).

    .venv/bin/python bench/autoscaler_latency.py [--trials 5]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import client, ensure_cluster, fresh_namespace  # noqa: E402

from gpufleet_dev.devcluster.operator_process import OperatorProcess  # noqa: E402
from gpufleet_dev.fake_replicas import FakeReplicaMetrics  # noqa: E402

API = "serving.gpufleet.dev/v1alpha1"


async def measure(state: dict, interval: float, trials: int) -> list[float]:
    kube = client(state)
    ns = await fresh_namespace(kube, "bench-autoscale")
    fake = FakeReplicaMetrics()
    op = OperatorProcess(state["kubeconfig"], Path(tempfile.mkdtemp()) / "operator.log",
                         ("--namespace", ns, "--fleet-interval-seconds", str(interval))).start()
    latencies = []
    try:
        await kube.create({"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "svc", "namespace": ns},
                           "spec": {"model": {"name": "org/m"}, "isolation": {"mode": "Shared"},
                                    "autoscaling": {"minReplicas": 1, "maxReplicas": trials + 1,
                                                    "scaleDownStabilizationSeconds": 3600, "maxScaleUpStep": 1}}})

        async def replicas() -> tuple[int, int]:
            d = await kube.get_or_none("apps/v1", "Deployment", "svc-engine", ns)
            if not d:
                return 0, 0
            return d["spec"]["replicas"], d.get("status", {}).get("readyReplicas", 0)

        async def serve_all() -> None:
            for p in await kube.list("v1", "Pod", ns, label_selector="gpufleet.dev/service=svc"):
                if p["status"].get("podIP"):
                    await fake.serve(p["status"]["podIP"])

        for trial in range(trials):
            fake.kv = 0.5  # between the watermarks: no decision
            want = trial + 1
            while (await replicas()) != (want, want):
                await asyncio.sleep(0.1)
            await serve_all()
            await asyncio.sleep(max(2.0, interval * 1.5))  # the operator has seen calm, ready replicas
            fake.kv = 0.95
            breach = time.monotonic()
            while (await replicas())[0] == want:
                await asyncio.sleep(0.02)
            latencies.append(time.monotonic() - breach)
            print(f"  interval {interval:>4}s trial {trial + 1}: {latencies[-1]:.2f}s", flush=True)
    finally:
        op.stop()
        await fake.close()
        await kube.delete("v1", "Namespace", ns)
        await kube.close()
    return latencies


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--baseline-trials", type=int, default=3)
    args = p.parse_args()
    state = await asyncio.to_thread(ensure_cluster)  # `up` runs its own event loop
    ours = await measure(state, 1.0, args.trials)
    base = await measure(state, 15.0, args.baseline_trials)
    print("\n| loop | breach → Deployment replicas, median | max |")
    print("|---|---|---|")
    print(f"| gpufleet (reads replicas every 1 s) | {statistics.median(ours):.2f} s | {max(ours):.2f} s |")
    print(f"| same loop at HPA's 15 s sync period | {statistics.median(base):.2f} s | {max(base):.2f} s |")
    print(f"\nspeed-up vs the 15 s baseline (median): {statistics.median(base) / statistics.median(ours):.1f}x; "
          f"target: at most 2 s — {'met' if max(ours) <= 2.0 else 'NOT met'}")


if __name__ == "__main__":
    asyncio.run(main())
