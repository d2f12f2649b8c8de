"""The parse lane: one request parsed per loop turn, so a burst does not hold the loop."""
from __future__ import annotations

import asyncio

from gpufleet_engine.admission.parse_lane import ParseLane


async def relay(events: list[str], steps: int) -> None:
    """An answer being streamed back: one step per loop turn."""
    for _ in range(steps):
        events.append("relay")
        await asyncio.sleep(0)


async def test_a_burst_takes_turns_and_the_loop_runs_other_work_between_them():
    lane = ParseLane()
    events: list[str] = []
    seen_waiting: list[int] = []

    async def arrival(i: int) -> None:
        async with lane.turn():
            seen_waiting.append(lane.waiting)
            events.append(f"parse{i}")

    await asyncio.gather(*(arrival(i) for i in range(5)), relay(events, 40))
    parses = [i for i, e in enumerate(events) if e.startswith("parse")]
    assert [events[i] for i in parses] == [f"parse{i}" for i in range(5)]       # in arrival order
    assert all(b - a > 1 for a, b in zip(parses, parses[1:]))                  # a relay step between two
    assert seen_waiting == [1, 4, 3, 2, 1] and lane.waiting == 0   # the first found the lane free


async def test_a_refusal_inside_the_lane_leaves_it_free():
    lane = ParseLane()

    async def refused() -> None:
        async with lane.turn():
            raise ValueError("refused before parsing")

    results = await asyncio.gather(refused(), refused(), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results) and lane.waiting == 0
    async with lane.turn():
        assert lane.waiting == 1


async def test_a_line_of_refusals_passes_without_a_loop_turn_each():
    lane = ParseLane()
    events: list[str] = []

    async def refused(i: int) -> None:
        async with lane.turn():
            events.append(f"refused{i}")
            raise ValueError

    await asyncio.gather(*(refused(i) for i in range(4)), relay(events, 3), return_exceptions=True)
    refusals = [i for i, e in enumerate(events) if e.startswith("refused")]
    assert refusals == list(range(refusals[0], refusals[0] + 4))   # back to back


async def test_the_request_parsed_goes_on_in_the_same_turn_only_the_next_in_line_waits():
    lane = ParseLane()
    events: list[str] = []

    async def arrival(i: int) -> None:
        async with lane.turn():
            events.append(f"parse{i}")
        events.append(f"forward{i}")   # to vLLM: no loop turn between its parse and this

    await asyncio.gather(arrival(0), arrival(1), relay(events, 6))
    assert events.index("forward0") == events.index("parse0") + 1
    assert events.index("forward1") == events.index("parse1") + 1
    assert "relay" in events[events.index("forward0"):events.index("parse1")]
