"""KV-block admission arithmetic."""
from __future__ import annotations

import math

import pytest

from gpufleet_engine.admission.kv_ledger import KvLedger, KvSnapshot, block_cost, watermark_blocks


@pytest.mark.parametrize(("prompt", "max_tokens", "block", "n", "blocks"), [
    (256, 64, 32, 1, 10),     # exactly 10 blocks
    (257, 64, 32, 1, 11),     # one token more needs a new block
    (1, 1, 32, 1, 1),
    (100, 28, 16, 2, 16),     # two sequences, 8 blocks each
])
def test_block_cost_is_ceil_of_prompt_plus_max_tokens_over_block_size(prompt, max_tokens, block, n, blocks):
    assert block_cost(prompt, max_tokens, block, n) == blocks


def test_watermark_rounds_up_so_a_nonzero_percent_keeps_a_block():
    assert watermark_blocks(64, 15) == 10
    assert watermark_blocks(10, 1) == 1
    assert watermark_blocks(64, 0) == 0


def test_usage_ratio_becomes_used_blocks_rounding_up():
    assert KvSnapshot.from_usage(64, 0.5) == KvSnapshot(64, 32)
    assert KvSnapshot.from_usage(64, 0.51) == KvSnapshot(64, 33)
    assert KvSnapshot.from_usage(64, 0.0) == KvSnapshot(64, 0)


def ledger(used: int = 0, total: int = 64, percent: int = 15) -> KvLedger:
    led = KvLedger(percent)
    led.observe(KvSnapshot(total, used))
    return led


def test_admits_while_the_watermark_stays_free_and_refuses_the_request_that_would_cross_it():
    led = ledger()                                 # 64 blocks, 10 kept free
    admitted = [led.try_admit(object(), 10).admitted for _ in range(6)]
    assert admitted == [True, True, True, True, True, False]
    assert led.free_blocks() == 14


def test_a_refused_request_reserves_nothing():
    led = ledger(used=50)
    d = led.try_admit("big", 10)
    assert not d.admitted and d.free_blocks == 14 and d.watermark == 10
    assert led.reserved_blocks == 0


def test_blocks_promised_since_the_last_read_count_as_used():
    led = ledger(used=30)
    led.try_admit("a", 10)
    assert led.free_blocks() == 24  # 64 - (30 seen by vLLM + 10 promised since)


def test_a_fresh_read_replaces_the_promises_it_already_includes():
    led = ledger(used=0)
    led.try_admit("a", 10)
    led.observe(KvSnapshot(64, 9))               # vLLM has allocated the prompt's blocks so far
    assert led.free_blocks() == 55


def test_the_watermark_applies_to_what_vllm_really_holds():
    led = ledger(used=0)
    for key in "abcde":
        assert led.try_admit(key, 10).admitted
    led.observe(KvSnapshot(64, 40))              # five prompts allocated, decodes just started
    assert led.try_admit("f", 10).admitted       # 24 free - 10 >= 10, and 60 budgeted blocks fit in 63


def test_the_budgets_of_admitted_decodes_always_fit_the_pool():
    led = ledger(used=0, percent=0)
    for key in "abcdef":
        assert led.try_admit(key, 10).admitted   # 60 of the 63 usable blocks promised
    led.observe(KvSnapshot(64, 30))              # vLLM's view says 34 free...
    d = led.try_admit("g", 10)
    assert not d.admitted and d.unreserved_blocks == 3   # ...but the six decodes will grow to 60


def test_blocks_used_outside_the_guard_count_too():
    led = ledger(used=45)                        # e.g. requests sent to vLLM directly
    assert not led.try_admit("a", 10).admitted


def test_release_frees_the_budget_without_waiting_for_the_next_read():
    led = ledger()
    for key in "abcde":
        led.try_admit(key, 10)
    assert not led.try_admit("f", 10).admitted
    led.release("a")
    assert led.try_admit("f", 10).admitted


