"""The TTFT control: a concurrency limit that adapts to the engine's time to first token."""
from __future__ import annotations

import asyncio
import math

import pytest

from gpufleet_api.guard import guard_config
from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.guard.guard_metrics import SHED_REASONS, Reason
from gpufleet_engine.admission.kv_ledger import KvLedger, KvSnapshot
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.scheduler import OVERLOAD_HOLD_SECONDS, Rejection, Scheduler
from gpufleet_engine.admission.ttft_limit import (
    DECREASE,
    DEEPEST_CUT,
    RECOVERY_HALF_LIFE_SECONDS,
    STALE_SECONDS,
    WINDOW,
    TtftLimit,
    ttft_limit_for,
)
from tests.support.waiting import wait_for

OBJECTIVE = 0.5  # seconds: the engine's share is 0.3 s


def window(limit: TtftLimit, seconds: float, running: int, prompt: int = 100, acting: bool = True) -> None:
    for _ in range(WINDOW):
        limit.observe(seconds, prompt, running, acting=acting)


def test_starts_at_the_ceiling_and_cuts_to_a_share_of_what_ran_when_first_tokens_are_late():
    limit = TtftLimit(OBJECTIVE, 64)
    assert limit.limit == 64
    window(limit, 0.05, running=40)          # fast: 40 running is fine, and the limit was not reached
    assert limit.limit == 64 and limit.increases == 0
    # A baseline for the prompt size is set by the fast samples; now 40 running start a little late.
    window(limit, 0.33, running=40)
    assert limit.limit == math.floor(DECREASE * 40) == 32 and limit.decreases == 1
    # Much later than the target (0.3 s): cut in proportion, 0.3 / 0.45 of what ran...
    window(limit, 0.45, running=32)
    assert limit.limit == math.floor(32 * 0.3 / 0.45) == 21
    # ...but never below DEEPEST_CUT of it in one window, whatever one stall did.
    window(limit, 5.0, running=21)
    assert limit.limit == math.floor(DEEPEST_CUT * 21) == 10 and limit.decreases == 3


def test_while_it_does_not_act_the_limit_learns_what_the_engine_starts_in_time():
    limit = TtftLimit(OBJECTIVE, 64)
    limit.observe(0.01, 10_000, 1, acting=False)     # prefill is fast: late first tokens are contention
    window(limit, 0.45, running=40, acting=False)    # 40 ran, unheld, and started late
    ran = (1 + 15 * 40) / 16                         # the fast sample shares the window
    assert limit.limit == math.floor(ran * 0.3 / 0.45) == 25 and limit.decreases == 0
    window(limit, 0.4, running=40, acting=False)     # a better estimate may be higher: it follows
    assert limit.limit == math.floor(40 * 0.3 / 0.4) == 30
    window(limit, 0.05, running=36, acting=False)    # 36 ran in time: at least 36, and a quarter more
    assert limit.limit == 36 + 9


def test_grows_by_a_quarter_per_fast_window_only_while_the_limit_is_reached():
    limit = TtftLimit(OBJECTIVE, 64, limit=10)
    window(limit, 0.05, running=5)           # far under the limit: nothing to learn about more
    assert limit.limit == 10
    window(limit, 0.05, running=10)
    assert limit.limit == 12                 # a quarter more
    window(limit, 0.05, running=3)
    assert limit.limit == 12                 # the limit was not reached: nothing learned about more
    window(limit, 0.05, running=12)
    assert limit.limit == 15 and limit.increases == 2
    window(limit, 0.2, running=15)           # under the target but not under half of it: hold
    assert limit.limit == 15


def test_never_below_the_floor_nor_above_the_ceiling():
    limit = TtftLimit(OBJECTIVE, 4, limit=2)
    limit.observe(0.01, 10_000, 1)           # a long prompt's fast start: prefill is cheap here
    for _ in range(10):
        window(limit, 5.0, running=1)
    assert limit.limit == 1
    for _ in range(20):
        window(limit, 0.01, running=limit.limit)
    assert limit.limit == 4


