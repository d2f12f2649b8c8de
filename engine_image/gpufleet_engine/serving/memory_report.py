"""``/audit``: the memory report behind the operator's fragmentation audit.

Two views, each saying plainly when it is unavailable instead of guessing:

- device memory, from inside vLLM: each device's caching-allocator figures
  (reserved, allocated, inactive split, allocation retries, OOMs) as the
  vLLM plugin reports them (``gpu_memory``), and the fragmentation ratio
  (``contract.gpu_memory``);
- the KV pool as vLLM and the guard see it: blocks total/used/free, what the
  guard has promised, and the waste: the share of the blocks in use that hold
  no token of an in-flight request.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable

from gpufleet_engine.admission.kv_ledger import KvLedger
from gpufleet_engine.vllm.stats import VllmStats


@dataclass(frozen=True)
class SequenceLength:
    """Tokens one in-flight sequence holds now, when the guard knows it."""
    tokens: int | None


def partial_block_waste(lengths: Iterable[int], block_size: int) -> int:
    """Token slots allocated but unused in each sequence's last, partly filled block."""
    return sum((-n) % block_size for n in lengths if n > 0)


def kv_waste(stats: VllmStats | None, block_size: int,
             sequences: Iterable[SequenceLength]) -> tuple[float | None, str]:
    """(1 - tokens held by in-flight requests / (blocks in use x block size), why None).

    ``sequences`` should be those in flight when ``stats`` were read. Known
    only when the guard knows every in-flight sequence's length (single
    streaming sequences: prompt + streamed tokens) and vLLM queues nothing
    (a waiting request holds no blocks yet). Prefix-shared blocks count once
    in vLLM's pool and once per sequence here, so sharing can only lower it;
    it is clamped at 0.
    """
    if stats is None:
        return None, "vLLM's metrics have not been read yet"
    used = stats.kv_snapshot().used_blocks
    lengths = [s.tokens for s in sequences]
    unknown = sum(1 for t in lengths if t is None)
    if unknown:
        return None, (f"{unknown} in-flight request(s) of unknown length (non-streaming, or several "
                      f"sequences); the guard counts tokens of single streaming sequences only")
    if used <= 0 or not lengths:
        return None, "no KV block in use"
    if stats.waiting > 0:
        return None, "vLLM has waiting requests, which hold no blocks yet"
    held = sum(t for t in lengths if t is not None)
    return max(0.0, 1.0 - held / (used * block_size)), ""


def kv_report(stats: VllmStats | None, ledger: KvLedger, block_size: int,
              sequences: Iterable[SequenceLength], sequences_at_read: Iterable[SequenceLength] | None = None) -> dict:
    """``sequences``: in flight now; ``sequences_at_read``: when vLLM's metrics were read (the waste
    compares those with vLLM's blocks in use, so the streams' progress since does not skew it)."""
    if stats is None:
        return {"available": False, "reason": "vLLM's metrics have not been read yet (engine down?)"}
    snap = stats.kv_snapshot()
    seqs = list(sequences)
    known = [s.tokens for s in seqs if s.tokens is not None]
    size = stats.block_size or block_size
    waste, why = kv_waste(stats, size, seqs if sequences_at_read is None else list(sequences_at_read))
    return {
        "available": True,
        "blockSize": size,
        "totalBlocks": snap.total_blocks,
        "usedBlocks": snap.used_blocks,
        "freeBlocks": snap.total_blocks - snap.used_blocks,
        "usageRatio": stats.kv_usage_ratio,
        "guardFreeBlocks": ledger.free_blocks(),
        "guardReservedBlocks": ledger.reserved_blocks,
        "watermarkBlocks": ledger.watermark,
        "wasteRatio": waste,
        **({"wasteUnknownBecause": why} if waste is None else {}),
        "partialBlockWasteTokens": partial_block_waste(known, size),
        "partialBlockWasteKnownFor": len(known),
        "inFlightRequests": len(seqs),
        "preemptionsTotal": stats.preemptions_total,
    }


def device_summary(device: dict) -> tuple[dict, list[str]]:
    """The worst device's fragmentation, retries and OOMs summed over devices, and what is missing."""
    devices = device.get("devices") or []
    if not device.get("available") or not devices:
        return {"fragmentationRatio": None, "allocRetries": None, "ooms": None}, \
            [f"device: {device.get('reason', 'unknown')}"]
    ratios = [d["fragmentationRatio"] for d in devices if d.get("fragmentationRatio") is not None]
    return {"fragmentationRatio": max(ratios) if ratios else None,
            "allocRetries": sum(d["allocRetries"] for d in devices),
            "ooms": sum(d["ooms"] for d in devices)}, \
        ([] if ratios else ["device: the allocator has reserved nothing yet"])


def assemble(service: str, namespace: str, device: dict, kv: dict) -> dict:
    summary, unavailable = device_summary(device)
    if not kv.get("available"):
        unavailable.append(f"kv: {kv.get('reason')}")
    return {
        "service": service,
        "namespace": namespace,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        **summary,
        "kvWasteRatio": kv.get("wasteRatio"),
        "device": device,
        "kv": kv,
        "unavailable": unavailable,
    }
