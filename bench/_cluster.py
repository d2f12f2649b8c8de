"""Shared set-up for the operator benchmarks: the local control plane, the CRD,
a fresh namespace, and an operator process."""
from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from gpufleet_dev.devcluster import cluster
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig

ROOT = Path(__file__).resolve().parents[1]


def ensure_cluster() -> dict:
    healthy, _ = cluster.status_report()
    if not healthy:
        if cluster.read_state():
            cluster.down(progress=lambda _m: None)
        cluster.up(cluster.FleetSpec(engine_nodes=2), progress=lambda m: print(f"[cluster] {m}", flush=True))
    state = cluster.read_state()
    subprocess.run(["kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds")],
                   env={**os.environ, "KUBECONFIG": state["kubeconfig"]}, check=True,
                   capture_output=True)
    return state


async def fresh_namespace(kube: KubeClient, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def client(state: dict) -> KubeClient:
    return KubeClient(KubeConfig.from_file(state["kubeconfig"]))


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
