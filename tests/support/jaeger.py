"""A Jaeger of its own for a test: the cached v1.75.0 binary (binaries.JAEGER) on free ports,
stopped by its pid after. Tests that use it skip where the binary is not built."""
from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from gpufleet_dev.devcluster import binaries, traces
from gpufleet_kit.ports import unused_port

# Jaeger starts in well under a second here; a loaded CI machine gets far longer.
START_SECONDS = 60


def built() -> bool:
    return binaries.JAEGER.is_cached()


@contextlib.contextmanager
def running_jaeger() -> Iterator[traces.JaegerPorts]:
    if not built():
        pytest.skip(f"Jaeger {binaries.JAEGER_VERSION} is not built (scripts/setup.sh builds it)")
    ports = traces.JaegerPorts(*(unused_port() for _ in range(5)))
    with tempfile.TemporaryDirectory() as tmp:
        path = traces.write_config(Path(tmp) / "jaeger.yaml", ports)
        log = (Path(tmp) / "jaeger.log").open("w")
        proc = subprocess.Popen(traces.argv(binaries.JAEGER.binary("jaeger"), path), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + START_SECONDS
            while not traces.ready(ports):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise AssertionError(f"Jaeger did not start: {(Path(tmp) / 'jaeger.log').read_text()[-2000:]}")
                time.sleep(0.1)  # polling a port until it answers; nothing to wait on instead
            yield ports
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
