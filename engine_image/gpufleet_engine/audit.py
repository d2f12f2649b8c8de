"""``/audit``: the memory report behind the operator's fragmentation audit.

Two views, each saying plainly when it is unavailable instead of guessing:

- device memory (CUDA): total, free, the largest block allocatable now and
  the fragmentation ratio, measured by ``gpu_probe`` in a child process;
- the KV pool as vLLM and the guard see it: blocks total/used/free, what the
  guard has promised, and the tokens wasted in partly filled last blocks of
  the guard's in-flight streaming requests (the only ones whose current
  length the guard knows).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable

from .admission import KvLedger
from .vllm_metrics import VllmStats

PROBE_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class SequenceLength:
    """Tokens one in-flight sequence holds now, when the guard knows it."""
    tokens: int | None


def partial_block_waste(lengths: Iterable[int], block_size: int) -> int:
    """Token slots allocated but unused in each sequence's last, partly filled block."""
    return sum((-n) % block_size for n in lengths if n > 0)


def kv_report(stats: VllmStats | None, ledger: KvLedger, block_size: int,
              sequences: Iterable[SequenceLength]) -> dict:
    if stats is None:
        return {"available": False, "reason": "vLLM's metrics have not been read yet (engine down?)"}
    snap = stats.kv_snapshot()
    seqs = list(sequences)
    known = [s.tokens for s in seqs if s.tokens is not None]
    return {
        "available": True,
        "blockSize": stats.block_size or block_size,
        "totalBlocks": snap.total_blocks,
        "usedBlocks": snap.used_blocks,
        "freeBlocks": snap.total_blocks - snap.used_blocks,
        "usageRatio": stats.kv_usage_ratio,
        "guardFreeBlocks": ledger.free_blocks(),
        "guardReservedBlocks": ledger.reserved_blocks,
        "watermarkBlocks": ledger.watermark,
        "partialBlockWasteTokens": partial_block_waste(known, stats.block_size or block_size),
        "partialBlockWasteKnownFor": len(known),
        "inFlightRequests": len(seqs),
        "preemptionsTotal": stats.preemptions_total,
    }


def device_summary(probe: dict) -> tuple[float | None, list[str]]:
    """Worst device's fragmentation ratio and the reasons for anything missing."""
    if not probe.get("available"):
        return None, [f"device: {probe.get('reason', 'unknown')}"]
    ratios = [d["fragmentationRatio"] for d in probe.get("devices", []) if d.get("fragmentationRatio") is not None]
    missing = [] if ratios else ["device: no free device memory to probe"]
    return (max(ratios) if ratios else None), missing


def assemble(service: str, namespace: str, probe: dict, kv: dict) -> dict:
    ratio, unavailable = device_summary(probe)
    if not kv.get("available"):
        unavailable.append(f"kv: {kv.get('reason')}")
    return {
        "service": service,
        "namespace": namespace,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "fragmentationRatio": ratio,
        "device": probe,
        "kv": kv,
        "unavailable": unavailable,
    }


class DeviceProber:
    """Runs ``gpu_probe`` in a child process, one at a time, reusing a recent result.

    The cache stops a tight scrape loop from allocating device memory over
    and over next to a serving engine.
    """

    def __init__(self, min_interval_seconds: float = 10.0, python: str = sys.executable):
        self._min_interval = min_interval_seconds
        self._python = python
        self._lock = asyncio.Lock()
        self._last: tuple[float, dict] | None = None

    async def read(self) -> dict:
        async with self._lock:
            now = time.monotonic()
            if self._last and now - self._last[0] < self._min_interval:
                return self._last[1]
            result = await self._run()
            self._last = (time.monotonic(), result)
            return result

    async def _run(self) -> dict:
        proc = await asyncio.create_subprocess_exec(
            self._python, "-m", "gpufleet_engine.gpu_probe",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_SECONDS)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return {"available": False, "reason": f"the device probe took longer than {PROBE_TIMEOUT_SECONDS:g}s"}
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            return {"available": False, "reason": f"the device probe failed: {tail[0]}"}
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            return {"available": False, "reason": "the device probe printed no JSON"}