def test_long_prompts_whose_own_prefill_takes_half_the_objective_do_not_throttle():
    limit = TtftLimit(OBJECTIVE, 64)
    # 30000-token prompts at best start 0.3 s after dispatch: their own prefill, not contention.
    window(limit, 0.3, running=1, prompt=30000)
    window(limit, 0.6, running=50, prompt=30000)
    assert limit.limit == 64 and limit.decreases == 0
    # Short prompts that start late still count: at 100k tokens/s their prefill is nothing.
    window(limit, 0.01, running=1, prompt=50)
    window(limit, 0.6, running=50, prompt=50)
    assert limit.limit == math.floor(DEEPEST_CUT * 50) == 25    # twice the 0.3 s target


def test_the_predicted_wait_comes_from_busy_stretches_only():
    limit = TtftLimit(OBJECTIVE, 8)
    assert limit.predicted_wait(0) == 0.0 and limit.predicted_wait(1) == math.inf
    limit.released(0.0, busy=True)
    limit.released(0.1, busy=True)
    assert limit.predicted_wait(0) == pytest.approx(0.1)
    assert limit.predicted_wait(3) == pytest.approx(0.4)
    limit.released(60.0, busy=False)         # an idle minute: not a pace
    limit.released(60.1, busy=True)
    limit.released(60.2, busy=True)
    assert limit.predicted_wait(0) == pytest.approx(0.1)
    assert limit.wait_budget == pytest.approx(0.15)


def test_a_reload_keeps_what_was_learned_and_off_removes_the_control():
    config = guard_config.parse({"servedModelName": "m", "tokenizer": "t", "maxConcurrency": 64})
    running = ttft_limit_for(config)
    assert running is not None and running.objective_seconds == 2.0
    running.limit = 20
    tighter = guard_config.parse({"servedModelName": "m", "tokenizer": "t", "maxConcurrency": 16,
                                  "slo": {"ttftP99Seconds": 0.4}})
    assert ttft_limit_for(tighter, running) is running
    assert (running.limit, running.ceiling, running.objective_seconds) == (16, 16, 0.4)
    running.limit = 10
    wider = guard_config.parse({"servedModelName": "m", "tokenizer": "t", "maxConcurrency": 32})
    ttft_limit_for(wider, running)
    assert running.limit == 10                # held down by the control: stays
    running.limit = running.ceiling
    ttft_limit_for(config, running)
    assert running.limit == 64                # not held down: follows maxConcurrency up
    off = guard_config.parse({"servedModelName": "m", "tokenizer": "t", "ttftControl": "Off"})
    assert ttft_limit_for(off, running) is None


def test_a_bad_ttft_control_names_the_field_and_the_choices():
    with pytest.raises(guard_config.ConfigError) as e:
        guard_config.parse({"servedModelName": "m", "tokenizer": "t", "ttftControl": "Sometimes"})
    assert "ttftControl" in str(e.value) and "Objective" in str(e.value)


# --- in the scheduler ----------------------------------------------------------------------

STANDARD = QueueClass("standard", 2, 10.0)
INTERACTIVE = QueueClass("interactive", 1, 10.0)


def scheduler(ttft: TtftLimit | None, max_concurrency: int = 8,
              crowd: list[float] | None = None) -> tuple[Scheduler, list[float]]:
    """A scheduler on a 1000-block pool; ``crowd``: the clients waiting to retry (default: 1000,
    which at a block per request overfills the pool: the replica is overloaded)."""
    now = [0.0]
    crowd = [1000.0] if crowd is None else crowd
    ledger = KvLedger(5)
    ledger.observe(KvSnapshot(1000, 0))
    s = Scheduler(ledger, MultiLevelQueue((INTERACTIVE, STANDARD), 5.0, 100), max_concurrency, 1.0,
                  clock=lambda: now[0], ttft=ttft, crowd=lambda: crowd[0])
    return s, now


