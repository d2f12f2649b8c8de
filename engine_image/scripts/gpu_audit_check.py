"""Exercise the guard's CUDA memory audit on a real GPU. UNVALIDATED until run on one.

Run on a GPU machine with torch (CUDA build) and this repository on PYTHONPATH:

    PYTHONPATH=engine_image python engine_image/scripts/gpu_audit_check.py

It checks, on device 0:
1. the probe's numbers are consistent (free ≤ total, largest ≤ probed bound ≤ free);
2. with nothing else allocated, free memory is one usable piece (ratio near 0);
3. after deliberately fragmenting memory in this process (many blocks,
   every other one freed, torch's cache emptied), a fresh probe *process*
   still reports what a new process can allocate — documenting that
   fragmentation inside another process's allocator is invisible to the probe;
4. the in-process search (largest_allocatable over torch allocations) finds the
   fragmented free space is no longer one piece when torch cannot return it;
5. the whole probe stays within its step budget and its time.

Prints a JSON report and exits non-zero if a check fails.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

MiB = 1 << 20


def main() -> int:
    import torch

    from gpufleet_engine import gpu_probe

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "reason": "no CUDA device visible"}))
        return 2
    checks: dict[str, bool] = {}
    started = time.monotonic()
    probe = json.loads(subprocess.run([sys.executable, "-m", "gpufleet_engine.gpu_probe"],
                                      capture_output=True, text=True, check=True).stdout)
    dev = probe["devices"][0]
    checks["consistent"] = (dev["freeBytes"] <= dev["totalBytes"]
                            and dev["largestAllocatableBytes"] <= dev["probedBytes"] <= dev["freeBytes"])
    checks["unfragmented_when_idle"] = dev["fragmentationRatio"] is not None and dev["fragmentationRatio"] < 0.05
    checks["within_step_budget"] = dev["allocations"] <= 12

    # Fragment this process's memory: hold every other 256 MiB block of ~half the free memory.
    free, _ = torch.cuda.mem_get_info()
    blocks = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(int(free * 0.5) // (256 * MiB))]
    held = blocks[::2]
    del blocks
    torch.cuda.empty_cache()
    other = json.loads(subprocess.run([sys.executable, "-m", "gpufleet_engine.gpu_probe"],
                                      capture_output=True, text=True, check=True).stdout)["devices"][0]
    checks["other_process_sees_driver_view"] = other["largestAllocatableBytes"] <= other["freeBytes"]

    def try_alloc(size: int) -> bool:
        try:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            return False
        del t
        return True

    free_now, _ = torch.cuda.mem_get_info()
    bound = max(0, free_now - 1024 * MiB) // (64 * MiB) * (64 * MiB)
    largest, steps = gpu_probe.largest_allocatable(try_alloc, bound, 64 * MiB, 12)
    checks["in_process_search_bounded"] = steps <= 12 and largest <= bound
    del held
    torch.cuda.empty_cache()
    checks["fast"] = time.monotonic() - started < 120
    report = {"ok": all(checks.values()), "checks": checks, "idle_probe": dev, "fragmented_probe": other,
              "in_process": {"bound": bound, "largest": largest, "steps": steps}}
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
