"""The scaling policy: samples of every replica → keep, scale out or scale in.

Out when mean KV usage crosses the high watermark, when the guard sheds, when
requests wait per replica beyond the threshold, or when the guard's p90 queue
time over the last ``QUEUE_WINDOW_S`` exceeds its threshold; in only after
usage stays below the low watermark for the stabilization window with nothing
waiting and every replica readable. Bounded steps, no action while new
replicas are still starting, and an unreadable replica is never taken for an
idle one.

With minReplicas 0, a service with no request arriving and none in flight for
``scale_to_zero_s`` goes to zero (scale-in by KV usage stops at one), and a
service at zero goes to one as soon as a router holds a request for it
(``demand``).

A replica that stays not ready past ``not_ready_grace_s`` (unschedulable,
crash-looping, a model that never loads) must not freeze the service: from
then on decisions are made on the ready replicas, and the observation says so.
"""
from __future__ import annotations

import dataclasses
import math

from .signals import ReplicaSample, bucket_delta, quantile_from_buckets

QUEUE_WINDOW_S = 30.0
QUEUE_QUANTILE = 0.9
NOT_READY_GRACE_S = 600.0  # model download and load can take minutes; the startup probe allows 30

Buckets = tuple[tuple[float, float], ...]


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
    queue_time_s: float = 1.0
    not_ready_grace_s: float = NOT_READY_GRACE_S
    scale_to_zero_s: float | None = None  # None: never to zero (minReplicas >= 1)

    @classmethod
    def from_spec(cls, auto) -> "Thresholds":
        return cls(auto.min_replicas, auto.max_replicas, auto.kv_high_watermark_percent / 100,
                   auto.kv_low_watermark_percent / 100, auto.queue_depth_threshold,
                   auto.scale_up_stabilization_seconds, auto.scale_down_stabilization_seconds,
                   auto.max_scale_up_step, queue_time_s=auto.queue_time_threshold_milliseconds / 1000,
                   scale_to_zero_s=auto.scale_to_zero_after_seconds if auto.min_replicas == 0 else None)


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between ticks (per service, in memory)."""
    high_since: float | None = None
    low_since: float | None = None
    shed_seen: tuple[tuple[str, float], ...] = ()  # per pod cumulative shed counts last tick
    queue_seen: tuple[tuple[str, Buckets], ...] = ()  # per pod cumulative queue-time buckets last tick
    queue_window: tuple[tuple[float, Buckets], ...] = ()  # (when, queue-time observations since the tick before)
    not_ready_since: float | None = None  # since when fewer replicas are ready than wanted
    idle_since: float | None = None  # since when no request arrived and none ran (scale to zero)
    requests_seen: tuple[tuple[str, float], ...] = ()  # per pod cumulative finished requests last tick


@dataclasses.dataclass(frozen=True)
class Observation:
    kv_usage: float | None
    waiting_per_replica: float
    shed_delta: float
    readable: int
    unreadable: list[str]
    queue_p90_s: float | None = None
    not_ready: int = 0              # wanted replicas that are not ready
    not_ready_seconds: float = 0.0  # for how long
    on_ready_only: bool = False     # past the grace: deciding on the ready replicas alone


@dataclasses.dataclass(frozen=True)
class Decision:
    target: int
    reason: str
    message: str


def _queue_window(ok: list[ReplicaSample], state: PolicyState, now: float) -> tuple[tuple, tuple, float | None]:
    """(queue_seen, queue_window, p90 seconds): per-pod deltas, so a pod that comes or goes is no counter reset."""
    before = dict(state.queue_seen)
    tick: dict[float, float] = {}
    for s in ok:
        prev = before.get(s.pod)
        if prev is None:  # a pod's first read: its history is not recent
            continue
        for le, n in bucket_delta(s.queue_buckets, prev):
            tick[le] = tick.get(le, 0.0) + n
    window = tuple((t, b) for t, b in state.queue_window if now - t < QUEUE_WINDOW_S)
    if tick:
        window += ((now, tuple(sorted(tick.items()))),)
    total: dict[float, float] = {}
    for _, b in window:
        for le, n in b:
            total[le] = total.get(le, 0.0) + n
    p90 = quantile_from_buckets(sorted(total.items()), QUEUE_QUANTILE)
    return tuple((s.pod, s.queue_buckets) for s in ok), window, p90


def observe(samples: list[ReplicaSample], state: PolicyState, now: float = 0.0) -> tuple[Observation, PolicyState]:
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
    queue_seen, queue_window, p90 = _queue_window(ok, state, now)
    obs = Observation(kv_usage=kv, waiting_per_replica=waiting, shed_delta=shed, readable=len(ok),
                      unreadable=[s.pod for s in samples if not s.ok], queue_p90_s=p90)
    return obs, dataclasses.replace(state, shed_seen=tuple((s.pod, s.shed_total) for s in ok),
                                    queue_seen=queue_seen, queue_window=queue_window)


def _idle_since(samples: list[ReplicaSample], state: PolicyState, now: float, demand: int) -> float | None:
    """Since when the service has been idle: nothing arrived (finished-request counters unchanged),
    nothing running or waiting, no request held by a router, every replica read. None: busy now."""
    before = dict(state.requests_seen)
    busy = demand > 0 or not samples or any(
        not s.ok or s.pod not in before or s.requests_total != before[s.pod] or s.guard_in_flight
        or s.guard_queued or s.engine_running or s.engine_waiting for s in samples)
    if busy:
        return None
    return state.idle_since if state.idle_since is not None else now


def _to_or_from_zero(th: Thresholds, current: int, samples: list[ReplicaSample], state: PolicyState,
                     now: float, demand: int) -> tuple[Decision | None, PolicyState]:
    if current == 0:
        state = dataclasses.replace(state, idle_since=None, requests_seen=(), high_since=None, low_since=None)
        if demand > 0:
            return Decision(1, "RouterDemand", f"a router holds {demand} request(s) for this service"), state
        return None, state
    idle_since = _idle_since(samples, state, now, demand)
    state = dataclasses.replace(state, idle_since=idle_since,
                                requests_seen=tuple((s.pod, s.requests_total) for s in samples if s.ok))
    assert th.scale_to_zero_s is not None
    if idle_since is not None and now - idle_since >= th.scale_to_zero_s:
        return Decision(0, "Idle", f"no request for {now - idle_since:.0f}s"), \
            dataclasses.replace(state, idle_since=None, high_since=None, low_since=None)
    return None, state


def decide(th: Thresholds, *, current: int, ready: int, samples: list[ReplicaSample], state: PolicyState,
           now: float, demand: int = 0) -> tuple[Decision | None, PolicyState, Observation]:
    """``demand``: requests routers hold for this service (they found no replica to take them)."""
    obs, state = observe(samples, state, now)
    high_since, low_since = state.high_since, state.low_since
    decision = None

    not_ready = max(0, current - ready)
    not_ready_since = (state.not_ready_since if state.not_ready_since is not None else now) if not_ready else None
    not_ready_seconds = now - not_ready_since if not_ready_since is not None else 0.0
    on_ready_only = bool(not_ready) and not_ready_seconds >= th.not_ready_grace_s
    obs = dataclasses.replace(obs, not_ready=not_ready, on_ready_only=on_ready_only,
                              not_ready_seconds=not_ready_seconds)
    state = dataclasses.replace(state, not_ready_since=not_ready_since)

    if current < th.min_replicas or current > th.max_replicas:
        target = max(th.min_replicas, min(th.max_replicas, current))
        decision = Decision(target, "OutOfBounds",
                            f"{current} replicas is outside {th.min_replicas}..{th.max_replicas}")
        return decision, dataclasses.replace(state, high_since=None, low_since=None), obs

    if th.scale_to_zero_s is not None:
        zero, state = _to_or_from_zero(th, current, samples, state, now, demand)
        if zero is not None or current == 0:
            return zero, state, obs

    # Past the grace the replicas that never became ready are not waited for: the
    # sizing and the "every replica readable" test count the ready ones.
    serving = ready if on_ready_only else current
    reasons = []
    if obs.kv_usage is not None and obs.kv_usage >= th.kv_high:
        reasons.append(("KVHighWatermark", f"KV usage {obs.kv_usage:.0%} >= {th.kv_high:.0%}"))
    if obs.shed_delta > 0:
        reasons.append(("Shedding", f"guard refused {obs.shed_delta:.0f} request(s) since the last read"))
    if obs.waiting_per_replica > th.queue_depth:
        reasons.append(("QueueDepth", f"{obs.waiting_per_replica:.1f} waiting per replica > {th.queue_depth}"))
    if obs.queue_p90_s is not None and obs.queue_p90_s > th.queue_time_s:
        reasons.append(("QueueTime", f"p90 queue time {obs.queue_p90_s * 1000:.0f} ms over the last "
                                     f"{QUEUE_WINDOW_S:.0f}s > {th.queue_time_s * 1000:.0f} ms"))

    if reasons:
        low_since = None
        high_since = high_since if high_since is not None else now
        starting = bool(not_ready) and not on_ready_only
        if current < th.max_replicas and not starting and now - high_since >= th.up_stabilization_s:
            want = current + 1
            if obs.kv_usage is not None and obs.kv_usage >= th.kv_high:
                # Enough replicas to bring mean usage back under the watermark.
                want = max(want, math.ceil(serving * obs.kv_usage / th.kv_high))
            target = min(th.max_replicas, want, current + th.max_step)
            decision = Decision(target, reasons[0][0], "; ".join(m for _, m in reasons))
            high_since = None
            state = dataclasses.replace(state, queue_window=())  # that evidence is answered
    else:
        high_since = None
        calm = (obs.kv_usage is not None and obs.kv_usage < th.kv_low and obs.waiting_per_replica == 0
                and not obs.unreadable and obs.readable == serving)
        if calm:
            low_since = low_since if low_since is not None else now
            # Zero is for an idle service only (above), never a step of scaling in by KV usage.
            if current > max(1, th.min_replicas) and now - low_since >= th.down_stabilization_s:
                decision = Decision(current - 1, "KVLowWatermark",
                                    f"KV usage {obs.kv_usage:.0%} < {th.kv_low:.0%} for "
                                    f"{now - low_since:.0f}s with nothing waiting")
                low_since = None
        else:
            low_since = None
    return decision, dataclasses.replace(state, high_since=high_since, low_since=low_since), obs


def least_loaded(samples: list[ReplicaSample]) -> str | None:
    ok = [s for s in samples if s.ok]
    return min(ok, key=lambda s: (s.load, s.pod)).pod if ok else None
