"""How many CPU threads vLLM-CPU may run in its container, and on which cores.

vLLM-CPU's OpenMP threads default to every core of the machine and spin between
parallel regions. In a pod that shares a node with others (no exclusive cpuset:
the kubelet's default CPU manager policy), two engines each running one thread
per node core oversubscribe it, and every parallel region then waits for a
descheduled thread: measured on a 2-core node, a second engine beside a busy
first one took 7-8 minutes to start instead of under one.

The budget, in order:
1. a CPU limit (the container cgroup's CFS quota, v2 ``cpu.max`` or v1
   ``cpu.cfs_quota_us``): its cores, rounded up;
2. else the container's CPU request (``GPUFLEET_CPU_REQUEST``, set by the
   operator from the Downward API ``requests.cpu`` with divisor 1, i.e. already
   rounded up to whole cores);
3. else every core the process may run on.
never more than the cores the process may run on. When the budget covers every
allowed core (an exclusive cpuset, or a whole machine) threads are bound to those
cores, as vLLM does by default; when it is smaller, threads are not bound
(``nobind``) and the kernel spreads the node's engines over its cores.

Pure logic is ``plan``; ``read`` collects its inputs from the container.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from gpufleet_api.guard.engine_flags import CPU_REQUEST_ENV as REQUEST_ENV

CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    threads: int
    bind: str  # VLLM_CPU_OMP_THREADS_BIND: a core list ("0-3") or "nobind"
    source: str  # "limit", "request" or "cores": which input decided


def _core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the syntax vLLM parses)."""
    parts: list[str] = []
    start: int | None = None
    prev = -1
    for c in sorted(cores):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = c
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def quota_cores(cpu_max: str | None = None, cfs_quota_us: str | None = None,
                cfs_period_us: str | None = None) -> float | None:
    """The CPU limit in cores from cgroup v2 ``cpu.max`` ("50000 100000" or "max 100000")
    or v1 quota and period; None when unlimited or unknown."""
    try:
        if cpu_max is not None:
            quota, _, period = cpu_max.strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or "100000")
        if cfs_quota_us is not None:
            quota_us = int(cfs_quota_us.strip())
            if quota_us <= 0:
                return None
            return quota_us / int((cfs_period_us or "100000").strip())
    except ValueError:
        return None
    return None


def plan(allowed: list[int], limit_cores: float | None, request: str | None) -> CpuBudget:
    """The budget from the allowed cores, the CPU limit in cores and the request env value. Pure."""
    allowed = sorted(allowed) or [0]
    if limit_cores is not None and limit_cores > 0:
        threads, source = math.ceil(limit_cores - 1e-9), "limit"
    elif request and request.strip().isdigit() and int(request) > 0:
        threads, source = int(request), "request"
    else:
        threads, source = len(allowed), "cores"
    threads = max(1, min(threads, len(allowed)))
    bind = _core_list(allowed) if threads == len(allowed) else "nobind"
    return CpuBudget(threads, bind, source)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read(cgroup: Path = CGROUP) -> CpuBudget:
    """The budget of this process's container."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 1))
    limit = quota_cores(cpu_max=_read(cgroup / "cpu.max"))
    if limit is None:
        for v1 in (cgroup / "cpu", cgroup / "cpu,cpuacct"):
            limit = quota_cores(cfs_quota_us=_read(v1 / "cpu.cfs_quota_us"),
                                cfs_period_us=_read(v1 / "cpu.cfs_period_us"))
            if limit is not None:
                break
    return plan(allowed, limit, os.environ.get(REQUEST_ENV))
