"""Child processes (vLLM, the guard) started and stopped in order.

Each child gets a process group of its own: vLLM forks an engine core and
workers, and stopping only the parent can leave them holding the KV pool.
Stopping sends SIGTERM to the child first (vLLM and the guard both shut down
cleanly on it) and escalates to the whole group only after the grace period.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Mapping, Sequence


class ManagedProcess:
    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 log_path: Path | None = None, cwd: Path | None = None):
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env}
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                     start_new_session=True, cwd=self.cwd)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_seconds: float) -> int | None:
        """SIGTERM, wait up to ``grace_seconds``, then SIGKILL the process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        code = self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def _kill_group(self) -> None:
        # The group id is the child's pid (start_new_session); whatever it
        # forked and left behind goes with it.
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-64 * 1024:].decode(errors="replace")
        return "\n".join(data.splitlines()[-lines:])


def wait_until(predicate, timeout: float, interval: float = 0.5, *,
               abort_if_dead: ManagedProcess | None = None, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if abort_if_dead is not None and not abort_if_dead.running:
            tail = abort_if_dead.log_tail()
            raise RuntimeError(f"{abort_if_dead.name} exited with code {abort_if_dead.poll()} "
                               f"while waiting for {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g}s")
        time.sleep(interval)
