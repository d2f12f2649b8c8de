"""The memory audit's arithmetic: probe search, fragmentation ratio, KV waste."""
from __future__ import annotations

from gpufleet_engine.admission import KvLedger
from gpufleet_engine.audit import SequenceLength, assemble, kv_report, partial_block_waste
from gpufleet_engine.gpu_probe import fragmentation_ratio, largest_allocatable, reserve_bytes
from gpufleet_engine.vllm_metrics import VllmStats

MiB = 1 << 20


def allocator(largest: int):
    tried = []

    def try_alloc(size: int) -> bool:
        tried.append(size)
        return size <= largest
    return try_alloc, tried


def test_unfragmented_memory_is_found_in_one_allocation():
    try_alloc, tried = allocator(10_000 * MiB)
    assert largest_allocatable(try_alloc, 4096 * MiB, 64 * MiB, 12) == (4096 * MiB, 1)
    assert tried == [4096 * MiB]


def test_fragmented_memory_is_bisected_to_the_granule():
    try_alloc, tried = allocator(1000 * MiB)
    largest, steps = largest_allocatable(try_alloc, 4096 * MiB, 64 * MiB, 12)
    assert largest == 960 * MiB            # the biggest multiple of 64 MiB that fits
    assert steps == len(tried) <= 12 and max(tried) <= 4096 * MiB


def test_the_probe_never_exceeds_its_step_budget():
    try_alloc, tried = allocator(1 * MiB)
    largest, steps = largest_allocatable(try_alloc, 1 << 40, MiB, 5)
    assert steps == 5 and len(tried) == 5 and largest == 0


def test_nothing_to_probe_means_no_allocation():
    try_alloc, tried = allocator(0)
    assert largest_allocatable(try_alloc, 0, MiB, 12) == (0, 0) and tried == []


def test_reserve_is_a_fraction_of_free_with_a_floor():
    assert reserve_bytes(80_000 * MiB, 0.1, 512 * MiB) == 8_000 * MiB
    assert reserve_bytes(1_000 * MiB, 0.1, 512 * MiB) == 512 * MiB


def test_fragmentation_ratio():
    assert fragmentation_ratio(750, 1000) == 0.25
    assert fragmentation_ratio(1000, 1000) == 0.0
    assert fragmentation_ratio(0, 0) is None


def test_partial_block_waste_counts_empty_slots_of_last_blocks():
    assert partial_block_waste([32, 33, 63, 0], 32) == 0 + 31 + 1


def test_kv_report_and_cpu_report_say_what_is_unavailable():
    ledger = KvLedger(15)
    stats = VllmStats(0.25, 64, 32, 1, 0, 3)
    ledger.observe(stats.kv_snapshot())
    kv = kv_report(stats, ledger, 32, [SequenceLength(40), SequenceLength(None)])
    assert kv["totalBlocks"] == 64 and kv["usedBlocks"] == 16 and kv["freeBlocks"] == 48
    assert kv["partialBlockWasteTokens"] == 24 and kv["partialBlockWasteKnownFor"] == 1
    assert kv["inFlightRequests"] == 2 and kv["watermarkBlocks"] == 10
    report = assemble("svc", "ns", {"available": False, "reason": "no CUDA device"}, kv)
    assert report["fragmentationRatio"] is None
    assert report["unavailable"] == ["device: no CUDA device"]


def test_the_worst_device_sets_the_ratio():
    probe = {"available": True, "devices": [{"fragmentationRatio": 0.1}, {"fragmentationRatio": 0.4}]}
    report = assemble("s", "n", probe, {"available": False, "reason": "engine down"})
    assert report["fragmentationRatio"] == 0.4
    assert report["unavailable"] == ["kv: engine down"]
