"""The guard's view of vLLM's health (serving/upstream.py's EngineMonitor): a dead vLLM (its connection refused)
is down at the first read, while reads that only time out (a hung vLLM, or a working one on a host too loaded
to answer /metrics in time) count as down only after SLOW_READS_BEFORE_DOWN in a row: one slow read must not
turn every request away with 503 engine_down while vLLM serves."""
from __future__ import annotations

import asyncio

import pytest

from gpufleet_engine.serving.upstream import SLOW_READS_BEFORE_DOWN, EngineDown, EngineMonitor, EngineSlow
from gpufleet_engine.vllm.stats import VllmStats

STATS = VllmStats(0.25, 64, 32, 1, 0, 0)


class ScriptedUpstream:
    """Answers each /metrics read with the next outcome of ``script`` (stats or an exception); the
    monitor is stopped when the script is used up."""

    def __init__(self, script: list):
        self.script = list(script)
        self.done = asyncio.Event()

    async def read_stats(self, timeout: float) -> VllmStats:
        if not self.script:
            self.done.set()
            await asyncio.Event().wait()
        outcome = self.script.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


async def observe(script: list) -> list[str]:
    """What the monitor told the guard, read by read: "up" or "down: <problem>"."""
    upstream = ScriptedUpstream(script)
    seen: list[str] = []
    monitor = EngineMonitor(upstream, 0.0, lambda stats: seen.append("up"),  # type: ignore[arg-type]
                            lambda problem: seen.append(f"down: {problem}"))
    task = asyncio.create_task(monitor.run())
    await asyncio.wait_for(upstream.done.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return seen


async def test_a_refused_connection_is_down_at_once():
    assert await observe([STATS, EngineDown("refused"), STATS]) == ["up", "down: refused", "up"]


async def test_slow_reads_below_the_threshold_leave_the_engine_up():
    slow = [EngineSlow("slow")] * (SLOW_READS_BEFORE_DOWN - 1)
    assert await observe([STATS, *slow, STATS, *slow, STATS]) == ["up", "up", "up"]


async def test_slow_reads_in_a_row_mark_the_engine_down_until_it_answers():
    slow = [EngineSlow("slow")] * (SLOW_READS_BEFORE_DOWN + 1)
    assert await observe([STATS, *slow, STATS]) == ["up", "down: slow", "down: slow", "up"]


async def test_a_refusal_between_slow_reads_is_down_at_once_and_restarts_the_count():
    slow = [EngineSlow("slow")] * (SLOW_READS_BEFORE_DOWN - 1)
    assert await observe([*slow, EngineDown("refused"), *slow, STATS]) == ["down: refused", "up"]
