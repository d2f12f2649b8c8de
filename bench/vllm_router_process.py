"""vLLM's own router (PyPI ``vllm-router``) as a process beside a benchmark: started on free loopback ports,
waited for until healthy, stopped. Its Prometheus listener gets a port of its own too (it takes 29000
otherwise, and a second router on the host would fail to start)."""
from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from gpufleet_engine.local.runner import free_port

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent))


class VllmRouterProcess:
    def __init__(self, args: list[str], log: Path):
        if ROUTER is None:
            raise RuntimeError("vllm-router is not installed: pip install -e '.[test]'")
        self.port = free_port("127.0.0.1")
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [ROUTER, *args, "--host", "127.0.0.1", "--port", str(self.port),
                 "--prometheus-port", str(free_port("127.0.0.1")), "--log-level", "warning"],
                stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    async def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vllm-router exited: {self.log.read_text()[-2000:]}")
                try:
                    async with http.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.3)
        raise TimeoutError(f"vllm-router not healthy after {timeout}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