def test_releasing_an_unknown_key_changes_nothing():
    led = ledger()
    led.try_admit("a", 10)
    led.release("zzz")
    assert led.reserved_blocks == 10


def test_with_the_pool_idle_a_request_larger_than_pool_minus_watermark_still_runs():
    led = ledger()
    assert led.try_admit("huge", 60).admitted    # would cross the watermark, but protects no one
    assert not led.try_admit("next", 1).admitted


def test_a_request_larger_than_the_usable_pool_is_never_admitted():
    assert not ledger().try_admit("x", 64).admitted   # vLLM keeps one of the 64 blocks back
    assert ledger().try_admit("x", 63).admitted


def test_without_a_metrics_read_nothing_is_admitted():
    led = KvLedger(15)
    assert not led.known and not led.try_admit("a", 1).admitted


def test_predicted_reservations_share_one_margin_that_grows_with_the_root_of_their_variance():
    led = ledger(used=0, percent=0)               # z(0.9) = 1.2816
    assert led.margin() == 0
    for key in "abcd":
        assert led.try_admit(key, 5, variance=9.0).admitted   # 3 blocks of standard deviation each
    # Four answers together vary by sqrt(4 × 9) = 6 blocks, not 4 × 3: the margin is 1.28 × 6.
    assert led.margin() == 8 and led.reserved_blocks == 20 + 8
    led.release("a")
    assert led.margin() == math.ceil(1.2816 * math.sqrt(27)) and led.reserved_blocks == 15 + 7


def test_the_margin_counts_in_admission_but_not_in_what_vllm_will_hold():
    led = ledger(used=0, percent=0)
    assert led.try_admit("a", 40, variance=100.0).admitted   # margin 13: 53 of 63 promised
    d = led.evaluate(10, variance=100.0)          # 40 + 10 + 1.28 × sqrt(200) = 69 > 63
    assert not d.admitted and d.unreserved_blocks == 63 - 53
    assert led.evaluate(10).admitted              # 40 + 10 + 13 = 63: a full budget adds no variance
    assert led.free_blocks() == 64 - 40           # vLLM's view: only the 40 blocks


def test_extending_a_reservation_replaces_its_variance():
    led = ledger(used=0, percent=0)
    led.try_admit("a", 5, variance=16.0)
    led.extend("a", 10, variance=0.0)             # past every known answer: no variance left
    assert led.reserved_blocks == 15 and led.margin() == 0
    led.extend("a", 0, variance=4.0)
    assert led.reserved_blocks == 15 + 3


@pytest.mark.parametrize(("quantile", "margin"), [(0.5, 0), (0.9, 13), (0.99, 24), (1.0, 38)])
def test_the_quantile_sets_how_many_standard_deviations_the_margin_keeps(quantile, margin):
    led = ledger(used=0, percent=0)
    led.quantile = quantile
    led.try_admit("a", 1, variance=100.0)         # 10 blocks of standard deviation
    assert led.margin() == margin                 # 1.0 stands for 0.9999: z = 3.72


def test_a_quantile_outside_zero_to_one_is_refused_by_name():
    with pytest.raises(ValueError, match="quantile must be in"):
        KvLedger(5, quantile=0.0)


def test_resize_moves_a_reservation_to_its_measured_size_both_ways():
    ledger = KvLedger(15)
    ledger.observe(KvSnapshot(100, 0))
    ledger.try_admit("a", 32)
    ledger.resize("a", 6, variance=4.0)
    assert ledger.reservation("a") == 6 and ledger.expected_blocks == 6
    assert ledger.free_blocks() == 94          # vLLM's view corrected by the 6, not the 32
    assert ledger.margin() > 0                 # its variance now counts
    ledger.resize("a", 40)
    assert ledger.reservation("a") == 40 and ledger.free_blocks() == 60 and ledger.margin() == 0
    ledger.release("a")
    assert ledger.expected_blocks == 0 and ledger.free_blocks() == 100
    ledger.resize("gone", 5)                   # a released key stays released
    assert ledger.expected_blocks == 0
