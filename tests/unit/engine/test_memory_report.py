"""The memory audit's arithmetic: KV-pool waste and the report's summary."""
from __future__ import annotations

from gpufleet_engine.admission.kv_ledger import KvLedger
from gpufleet_engine.serving.memory_report import SequenceLength, assemble, kv_report, kv_waste, partial_block_waste
from gpufleet_engine.vllm.stats import VllmStats


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


def test_kv_waste_is_the_share_of_used_slots_holding_no_token():
    stats = VllmStats(0.25, 64, 32, 2, 0, 0)        # 16 blocks of 32 in use
    seqs = [SequenceLength(100), SequenceLength(60), SequenceLength(200)]  # 4 + 2 + 7 blocks
    waste, why = kv_waste(stats, 32, seqs)
    assert waste == 1 - 360 / (16 * 32) and why == ""
    # Prefix sharing can make the sequences hold more tokens than the pool's slots: clamped.
    assert kv_waste(stats, 32, [SequenceLength(600)])[0] == 0.0


def test_kv_waste_is_unknown_rather_than_guessed():
    stats = VllmStats(0.25, 64, 32, 2, 0, 0)
    assert kv_waste(None, 32, [])[0] is None
    waste, why = kv_waste(stats, 32, [SequenceLength(40), SequenceLength(None)])
    assert waste is None and "1 in-flight request(s) of unknown length" in why
    assert kv_waste(VllmStats(0.25, 64, 32, 2, 3, 0), 32, [SequenceLength(40)])[1].startswith("vLLM has waiting")
    assert kv_waste(VllmStats(0.0, 64, 32, 0, 0, 0), 32, [])[1] == "no KV block in use"


