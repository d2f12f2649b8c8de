"""Test access to the local control plane: kubectl and a KubeClient."""
from __future__ import annotations

import dataclasses
import os
import subprocess

from gpufleet.kube.client import KubeClient
from gpufleet.kube.config import KubeConfig


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

    def client(self) -> KubeClient:
        return KubeClient(KubeConfig.from_file(self.kubeconfig))
