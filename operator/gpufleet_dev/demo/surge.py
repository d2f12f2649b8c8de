"""The demo's surge, the same for both runs: who asks, how many at once, for how long.

Sizing, on the 2-core machine the demo runs on: each replica's KV pool is 64 blocks x 32 tokens
(the sample's numBlocksOverride), 2048 tokens; a request holds 200 prompt tokens and 64 answer
tokens, 264 tokens = 9 blocks, so 7 run at once. The surge's 10 clients ask for 90 blocks, about 1.4x
the pool: vLLM alone must preempt and recompute (overloaded), yet every request fits the pool on its
own and 7 always run, so it keeps making progress (not crippled; requests slow down, they do not
fail). bench/guard_realistic.py measures the harsher case (128 clients on 512 blocks, 4x: vLLM alone
TTFT p99 8.8 s, 76 preemptions; docs/benchmarks.md); the demo stays milder so that vLLM alone is a
fair opponent, and short: 10 s of warm-up at 2 clients, then 90 s of surge, then the requests in
flight finish (no new ones), which keeps each run near two minutes (docs/dev-cluster.md).

Clients: every third one is impatient (gives up after 10 s without a first token); all retry as the
openai SDK does (load.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Awaitable, Callable

from .load import ClientPolicy, EndpointLoad, RequestResult


@dataclasses.dataclass(frozen=True)
class SurgePlan:
    clients: int = 10
    warmup_clients: int = 2
    warmup_seconds: float = 10.0
    surge_seconds: float = 90.0
    impatient_every: int = 3          # client i is impatient when i % impatient_every == impatient_every - 1
    patience_seconds: float = 10.0
    timeout_seconds: float = 90.0     # every client's own timeout, retries included
    tick_seconds: float = 2.0

    @property
    def load_seconds(self) -> float:
        return self.warmup_seconds + self.surge_seconds

    def phase_at(self, t: float) -> tuple[str, int]:
        """(phase, clients) at ``t`` seconds since the load began; after the surge no new requests."""
        if t < self.warmup_seconds:
            return "warm-up", min(self.warmup_clients, self.clients)
        if t < self.load_seconds:
            return "surge", self.clients
        return "finish", 0

    def policy_of(self, i: int) -> ClientPolicy:
        impatient = self.impatient_every > 0 and i % self.impatient_every == self.impatient_every - 1
        return ClientPolicy(patience=self.patience_seconds if impatient else None, timeout=self.timeout_seconds)

    def describe(self) -> str:
        return (f"{self.warmup_seconds:g} s at {self.warmup_clients} clients, then {self.surge_seconds:g} s at "
                f"{self.clients}; every {self.impatient_every}rd client gives up after {self.patience_seconds:g} s "
                f"without a first token; each retries a refusal twice, after its Retry-After")


@dataclasses.dataclass
class SurgeRun:
    started_at: float                  # unix time the load began
    ended_at: float                    # unix time the surge's last request ended
    results: list[RequestResult]       # the surge's requests (started before the surge ended)
    later: list[RequestResult]         # requests of the phase after it (the lull), not in the table


Tick = Callable[[float, str, int], Awaitable[None]]


async def drive(load: EndpointLoad, plan: SurgePlan, tick: Tick,
                after: Callable[[dict], Awaitable[None]] | None = None) -> SurgeRun:
    """Warm-up, surge, the surge's requests finishing; then ``after(phase)`` (it sets ``phase["name"]``
    and ``phase["clients"]``, and returns when its phase is over) while the same clients keep running.
    ``tick(t, phase, clients)`` runs every ``plan.tick_seconds``."""
    phase: dict = {"name": "warm-up", "clients": plan.warmup_clients, "after": False}

    def clients_at(t: float) -> int:
        # The plan's own clock until the surge's requests have finished; then the phase ``after`` sets.
        return int(phase["clients"]) if phase["after"] else plan.phase_at(t)[1]

    stop = asyncio.Event()
    load.t0 = time.monotonic()
    started_at = time.time()
    runner = asyncio.create_task(load.run(clients_at, stop, max_clients=plan.clients, policy_of=plan.policy_of))
    try:
        while (t := load.now()) < plan.load_seconds:
            phase["name"], phase["clients"] = plan.phase_at(t)
            await tick(t, phase["name"], phase["clients"])
            await asyncio.sleep(min(plan.tick_seconds, max(0.05, plan.load_seconds - t)))
        phase["name"], phase["clients"] = plan.phase_at(plan.load_seconds)
        deadline = time.monotonic() + plan.timeout_seconds + 10
        while load.in_flight and time.monotonic() < deadline:
            await tick(load.now(), "finish", load.in_flight)
            await asyncio.sleep(0.5)
        ended_at = time.time()
        if after is not None:
            phase["after"] = True
            await after(phase)
    finally:
        stop.set()
        results = await runner
    return SurgeRun(started_at, ended_at, [r for r in results if r.started < plan.load_seconds],
                    [r for r in results if r.started >= plan.load_seconds])
