"""The scaling policy: samples of every replica → keep, scale out or scale in.

Out when mean KV usage crosses the high watermark, when the guard sheds, or
when requests wait per replica beyond the threshold; in only after usage stays
below the low watermark for the stabilization window with nothing waiting and
every replica readable. Bounded steps, no action while new replicas are still
starting, and an unreadable replica is never taken for an idle one.
"""
from __future__ import annotations

import dataclasses
import math

from .signals import ReplicaSample


@dataclasses.dataclass(frozen=True)
class Thresholds:
    min_replicas: int
    max_replicas: int
    kv_high: float
    kv_low: float
    queue_depth: int
    up_stabilization_s: float
    down_stabilization_s: float
    max_step: int

    @classmethod
    def from_spec(cls, auto) -> "Thresholds":
        return cls(auto.min_replicas, auto.max_replicas, auto.kv_high_watermark_percent / 100,
                   auto.kv_low_watermark_percent / 100, auto.queue_depth_threshold,
                   auto.scale_up_stabilization_seconds, auto.scale_down_stabilization_seconds,
                   auto.max_scale_up_step)


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between ticks (per service, in memory)."""
    high_since: float | None = None
    low_since: float | None = None
    shed_seen: tuple[tuple[str, float], ...] = ()  # per pod cumulative shed counts last tick


@dataclasses.dataclass(frozen=True)
class Observation:
    kv_usage: float | None
    waiting_per_replica: float
    shed_delta: float
    readable: int
    unreadable: list[str]


@dataclasses.dataclass(frozen=True)
class Decision:
    target: int
    reason: str
    message: str

    @property
    def direction(self) -> str:
        return "up" if self.reason not in ("KVLowWatermark",) else "down"


def observe(samples: list[ReplicaSample], state: PolicyState) -> tuple[Observation, tuple]:
    ok = [s for s in samples if s.ok]
    before = dict(state.shed_seen)
    shed = 0.0
    for s in ok:
        prev = before.get(s.pod)
        if prev is not None:
            shed += s.shed_total - prev if s.shed_total >= prev else s.shed_total
    kv_values = [s.kv_usage for s in ok if s.kv_usage is not None]
    kv = sum(kv_values) / len(kv_values) if kv_values else None
    waiting = sum(s.engine_waiting + s.guard_queued for s in ok) / len(ok) if ok else 0.0
    obs = Observation(kv_usage=kv, waiting_per_replica=waiting, shed_delta=shed, readable=len(ok),
                      unreadable=[s.pod for s in samples if not s.ok])
    return obs, tuple((s.pod, s.shed_total) for s in ok)


def decide(th: Thresholds, *, current: int, ready: int, samples: list[ReplicaSample], state: PolicyState,
           now: float) -> tuple[Decision | None, PolicyState, Observation]:
    obs, shed_seen = observe(samples, state)
    high_since, low_since = state.high_since, state.low_since
    decision = None

    if current < th.min_replicas or current > th.max_replicas:
        target = max(th.min_replicas, min(th.max_replicas, current))
        decision = Decision(target, "OutOfBounds", f"{current} replicas is outside {th.min_replicas}..{th.max_replicas}")
        return decision, PolicyState(None, None, shed_seen), obs

    reasons = []
    if obs.kv_usage is not None and obs.kv_usage >= th.kv_high:
        reasons.append(("KVHighWatermark", f"KV usage {obs.kv_usage:.0%} >= {th.kv_high:.0%}"))
    if obs.shed_delta > 0:
        reasons.append(("Shedding", f"guard refused {obs.shed_delta:.0f} request(s) since the last read"))
    if obs.waiting_per_replica > th.queue_depth:
        reasons.append(("QueueDepth", f"{obs.waiting_per_replica:.1f} waiting per replica > {th.queue_depth}"))

    if reasons:
        low_since = None
        high_since = high_since if high_since is not None else now
        starting = ready < current
        if current < th.max_replicas and not starting and now - high_since >= th.up_stabilization_s:
            want = current + 1
            if obs.kv_usage is not None and obs.kv_usage >= th.kv_high:
                # Enough replicas to bring mean usage back under the watermark.
                want = max(want, math.ceil(current * obs.kv_usage / th.kv_high))
            target = min(th.max_replicas, want, current + th.max_step)
            reason = reasons[0][0]
            decision = Decision(target, reason, "; ".join(m for _, m in reasons))
            high_since = None
    else:
        high_since = None
        calm = (obs.kv_usage is not None and obs.kv_usage < th.kv_low and obs.waiting_per_replica == 0
                and not obs.unreadable and obs.readable == current)
        if calm:
            low_since = low_since if low_since is not None else now
            if current > th.min_replicas and now - low_since >= th.down_stabilization_s:
                decision = Decision(current - 1, "KVLowWatermark",
                                    f"KV usage {obs.kv_usage:.0%} < {th.kv_low:.0%} for "
                                    f"{now - low_since:.0f}s with nothing waiting")
                low_since = None
        else:
            low_since = None
    return decision, PolicyState(high_since, low_since, shed_seen), obs


def least_loaded(samples: list[ReplicaSample]) -> str | None:
    ok = [s for s in samples if s.ok]
    return min(ok, key=lambda s: (s.load, s.pod)).pod if ok else None
