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

The same policy sizes each pool of a disaggregated service (``autoscale.pools``), each on the
signals that measure its work: ``scale_on_kv`` off for a prefill pool (its KV is the prompts in
flight, not a capacity signal), a TTFT objective for it (the guard's TTFT p99 of prefill pods is
the prefill time), an ITL objective for a decode pool. A latency objective scales out when the
p99 over the last ``LATENCY_WINDOW_S`` exceeds it (from ``MIN_LATENCY_OBSERVATIONS`` on; a few
requests are no p99), and allows a scale-in only below the objective × kv_low / kv_high, the
same hysteresis as the KV watermarks.
"""
from __future__ import annotations

import dataclasses
import math

from .signals import ReplicaSample, bucket_delta, quantile_from_buckets

QUEUE_WINDOW_S = 30.0
QUEUE_QUANTILE = 0.9
LATENCY_WINDOW_S = 60.0
LATENCY_QUANTILE = 0.99
MIN_LATENCY_OBSERVATIONS = 20
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
    scale_on_kv: bool = True              # KV usage over the high watermark scales out
    ttft_p99_s: float | None = None       # scale out when the TTFT p99 exceeds this (None: not a signal)
    itl_p99_s: float | None = None        # scale out when the ITL p99 exceeds this (None: not a signal)

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
    ttft_seen: tuple[tuple[str, Buckets], ...] = ()  # per pod cumulative TTFT buckets last tick
    ttft_window: tuple[tuple[float, Buckets], ...] = ()
    itl_seen: tuple[tuple[str, Buckets], ...] = ()  # per pod cumulative ITL buckets last tick
    itl_window: tuple[tuple[float, Buckets], ...] = ()


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
    ttft_p99_s: float | None = None  # over LATENCY_WINDOW_S; None: not asked for, or too few requests
    itl_p99_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    target: int
    reason: str
    message: str


def _window(ok: list[ReplicaSample], field: str, seen: tuple, window: tuple, now: float,
            span: float) -> tuple[tuple, tuple, Buckets]:
    """(seen, window, observations in the window) of one histogram: per-pod deltas, so a pod that
    comes or goes is no counter reset."""
    before = dict(seen)
    tick: dict[float, float] = {}
    for s in ok:
        prev = before.get(s.pod)
        if prev is None:  # a pod's first read: its history is not recent
            continue
        for le, n in bucket_delta(getattr(s, field), prev):
            tick[le] = tick.get(le, 0.0) + n
    kept = tuple((t, b) for t, b in window if now - t < span)
    if tick:
        kept += ((now, tuple(sorted(tick.items()))),)
    total: dict[float, float] = {}
    for _, b in kept:
        for le, n in b:
            total[le] = total.get(le, 0.0) + n
    return tuple((s.pod, getattr(s, field)) for s in ok), kept, tuple(sorted(total.items()))


def _latency_p99(observations: Buckets) -> float | None:
    if not observations or observations[-1][1] < MIN_LATENCY_OBSERVATIONS:
        return None
    return quantile_from_buckets(list(observations), LATENCY_QUANTILE)


def observe(samples: list[ReplicaSample], state: PolicyState, now: float = 0.0,
            th: Thresholds | None = None) -> tuple[Observation, PolicyState]:
    """``th``: which latency objectives to measure (None: none)."""
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
    queue_seen, queue_window, queued = _window(ok, "queue_buckets", state.queue_seen, state.queue_window, now,
                                               QUEUE_WINDOW_S)
    p90 = quantile_from_buckets(list(queued), QUEUE_QUANTILE)
    obs = Observation(kv_usage=kv, waiting_per_replica=waiting, shed_delta=shed, readable=len(ok),
                      unreadable=[s.pod for s in samples if not s.ok], queue_p90_s=p90)
    state = dataclasses.replace(state, shed_seen=tuple((s.pod, s.shed_total) for s in ok),
                                queue_seen=queue_seen, queue_window=queue_window)
    if th is not None and th.ttft_p99_s is not None:
        seen, window, ttft = _window(ok, "ttft_buckets", state.ttft_seen, state.ttft_window, now, LATENCY_WINDOW_S)
        state = dataclasses.replace(state, ttft_seen=seen, ttft_window=window)
        obs = dataclasses.replace(obs, ttft_p99_s=_latency_p99(ttft))
    if th is not None and th.itl_p99_s is not None:
        seen, window, itl = _window(ok, "itl_buckets", state.itl_seen, state.itl_window, now, LATENCY_WINDOW_S)
        state = dataclasses.replace(state, itl_seen=seen, itl_window=window)
        obs = dataclasses.replace(obs, itl_p99_s=_latency_p99(itl))
    return obs, state


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
    """The decision to or from zero, and the state watched up to ``now`` (an Idle decision's answer
    is the caller's: ``Judgement.answered``)."""
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
        return Decision(0, "Idle", f"no request for {now - idle_since:.0f}s"), state
    return None, state


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What the policy makes of one read of the replicas.

    ``watched``: the state as watching alone leaves it (counters, windows and every since-when
    clock advanced; nothing answered). ``answered``: the state once ``decision`` is carried out
    (the evidence it answers is spent: a scale-out clears the high clock and the latency windows,
    a scale-in the low clock); ``watched`` when there is no decision."""
    decision: Decision | None
    watched: PolicyState
    answered: PolicyState
    obs: Observation


def judge(th: Thresholds, *, current: int, ready: int, samples: list[ReplicaSample], state: PolicyState,
          now: float, demand: int = 0) -> Judgement:
    """``demand``: requests routers hold for this service (they found no replica to take them)."""
    obs, state = observe(samples, state, now, th)

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
        return Judgement(decision, state, dataclasses.replace(state, high_since=None, low_since=None), obs)

    if th.scale_to_zero_s is not None:
        zero, state = _to_or_from_zero(th, current, samples, state, now, demand)
        if zero is not None and zero.target == 0:
            return Judgement(zero, state, dataclasses.replace(state, idle_since=None, high_since=None,
                                                              low_since=None), obs)
        if zero is not None or current == 0:
            return Judgement(zero, state, state, obs)

    # Past the grace the replicas that never became ready are not waited for: the
    # sizing and the "every replica readable" test count the ready ones.
    serving = ready if on_ready_only else current
    reasons = pressure(th, obs)
    if reasons:
        high_since = state.high_since if state.high_since is not None else now
        watched = dataclasses.replace(state, high_since=high_since, low_since=None)
        starting = bool(not_ready) and not on_ready_only
        if current < th.max_replicas and not starting and now - high_since >= th.up_stabilization_s:
            want = max(current + 1, _kv_replicas(th, obs, serving))
            target = min(th.max_replicas, want, current + th.max_step)
            decision = Decision(target, reasons[0][0], "; ".join(m for _, m in reasons))
            # That evidence is answered.
            return Judgement(decision, watched, dataclasses.replace(
                watched, high_since=None, queue_window=(), ttft_window=(), itl_window=()), obs)
        return Judgement(None, watched, watched, obs)
    calm = (obs.kv_usage is not None and obs.kv_usage < th.kv_low and obs.waiting_per_replica == 0
            and not obs.unreadable and obs.readable == serving and _latency_calm(th, obs))
    if not calm:
        watched = dataclasses.replace(state, high_since=None, low_since=None)
        return Judgement(None, watched, watched, obs)
    low_since = state.low_since if state.low_since is not None else now
    watched = dataclasses.replace(state, high_since=None, low_since=low_since)
    # Zero is for an idle service only (above), never a step of scaling in by KV usage.
    if current > max(1, th.min_replicas) and now - low_since >= th.down_stabilization_s:
        decision = Decision(current - 1, "KVLowWatermark",
                            f"KV usage {obs.kv_usage:.0%} < {th.kv_low:.0%} for "
                            f"{now - low_since:.0f}s with nothing waiting")
        return Judgement(decision, watched, dataclasses.replace(watched, low_since=None), obs)
    return Judgement(None, watched, watched, obs)


def decide(th: Thresholds, *, current: int, ready: int, samples: list[ReplicaSample], state: PolicyState,
           now: float, demand: int = 0) -> tuple[Decision | None, PolicyState, Observation]:
    """The leader's step: the decision, and the state once it is carried out."""
    j = judge(th, current=current, ready=ready, samples=samples, state=state, now=now, demand=demand)
    return j.decision, j.answered, j.obs


def follow(th: Thresholds, *, current: int, ready: int, samples: list[ReplicaSample], state: PolicyState,
           now: float) -> Judgement:
    """A follower's step (it acts on nothing): the state it keeps is ``watched``, as if the leader
    watched without acting, so the evidence stays unanswered for the leader it may become; the
    decision is what it would do if it led now (``fleet.takeover`` decides whether a new leader
    carries it out before reading again). Routers' held requests are the leader's to read."""
    return judge(th, current=current, ready=ready, samples=samples, state=state, now=now)


def pressure(th: Thresholds, obs: Observation) -> list[tuple[str, str]]:
    """(reason, message) of every signal that asks for more replicas now."""
    reasons = []
    if th.scale_on_kv and obs.kv_usage is not None and obs.kv_usage >= th.kv_high:
        reasons.append(("KVHighWatermark", f"KV usage {obs.kv_usage:.0%} >= {th.kv_high:.0%}"))
    if obs.shed_delta > 0:
        reasons.append(("Shedding", f"guard refused {obs.shed_delta:.0f} request(s) since the last read"))
    if obs.waiting_per_replica > th.queue_depth:
        reasons.append(("QueueDepth", f"{obs.waiting_per_replica:.1f} waiting per replica > {th.queue_depth}"))
    if obs.queue_p90_s is not None and obs.queue_p90_s > th.queue_time_s:
        reasons.append(("QueueTime", f"p90 queue time {obs.queue_p90_s * 1000:.0f} ms over the last "
                                     f"{QUEUE_WINDOW_S:.0f}s > {th.queue_time_s * 1000:.0f} ms"))
    if th.ttft_p99_s is not None and obs.ttft_p99_s is not None and obs.ttft_p99_s > th.ttft_p99_s:
        reasons.append(("TTFT", f"TTFT p99 {obs.ttft_p99_s * 1000:.0f} ms over the last {LATENCY_WINDOW_S:.0f}s "
                                f"> objective {th.ttft_p99_s * 1000:.0f} ms"))
    if th.itl_p99_s is not None and obs.itl_p99_s is not None and obs.itl_p99_s > th.itl_p99_s:
        reasons.append(("ITL", f"ITL p99 {obs.itl_p99_s * 1000:.0f} ms over the last {LATENCY_WINDOW_S:.0f}s "
                               f"> objective {th.itl_p99_s * 1000:.0f} ms"))
    return reasons


def _kv_replicas(th: Thresholds, obs: Observation, serving: int) -> int:
    """Replicas that bring mean KV usage back under the high watermark (0: KV is not a signal here)."""
    if not th.scale_on_kv or obs.kv_usage is None or obs.kv_usage < th.kv_high:
        return 0
    return math.ceil(serving * obs.kv_usage / th.kv_high)


def _latency_calm(th: Thresholds, obs: Observation) -> bool:
    """The latency objectives leave the headroom a scale-in needs: p99 under the objective ×
    kv_low / kv_high (no p99 yet, too few requests: nothing says otherwise)."""
    share = th.kv_low / th.kv_high
    return all(p99 is None or p99 <= objective * share
               for p99, objective in ((obs.ttft_p99_s, th.ttft_p99_s), (obs.itl_p99_s, th.itl_p99_s))
               if objective is not None)


def least_loaded(samples: list[ReplicaSample]) -> str | None:
    ok = [s for s in samples if s.ok]
    return min(ok, key=lambda s: (s.load, s.pod)).pod if ok else None
