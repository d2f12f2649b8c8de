"""One request body parsed and tokenized at a time, with a turn of the event loop between two.

The guard's event loop both admits requests and relays the answers of those it
admitted. Parsing and tokenizing a request takes ~0.3 ms of the loop; a burst
of a hundred arrivals, run back to back, holds the loop for tens of
milliseconds while the first tokens of the requests just admitted wait unread
in their sockets: on the realistic benchmark the requests admitted in the
first instant of a step from 0 to 128 clients got their first token 80–130 ms
after vLLM had answered most of them. Taking turns costs the next request in
line one loop turn (microseconds), never the request just parsed, and lets
every turn poll the sockets.

The requests waiting for their turn are demand the guard has not measured
yet: the scheduler counts them as asking (``Scheduler.overloaded``), so a
burst shows as an overload as soon as it is read, and the requests still in
line when it does are refused before they are parsed.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class ParseLane:
    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.waiting = 0   # requests read and in line, or parsing
        self._parsed_this_turn = False

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """The caller's turn. A caller that leaves it by raising (refused before parsing) passes
        it on at once: a refusal is cheap, and a line of them should not take a turn each."""
        self.waiting += 1
        try:
            async with self._lock:
                if self._parsed_this_turn:
                    # A request was parsed in this turn of the loop already: wait for the next,
                    # which polls the sockets (the answers being relayed) first. The request
                    # parsed goes on to vLLM at once; only the next one in line waits.
                    await asyncio.sleep(0)
                yield
                if not self._parsed_this_turn:
                    self._parsed_this_turn = True
                    asyncio.get_running_loop().call_soon(self._next_turn)
        finally:
            self.waiting -= 1

    def _next_turn(self) -> None:
        self._parsed_this_turn = False
