"""Measure each visible CUDA device: total, free, and the largest block allocatable now.

Runs as its own short-lived process (``python -m gpufleet_engine.gpu_probe``)
so that the CUDA context it needs (hundreds of MB of device memory) is gone
when it exits, and so the guard never imports torch. Prints one JSON object.

The probe is bounded so it cannot starve vLLM: it never asks for more than
free memory minus a reserve (10% of free, at least 512 MiB), frees every
block at once, and takes at most ``max_steps`` allocations per device. When
the bound itself can be allocated the largest block is reported as that
bound (``reachedBound``): a lower limit, and the fragmentation ratio is then
measured against the bound, not against all free memory.

What it cannot see: fragmentation inside vLLM's own PyTorch caching
allocator, which lives in vLLM's process. Paged KV blocks keep that small;
the guard's ``/audit`` reports the KV pool's own waste separately.

UNVALIDATED on real GPUs in this repository's CI (no GPU there); run
``engine_image/scripts/gpu_audit_check.py`` on a GPU node to check it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

MiB = 1 << 20


def reserve_bytes(free: int, reserve_fraction: float, reserve_min_bytes: int) -> int:
    return max(reserve_min_bytes, int(free * reserve_fraction))


def largest_allocatable(try_alloc, bound: int, granularity: int, max_steps: int) -> tuple[int, int]:
    """(largest size in [0, bound] that ``try_alloc`` accepts, allocations tried).

    Binary search on multiples of ``granularity``. Pure given ``try_alloc``,
    so it is unit-tested with a fake allocator.
    """
    steps = 0
    if bound <= 0:
        return 0, steps
    steps += 1
    if try_alloc(bound):
        return bound, steps  # the usual case: free memory is one usable piece
    # In granules: lo is known to fit (0 trivially), hi is known not to
    # (ceil(bound / granularity) granules cover at least the failed bound).
    lo, hi = 0, -(-bound // granularity)
    while hi - lo > 1 and steps < max_steps:
        mid = (lo + hi) // 2
        steps += 1
        if try_alloc(mid * granularity):
            lo = mid
        else:
            hi = mid
    return lo * granularity, steps


def fragmentation_ratio(largest: int, free: int) -> float | None:
    """1 − largest allocatable block / free memory; None when nothing is free."""
    if free <= 0:
        return None
    return max(0.0, min(1.0, 1.0 - largest / free))


def probe(reserve_fraction: float = 0.10, reserve_min_bytes: int = 512 * MiB,
          granularity: int = 64 * MiB, max_steps: int = 12) -> dict:
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch is not installed in the engine image"}
    if not torch.cuda.is_available():
        return {"available": False,
                "reason": "no CUDA device: torch.cuda.is_available() is false "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"}
    devices = []
    for index in range(torch.cuda.device_count()):
        devices.append(_probe_device(torch, index, reserve_fraction, reserve_min_bytes, granularity, max_steps))
    return {"available": True, "devices": devices}


def _probe_device(torch, index: int, reserve_fraction: float, reserve_min_bytes: int,
                  granularity: int, max_steps: int) -> dict:
    device = torch.device("cuda", index)
    start = time.monotonic()
    free, total = torch.cuda.mem_get_info(device)
    reserve = reserve_bytes(free, reserve_fraction, reserve_min_bytes)
    bound = max(0, free - reserve) // granularity * granularity

    def try_alloc(size: int) -> bool:
        try:
            block = torch.empty(size, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            ok = False
        else:
            del block
            ok = True
        # Hand the memory straight back to the driver, not to torch's cache,
        # so vLLM can have it and the next step measures the device afresh.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return ok

    largest, steps = largest_allocatable(try_alloc, bound, granularity, max_steps)
    return {
        "index": index,
        "name": torch.cuda.get_device_name(device),
        "totalBytes": int(total),
        "freeBytes": int(free),
        "reserveBytes": int(reserve),
        "probedBytes": int(bound),
        "largestAllocatableBytes": int(largest),
        "reachedBound": bool(bound > 0 and largest == bound),
        "fragmentationRatio": fragmentation_ratio(largest, bound),
        "allocations": steps,
        "seconds": round(time.monotonic() - start, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reserve-fraction", type=float, default=0.10)
    parser.add_argument("--reserve-min-mib", type=int, default=512)
    parser.add_argument("--granularity-mib", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=12)
    a = parser.parse_args(argv)
    report = probe(a.reserve_fraction, a.reserve_min_mib * MiB, a.granularity_mib * MiB, a.max_steps)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