async def test_late_first_tokens_lower_the_scheduler_limit_and_the_excess_waits_or_is_refused():
    s, now = scheduler(TtftLimit(OBJECTIVE, 8))
    grants = [await s.acquire(1, STANDARD) for _ in range(8)]
    assert s.limit == 8 and [g.running_at_dispatch for g in grants] == list(range(1, 9))
    assert s.ttft is not None
    s.ttft.observe(0.01, 10_000, 1)          # prefill is fast here: late first tokens are contention
    now[0] = 0.36                             # every first token came 0.36 s after dispatch
    for g in (grants * 2)[:WINDOW - 1]:
        s.first_token(g, now[0], 100)
    ran = (1 + sum(g.running_at_dispatch for g in (grants * 2)[:WINDOW - 1])) / WINDOW
    assert s.limit == math.floor(DECREASE * ran) == 3
    # Slots free every 0.06 s while all are taken: the pace of the queue.
    for g in grants[:5]:
        now[0] += 0.06
        s.release(g)
    assert s.running == 3 == s.limit
    # Two may wait (0.06 and 0.12 s predicted, within the 0.15 s the objective leaves); the third in
    # line would wait 0.18 s: refused at once, as a shed the autoscaler counts.
    waiting = [asyncio.create_task(s.acquire(1, STANDARD)) for _ in range(2)]
    await wait_for(lambda: len(s.queue) == 2, timeout=2, interval=0, what="two requests queued")
    with pytest.raises(Rejection) as e:
        await s.acquire(1, STANDARD)
    assert e.value.reason == Reason.TTFT_LIMIT and e.value.status == 429 and e.value.retry_after >= 0.18
    assert "time-to-first-token objective" in e.value.message and Reason.TTFT_LIMIT in SHED_REASONS
    assert s.early_refusal(STANDARD) is not None           # refused before the body is read, too
    assert s.early_refusal(INTERACTIVE) is None            # a better class has no one ahead of it
    for g in grants[5:]:
        now[0] += 0.06
        s.release(g)
    admitted = await asyncio.gather(*waiting)
    assert len(admitted) == 2 and s.running == 2


async def test_at_max_concurrency_itself_requests_queue_as_their_class_allows():
    s, now = scheduler(TtftLimit(OBJECTIVE, 2), max_concurrency=2)
    held = [await s.acquire(1, STANDARD) for _ in range(2)]
    queued = [asyncio.create_task(s.acquire(1, STANDARD)) for _ in range(5)]
    await wait_for(lambda: len(s.queue) == 5, timeout=2, interval=0, what="five requests queued")
    assert not any(t.done() for t in queued)
    for g in held:
        s.release(g)
    for t in queued:
        s.release(await t)


async def test_without_the_control_the_limit_is_max_concurrency():
    s, _ = scheduler(None, max_concurrency=3)
    g = await s.acquire(1, STANDARD)
    s.first_token(g, 10.0, 100)
    assert s.limit == 3


async def late_window(s: Scheduler, grants: list, now: list[float]) -> None:
    """A window of first tokens 0.5 s after dispatch, on a fast prefill: contention."""
    assert s.ttft is not None
    s.ttft.observe(0.01, 10_000, 1)
    now[0] += 0.5
    for g in (grants * 2)[:WINDOW]:
        s.first_token(g, now[0], 100)


async def test_at_a_load_the_pool_holds_the_control_only_learns_however_late_the_first_tokens():
    crowd = [0.0]
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=crowd)
    grants = [await s.acquire(10, STANDARD) for _ in range(8)]   # 80 blocks of 949 usable
    await late_window(s, grants, now)
    assert not s.overloaded() and s.limit == 8
    assert s.ttft is not None and s.ttft.limit == math.floor(0.6 * 4.5) and s.ttft.decreases == 0
    # 80 clients refused and waiting to retry would still fit (80 + 80 × 10 = 880 blocks): vLLM
    # alone would serve them all, so the guard does not trade them for latency.
    crowd[0] = 80
    await late_window(s, grants, now)
    assert not s.overloaded() and s.limit == 8


