"""The guard's view of GPU memory: the reports the vLLM plugin writes from
inside vLLM's processes (``vllm_plugin``; format in ``contract.gpu_memory``),
read from the directory the two containers share, for ``/metrics``
(``gpufleet_engine_gpu_memory_*``, one series per device) and ``/audit``.

The guard itself never touches a GPU: its container requests none and sees
none (``NVIDIA_VISIBLE_DEVICES=void``), so nothing it reports can come from a
neighbour's device.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpufleet_api.guard import gpu_memory as gm
from gpufleet_api.guard import guard_metrics as m


@dataclass(frozen=True)
class GpuMemoryView:
    devices: list[dict] = field(default_factory=list)   # fresh device reports, by device index
    unavailable: str | None = None                       # why there are none, when there are none
    problems: list[str] = field(default_factory=list)    # files skipped, and why

    def as_report(self) -> dict:
        """The ``device`` section of ``/audit``."""
        if not self.devices:
            return {"available": False, "reason": self.unavailable or "no report", "problems": self.problems}
        return {"available": True, "source": "vllm-plugin", "devices": self.devices, "problems": self.problems}


class GpuMemoryReader:
    """Reads the plugin's reports; ``directory`` None: reporting is not set up (say so)."""

    def __init__(self, directory: Path | None, clock: Callable[[], float] = time.time,
                 stale_after: float = gm.STALE_AFTER_SECONDS):
        self.directory = directory
        self.clock = clock
        self.stale_after = stale_after

    @classmethod
    def from_environment(cls) -> "GpuMemoryReader":
        directory = os.environ.get(gm.ENV_DIR)
        return cls(Path(directory) if directory else None)

    def read(self) -> GpuMemoryView:
        if self.directory is None:
            return GpuMemoryView(unavailable=f"GPU memory reporting is off: {gm.ENV_DIR} is not set "
                                             f"in the guard's environment")
        now = self.clock()
        devices: dict[int, dict] = {}
        no_cuda: dict | None = None
        problems: list[str] = []
        try:
            paths = sorted(self.directory.glob("*.json"))
        except OSError as e:
            return GpuMemoryView(unavailable=f"cannot list {self.directory}: {e}")
        for path in paths:
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as e:  # a file replaced while read: the next read gets it
                problems.append(f"{path.name}: {e}")
                continue
            age = now - doc.get("time", 0) if isinstance(doc, dict) and \
                isinstance(doc.get("time"), (int, float)) else None
            if age is None or age > self.stale_after:
                problems.append(f"{path.name}: older than {self.stale_after:g}s (its vLLM process is gone)")
                continue
            if path.name == gm.NO_CUDA_FILE:
                no_cuda = doc
                continue
            try:
                report = gm.parse_device_report(doc)
            except gm.ReportError as e:
                problems.append(f"{path.name}: {e}")
                continue
            devices[report["device"]] = {**report, "ageSeconds": round(age, 3)}
        if devices:
            return GpuMemoryView([devices[i] for i in sorted(devices)], None, problems)
        if no_cuda is not None:
            return GpuMemoryView(unavailable=str(no_cuda.get("reason") or "no CUDA device"), problems=problems)
        return GpuMemoryView(unavailable=f"no fresh report from vLLM's GPU memory plugin in {self.directory} "
                                         f"(vLLM still loading, or the plugin is not installed)",
                             problems=problems)


_GAUGES = (  # metric name, report field, help
    (m.GPU_MEMORY_RESERVED_BYTES, "reservedBytes", "Bytes PyTorch's caching allocator in vLLM holds on the device."),
    (m.GPU_MEMORY_ALLOCATED_BYTES, "allocatedBytes", "Bytes of live tensors in vLLM's process."),
    (m.GPU_MEMORY_ACTIVE_BYTES, "activeBytes", "Bytes in allocator blocks in use (live tensors, and blocks "
                                               "freed but awaiting a stream)."),
    (m.GPU_MEMORY_INACTIVE_SPLIT_BYTES, "inactiveSplitBytes",
     "Reserved bytes in free pieces of partly used segments: usable only by allocations that fit a piece."),
    (m.GPU_MEMORY_FREE_BYTES, "freeBytes", "Device memory free for any process (cudaMemGetInfo)."),
    (m.GPU_MEMORY_TOTAL_BYTES, "totalBytes", "Device memory in total."),
    (m.GPU_MEMORY_FRAGMENTATION_RATIO, "fragmentationRatio",
     "Inactive split bytes / reserved bytes of vLLM's allocator (docs/metrics.md)."),
    (m.GPU_MEMORY_REPORT_AGE_SECONDS, "ageSeconds", "Age of the plugin's last report for the device."),
)
_COUNTERS = (
    (m.GPU_MEMORY_ALLOC_RETRIES, "allocRetries",
     "Times vLLM's allocator failed a cudaMalloc, flushed its cache and retried: memory is being lost."),
    (m.GPU_MEMORY_OOMS, "ooms", "Allocations that failed even after flushing the cache (out of memory)."),
)


class GpuMemoryCollector(Collector):
    """``gpufleet_engine_gpu_memory_*`` at scrape time, one series per device with a fresh report."""

    def __init__(self, reader: GpuMemoryReader):
        self.reader = reader

    def describe(self) -> Iterator:
        return self._families([])

    def collect(self) -> Iterator:
        return self._families(self.reader.read().devices)

    @staticmethod
    def _families(devices: list[dict]) -> Iterator:
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["device"])
            for d in devices:
                if d.get(key) is not None:
                    g.add_metric([str(d["device"])], float(d[key]))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["device"])
            for d in devices:
                c.add_metric([str(d["device"])], float(d[key]))
            yield c
