"""GPU memory as vLLM's own processes see it: the report format between the
vLLM plugin (``gpufleet_engine.vllm_plugin``, which writes it) and the guard
(``gpufleet_engine.gpu_memory``, which reads it and exports
``gpufleet_engine_gpu_memory_*``), and the one definition of fragmentation.

The plugin runs inside every vLLM process (engine core, workers). A process
that owns a CUDA device writes ``gpu-<index>.json`` into a directory shared
with the guard (an emptyDir in the pod, ``MOUNT_PATH``) every
``SAMPLE_SECONDS``; a process on a machine without CUDA writes ``no-cuda.json``
saying why. Files are replaced atomically, and a file older than
``STALE_AFTER_SECONDS`` is ignored (its writer is gone: vLLM restarted or
died). Nothing here does I/O.

Fragmentation, precisely: ``inactive_split_bytes / reserved_bytes`` of
PyTorch's caching allocator in the process that owns the device. Inactive
split bytes are memory the allocator has reserved from the device, holds no
tensor, and is a piece of a larger segment that is partly in use: only an
allocation that fits the piece can use it, and the allocator cannot return it
to the device. ``num_alloc_retries`` counts the times a cudaMalloc failed, the
allocator flushed its cache and retried: the symptom that the process is
losing usable memory; ``num_ooms`` the times even that failed.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import ContractError

ENV_DIR = "GPUFLEET_GPU_MEMORY_DIR"   # where the plugin writes and the guard reads; unset: the plugin is off
VOLUME = "gpu-memory"                  # the pod's emptyDir shared by the vllm and guard containers
MOUNT_PATH = "/run/gpufleet/gpu-memory"
# vLLM's containers get spec.engine.cudaAllocatorConfig here; its default,
# expandable_segments:True, is PyTorch's own remedy for caching-allocator
# fragmentation (segments grow in place instead of being split).
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"

SAMPLE_SECONDS = 5.0
STALE_AFTER_SECONDS = 30.0
NO_CUDA_FILE = "no-cuda.json"
DEVICE_FILE_PREFIX = "gpu-"

# torch.cuda.memory_stats() keys → the report's fields (bytes and counts of
# the whole allocator: both pools, large and small).
STATS_KEYS = {
    "reservedBytes": "reserved_bytes.all.current",
    "allocatedBytes": "allocated_bytes.all.current",
    "activeBytes": "active_bytes.all.current",
    "inactiveSplitBytes": "inactive_split_bytes.all.current",
    "allocRetries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def device_file(index: int) -> str:
    return f"{DEVICE_FILE_PREFIX}{index}.json"


def fragmentation_ratio(inactive_split_bytes: int, reserved_bytes: int) -> float | None:
    """Share of the allocator's reserved memory stuck in inactive split blocks; None when nothing is reserved."""
    if reserved_bytes <= 0:
        return None
    return max(0.0, min(1.0, inactive_split_bytes / reserved_bytes))


def owns_device(stats: Mapping[str, Any]) -> bool:
    """The process has allocated on the device (a CUDA context alone, or another process's device, is not owning)."""
    return int(stats.get("reserved_bytes.all.peak", 0) or 0) > 0


def device_report(index: int, stats: Mapping[str, Any], free_bytes: int, total_bytes: int, *,
                  pid: int, time: float, name: str = "", uuid: str = "") -> dict:
    """One device's report from a ``torch.cuda.memory_stats()`` dictionary and ``mem_get_info()``."""
    fields = {key: int(stats.get(stat, 0) or 0) for key, stat in STATS_KEYS.items()}
    return {
        "device": index, "name": name, "uuid": uuid, "pid": pid, "time": time,
        **fields,
        "freeBytes": int(free_bytes), "totalBytes": int(total_bytes),
        "fragmentationRatio": fragmentation_ratio(fields["inactiveSplitBytes"], fields["reservedBytes"]),
    }


def no_cuda_report(reason: str, *, pid: int, time: float) -> dict:
    return {"cuda": False, "reason": reason, "pid": pid, "time": time}


class ReportError(ContractError):
    """A report file is not what the plugin writes."""


def parse_device_report(doc: Any) -> dict:
    """Check a device report's shape; ReportError names what is wrong."""
    if not isinstance(doc, dict):
        raise ReportError("not a JSON object")
    missing = [k for k in ("device", "time", "freeBytes", "totalBytes", *STATS_KEYS) if k not in doc]
    if missing:
        raise ReportError(f"missing {', '.join(missing)}")
    bad = [k for k in ("device", "freeBytes", "totalBytes", *STATS_KEYS)
           if not isinstance(doc[k], int) or isinstance(doc[k], bool) or doc[k] < 0]
    if bad or not isinstance(doc["time"], (int, float)):
        raise ReportError(f"not non-negative integers: {', '.join(bad) or 'time'}")
    return {**doc, "fragmentationRatio": fragmentation_ratio(doc["inactiveSplitBytes"], doc["reservedBytes"])}