async def test_under_overload_the_control_acts_at_once_with_what_it_learned_until_the_crowd_is_gone():
    crowd = [0.0]
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=crowd)
    grants = [await s.acquire(10, STANDARD) for _ in range(8)]
    await late_window(s, grants, now)                 # learned, not acting: 2
    assert s.limit == 8 and s.ttft is not None and s.ttft.limit == 2
    crowd[0] = 90                                     # 80 + 90 × 10 = 980 blocks asked of 949
    assert s.overloaded() and s.limit == 2            # from the first moment, not after windows
    for g in grants[2:]:
        s.release(g)
    # The clients it refused are part of the crowd: while they would overfill the pool, it holds.
    crowd[0] = 96                                     # 20 + 960
    now[0] += STALE_SECONDS
    assert s.overloaded() and s.limit == 2
    crowd[0] = 10
    assert not s.overloaded() and s.limit == 2        # held a while after the overload
    now[0] += OVERLOAD_HOLD_SECONDS
    # No longer acting; and with no first token since, what it learned has faded towards the ceiling.
    assert s.limit == 8 and 2 < s.ttft.limit < 8


async def test_a_burst_starts_no_more_prompt_tokens_at_once_than_the_engine_prefills_in_time():
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=[0.0])
    assert s.ttft is not None and s.ttft.start_budget == math.inf     # nothing known yet
    s.ttft.observe(0.01, 1000, 1)             # 100k prompt tokens/s: 30k in the engine's 0.3 s
    assert s.ttft.start_budget == pytest.approx(30_000)
    first = [await s.acquire(1, STANDARD, start_tokens=10_000) for _ in range(3)]
    assert s.starting == 3 and s.starting_tokens == 30_000 and s.limit == 8
    fourth = asyncio.create_task(s.acquire(1, STANDARD, start_tokens=10_000))
    await wait_for(lambda: len(s.queue) == 1, timeout=2, interval=0, what="the fourth queued")
    s.first_token(first[0], now[0] + 0.01, 10_000)    # one has started: the next may
    g = await fourth
    assert s.running == 4 and s.starting == 3 and g.start_tokens == 10_000
    s.release(first[1])                       # ended before its first token
    assert s.starting == 2 and s.starting_tokens == 20_000
    # Requests that do not stream are not watched (they never count as starting); and one long
    # prompt may always start when nothing else is starting.
    plain = await s.acquire(1, STANDARD)
    assert not plain.start_tokens and s.starting == 2
    for grant in (first[2], g):
        s.first_token(grant, now[0] + 0.01, 10_000)
    huge = await s.acquire(1, STANDARD, start_tokens=50_000)
    assert s.starting == 1 and huge.start_tokens == 50_000


async def test_under_the_control_requests_queued_by_a_burst_that_would_wait_too_long_are_refused():
    crowd = [0.0]
    s, now = scheduler(TtftLimit(OBJECTIVE, 8, limit=2), crowd=crowd)
    assert s.ttft is not None
    s.ttft.observe(0.01, 1000, 1)             # a start budget of 30k prompt tokens
    first = [await s.acquire(1, STANDARD, start_tokens=15_000) for _ in range(2)]
    queued = [asyncio.create_task(s.acquire(1, STANDARD, start_tokens=15_000)) for _ in range(3)]
    await wait_for(lambda: len(s.queue) == 3, timeout=2, interval=0, what="three queued")
    crowd[0] = 2000                                        # the burst was the start of an overload
    s.first_token(first[0], now[0] + 0.01, 15_000)
    # Two run, as many as the limit; no slot has freed yet, so only the head may wait for one.
    await wait_for(lambda: sum(t.done() for t in queued) == 2, timeout=2, interval=0, what="two refused")
    refused = [t.exception() for t in queued if t.done()]
    assert all(isinstance(e, Rejection) and e.reason == Reason.TTFT_LIMIT for e in refused)
    assert len(s.queue) == 1 and s.running == 2
    s.release(first[1])
    assert s.running == 2 and len(s.queue) == 0            # the head got the freed slot


