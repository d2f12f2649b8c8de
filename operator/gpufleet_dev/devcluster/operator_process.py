"""Run the real operator (`gpufleet run`) as a subprocess: tests, benchmarks and the demo."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from . import guard_token
from .cluster import free_port


class OperatorProcess:
    def __init__(self, kubeconfig: str, log_path: Path, extra_args: tuple[str, ...] = (),
                 metrics_port: int | None = None, guard_token_file: Path | None = None):
        """``guard_token_file``: the operator's token for the guards' control routes; None: one minted
        with ``kubeconfig`` for a ServiceAccount of its own (``guard_token.mint``)."""
        self.kubeconfig = kubeconfig
        self.guard_token_file = guard_token_file
        self.log_path = log_path
        self.metrics_port = metrics_port or free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 30) -> "OperatorProcess":
        if self.guard_token_file is None:
            self.guard_token_file = guard_token.mint(self.kubeconfig, self.log_path.with_name("guard-token"))
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.cli", "run", "--kubeconfig", self.kubeconfig,
             "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
             "--guard-token-file", str(self.guard_token_file), *self.extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                httpx.get(self.metrics_url, timeout=1, trust_env=False).raise_for_status()
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"operator metrics endpoint did not come up; log:\n{self.log_tail()}")

    def metrics_text(self) -> str:
        resp = httpx.get(self.metrics_url, timeout=5, trust_env=False)
        resp.raise_for_status()
        return resp.text

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig_kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if sig_kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
