"""Test access to the local control plane: kubectl and a KubeClient."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from typing import Callable, Iterator

from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig


@dataclasses.dataclass(frozen=True)
class ControlPlane:
    kubeconfig: str
    server: str

    def env(self) -> dict:
        return {**os.environ, "KUBECONFIG": self.kubeconfig}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True,
                              env=self.env(), timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Until the CRD named ``crd`` is Established. ``kubectl wait`` fails at once, instead of
        waiting, while an updated CRD has no status conditions yet."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.kubectl("get", f"crd/{crd}", "-o",
                                'jsonpath={.status.conditions[?(@.type=="Established")].status}', check=False)
            if proc.returncode == 0 and proc.stdout.strip() == "True":
                return
            if time.monotonic() >= deadline:
                raise AssertionError(f"CRD {crd} not Established after {timeout:g}s: {proc.stdout}{proc.stderr}")
            time.sleep(0.2)

    def client(self) -> KubeClient:
        return KubeClient(KubeConfig.from_file(self.kubeconfig))


def session_control_plane(fits: Callable[[dict], bool], real_node: bool = False) -> Iterator[ControlPlane]:
    """A pytest session's control plane: the running one when it is healthy and ``fits`` its
    state; otherwise (a crashed leftover, or one of the wrong shape) stopped and started anew.
    What this session started it stops, unless GPUFLEET_KEEP_CLUSTER=1."""
    from gpufleet_dev.devcluster import cluster

    state = cluster.read_state()
    healthy, _ = cluster.status_report()
    started = False
    if not (healthy and state and fits(state)):
        if state:
            cluster.down(progress=lambda _m: None)
        cluster.up(cluster.FleetSpec(engine_nodes=2, real_node=real_node),
                   progress=lambda m: print(f"[control plane] {m}", flush=True))
        started = True
    state = cluster.read_state()
    yield ControlPlane(kubeconfig=state["kubeconfig"], server=state["server"])
    if started and os.environ.get("GPUFLEET_KEEP_CLUSTER") != "1":
        cluster.down(progress=lambda _m: None)