async def test_in_an_overloads_first_moment_newcomers_behind_the_start_bound_are_refused_unread():
    """A burst: slots are free, but the start bound holds the queue. Once the replica is overloaded,
    a newcomer that would wait behind that queue is refused before its body is read (parsing and
    tokenizing a burst of requests would delay the first tokens of those admitted), and the
    queued ones that would wait longer than the objective leaves are refused too."""
    crowd = [0.0]
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=crowd)
    assert s.ttft is not None
    s.ttft.observe(0.01, 1000, 1)             # a start budget of 30k prompt tokens
    s.ttft.released(0.0, busy=True)
    s.ttft.released(0.5, busy=True)           # a slot frees every 0.5 s: more than the 0.15 s budget
    first = [await s.acquire(1, STANDARD, start_tokens=15_000) for _ in range(2)]
    queued = asyncio.create_task(s.acquire(1, STANDARD, start_tokens=15_000))
    await wait_for(lambda: len(s.queue) == 1, timeout=2, interval=0, what="the third queued")
    assert s.running == 2 < s.limit
    # Not overloaded: the newcomer may queue, as vLLM alone would serve it.
    assert s.early_refusal(STANDARD) is None
    crowd[0] = 2000
    early = s.early_refusal(STANDARD)
    assert early is not None and early.reason == Reason.TTFT_LIMIT and early.status == 429
    assert early.retry_after is not None and early.retry_after >= 1.0
    # A newcomer read anyway (its size known) that cannot start now is refused the same way.
    with pytest.raises(Rejection) as refused:
        await s.acquire(1, STANDARD, start_tokens=100)
    assert refused.value.reason == Reason.TTFT_LIMIT
    s.dispatch()                              # the queued one would wait a slot's 0.5 s: refused
    with pytest.raises(Rejection) as shed:
        await queued
    assert shed.value.reason == Reason.TTFT_LIMIT and len(s.queue) == 0
    for g in first:
        s.release(g)


async def test_overload_is_what_vllm_holds_and_what_is_asked_past_the_pool_by_more_than_the_margin():
    """At the most clients vLLM alone serves without preempting, their demand is the pool's size
    by definition: a client or two waiting there is the pool well used, not an overload."""
    crowd, arriving = [0.0], [0]
    now = [0.0]
    ledger = KvLedger(5)                          # quantile 0.9: z ≈ 1.28
    ledger.observe(KvSnapshot(1000, 0))
    s = Scheduler(ledger, MultiLevelQueue((INTERACTIVE, STANDARD), 5.0, 100), 16, 1.0,
                  clock=lambda: now[0], ttft=TtftLimit(OBJECTIVE, 16), crowd=lambda: crowd[0],
                  arriving=lambda: arriving[0])
    grants = [await s.acquire(100, STANDARD, 400.0) for _ in range(8)]   # each 100 ± 20 blocks
    usable = ledger.capacity - ledger.watermark   # 949
    margin = ledger.margin()
    assert margin == math.ceil(1.2816 * math.sqrt(8 * 400)) and ledger.expected_blocks == 800
    crowd[0] = 2                                  # 1000 asked of 949: past the pool, within the margin
    assert 800 + 200 > usable and 800 + 200 <= usable + margin and not s.overloaded()
    crowd[0] = 3                                  # 1100 > 949 + 73
    assert s.overloaded()
    # Requests read and waiting to be parsed are asking too: a burst shows before it is parsed.
    crowd[0], arriving[0] = 0, 3
    assert s.overloaded()
    # What the requests in flight hold is vLLM's view, not their reservations (what each answer
    # may grow to): read at half of them, the same three asking fit, and so do five more.
    ledger.observe(KvSnapshot(1000, 400))
    assert ledger.expected_blocks == 800 and not s.overloaded()
    arriving[0] = 8                               # 400 + 8 × 50 = 800 ≤ 949 + 73
    assert not s.overloaded()
    arriving[0] = 13                              # 400 + 650 = 1050
    assert s.overloaded()
    for g in grants:
        s.release(g)


async def test_a_burst_is_judged_by_what_requests_held_of_late_not_by_the_first_admitted():
    """32 clients starting at once, the pool's size in demand, are not an overload because the
    first request admitted has a long prompt; 128 are."""
    arriving = [0]
    ledger = KvLedger(5)
    ledger.observe(KvSnapshot(1000, 0))
    s = Scheduler(ledger, MultiLevelQueue((INTERACTIVE, STANDARD), 5.0, 100), 16, 1.0,
                  clock=lambda: 0.0, ttft=TtftLimit(OBJECTIVE, 16), crowd=lambda: 0.0,
                  arriving=lambda: arriving[0])
    steady = [await s.acquire(15, STANDARD) for _ in range(10)]
    for used in (100, 120, 80):                   # vLLM held ~10 blocks a request at its reads
        ledger.observe(KvSnapshot(1000, used))
    assert ledger.held_per_request == pytest.approx(10.0, rel=0.01)
    for g in steady:
        s.release(g)
    ledger.observe(KvSnapshot(1000, 0))           # idle: nothing in flight, the average stays
    long_prompt = await s.acquire(40, STANDARD)
    arriving[0] = 31                              # 40 + 31 × 10 = 350 of 949 (not 40 + 31 × 40)
    assert not s.overloaded()
    arriving[0] = 127                             # 40 + 1270
    assert s.overloaded()
    s.release(long_prompt)


async def test_a_burst_of_short_requests_after_a_surge_of_long_ones_is_judged_by_what_they_hold():
    """The recovery benchmark's burst through vLLM's own client (issue 28): after a surge whose
    requests held 12 blocks each and a lull, 8 requests of 6 blocks fit a 64-block pool. Judged
    at the surge's 12 blocks the gate opened, the control refused 71 of 80 and the refused (who
    never retry) kept it open; judged at what the burst's running requests hold, it stays shut."""
    arriving = [0]
    ledger = KvLedger(5)
    ledger.observe(KvSnapshot(64, 0))
    s = Scheduler(ledger, MultiLevelQueue((INTERACTIVE, STANDARD), 5.0, 100), 16, 1.0,
                  clock=lambda: 0.0, ttft=TtftLimit(OBJECTIVE, 16), crowd=lambda: 0.0,
                  arriving=lambda: arriving[0])
    surge = [await s.acquire(1, STANDARD) for _ in range(4)]
    ledger.observe(KvSnapshot(64, 48))            # the surge: 12 blocks a request
    for g in surge:
        s.release(g)
    ledger.observe(KvSnapshot(64, 0))             # the lull: the average stays at 12
    assert ledger.held_per_request == pytest.approx(12.0)
    burst = [await s.acquire(1, STANDARD) for _ in range(3)]
    ledger.observe(KvSnapshot(64, 21))            # the burst's first three hold 7 each
    arriving[0] = 4                               # 21 + 4 × 7 = 49 ≤ 59 usable (at 12: 69)
    assert not s.overloaded()
    arriving[0] = 6                               # 21 + 6 × 7 = 63: past the pool, it is one
    assert s.overloaded()
    for g in burst:
        s.release(g)


def test_the_start_budget_learns_how_fast_bursts_start_not_one_prompt_alone():
    limit = TtftLimit(OBJECTIVE, 8)
    limit.observe(0.01, 1000, 1)                   # one prompt alone: 100k tokens/s
    assert limit.start_budget == pytest.approx(30_000)
    limit.started(0.01, 1000)                      # a small start set says nothing about bursts
    assert limit.start_budget == pytest.approx(30_000)
    for _ in range(30):
        limit.started(0.6, 24_000)                 # bursts of 24k tokens got first tokens after 0.6 s
    assert limit.start_rate == pytest.approx(40_000, rel=0.01)
    assert limit.start_budget == pytest.approx(12_000, rel=0.01)
    assert limit.prefill_seconds(12_000) == pytest.approx(0.3, rel=0.01)
    assert limit.loose_start_budget == pytest.approx(30_000)   # below overload: the best rate's


async def test_under_the_control_a_request_that_waited_in_line_past_the_queue_share_is_refused_unread():
    crowd = [0.0]
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=crowd)
    assert s.ttft is not None and s.ttft.wait_budget == pytest.approx(0.15)
    g = await s.acquire(1, STANDARD)
    assert s.early_refusal(STANDARD, waited=0.5) is None      # not overloaded: it may go on
    crowd[0] = 2000
    assert s.early_refusal(STANDARD, waited=0.1) is None      # within the queue's share
    late = s.early_refusal(STANDARD, waited=0.2)
    assert late is not None and late.reason == Reason.TTFT_LIMIT and late.status == 429
    s.release(g)


def test_a_cut_limit_recovers_with_time_when_no_first_token_says_otherwise():
    limit = TtftLimit(OBJECTIVE, 64)
    limit.observe(0.01, 10_000, 40, now=0.0)         # a fast prefill: the late ones are contention
    for _ in range(WINDOW - 1):
        limit.observe(0.6, 100, 40, now=0.0)         # twice the target with 40 running: cut deep
    assert limit.limit == math.floor(DEEPEST_CUT * 40) == 20
    limit.recover(STALE_SECONDS)                     # a lull as long as a window may take: kept
    assert limit.limit == 20
    limit.recover(STALE_SECONDS + RECOVERY_HALF_LIFE_SECONDS)
    assert limit.limit == 64 - (64 - 20) // 2 == 42  # the gap to the ceiling halved
    limit.recover(STALE_SECONDS + 8 * RECOVERY_HALF_LIFE_SECONDS)
    assert limit.limit == 64                         # a minute of nothing: back at the ceiling


def test_under_a_lasting_overload_late_windows_keep_the_limit_down():
    limit = TtftLimit(OBJECTIVE, 64)
    limit.observe(0.01, 10_000, 1, now=0.0)
    t = 0.0
    for _ in range(10):                               # a window every 2 s, each late: 60 s of it
        for _ in range(WINDOW):
            t += 2.0 / WINDOW
            limit.observe(0.45, 100, limit.limit, now=t)
    assert limit.limit <= 20 and limit.decreases >= 2


def test_samples_older_than_a_window_may_take_do_not_join_a_new_window():
    limit = TtftLimit(OBJECTIVE, 64)
    limit.observe(0.01, 10_000, 1, now=0.0)
    for _ in range(WINDOW - 2):
        limit.observe(0.6, 100, 40, now=0.0)         # a surge's last, unfinished window
    for i in range(WINDOW):                           # a minute later, fast first tokens
        limit.observe(0.05, 100, 40, now=60.0 + i * 0.01)
    assert limit.limit == 64 and limit.decreases == 0


async def test_a_replica_with_nothing_running_admits_what_fits_whatever_it_learned():
    crowd = [1000.0]                                  # the surge's refused clients, not all gone
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=crowd)
    grants = [await s.acquire(10, STANDARD) for _ in range(8)]
    await late_window(s, grants, now)
    assert s.overloaded() and s.ttft is not None and s.ttft.limit < 8
    for g in grants:
        s.release(g)
    assert s.running == 0 and s.early_refusal(STANDARD, waited=10.0) is None
    burst = [await s.acquire(10, STANDARD) for _ in range(s.ttft.limit)]
    assert len(burst) == s.ttft.limit                 # admitted at once, none refused


async def test_after_an_overload_and_a_lull_a_burst_that_fits_is_admitted():
    crowd = [1000.0]
    s, now = scheduler(TtftLimit(OBJECTIVE, 8), crowd=crowd)
    grants = [await s.acquire(10, STANDARD) for _ in range(8)]
    await late_window(s, grants, now)
    assert s.limit < 8
    for g in grants:
        s.release(g)
    crowd[0] = 0.0                                    # the surge's clients went away
    now[0] += 60.0                                    # a minute with no traffic
    burst = [await s.acquire(10, STANDARD) for _ in range(8)]
    assert len(burst) == 8 and s.running == 8
