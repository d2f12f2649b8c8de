"""What a new leader does first with what it read as a follower: pure rules, no I/O.

A follower reads every replica every ``--follower-interval-seconds`` into the
same policy state the leader keeps (``policy.follow``), and remembers its last
reading of each service as a ``Warm``. When it takes the Lease over:

- ``first_pass_order``: its first pass goes to the services under pressure
  first (a scale-out due, then a high signal still stabilising, then by KV
  usage), so a surge is answered before the calm services are read;
- ``warm_decision``: a scale-out the last reading asked for is carried out at
  once, without reading the replicas again, when that reading is recent
  (``max_age``) and was made on the replica count and generation that still
  stand. Anything else (a scale-in, a stale or overtaken reading) waits for a
  fresh read: only a surge is worth acting on slightly older figures.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterable, TypeVar

from .policy import Decision, Judgement

K = TypeVar("K", bound=Hashable)

# Audits (fragmentation, stranded GPUs, isolation) wait this long at most for a new leader's first
# pass: their reads and writes must not delay its scale-outs.
AUDITS_WAIT_S = 10.0
# A follower's reading a new leader acts on without reading again is at most this many follower
# intervals old (the last reading, or the one before when the last was still in flight).
WARM_READINGS = 2


@dataclasses.dataclass(frozen=True)
class Warm:
    """A follower's last reading of one service: when, on which replica count and spec
    generation, and what the policy made of it."""
    at: float
    current: int
    generation: int | None
    judgement: Judgement


def warm_decision(warm: Warm | None, *, now: float, max_age: float, current: int,
                  generation: int | None) -> Decision | None:
    """The scale-out a new leader carries out before reading again; None: read first."""
    if warm is None or warm.judgement.decision is None:
        return None
    decision = warm.judgement.decision
    if decision.target <= warm.current:
        return None  # a scale-in (or nothing to do) is never urgent
    if now - warm.at > max_age or warm.current != current or warm.generation != generation:
        return None  # read long ago, or the replicas or the spec changed since
    return decision


def urgency(warm: Warm | None) -> tuple[int, float, float]:
    """Sort key, most pressing first: a scale-out due, a high signal stabilising, the rest;
    then by KV usage and requests waiting; services never read last."""
    if warm is None:
        return (3, 0.0, 0.0)
    j = warm.judgement
    if j.decision is not None and j.decision.target > warm.current:
        rank = 0
    elif j.watched.high_since is not None:
        rank = 1
    else:
        rank = 2
    return (rank, -(j.obs.kv_usage or 0.0), -j.obs.waiting_per_replica)


def first_pass_order(keys: Iterable[K], warm_of: Callable[[K], Warm | None]) -> list[K]:
    """The services of a new leader's first pass, most pressing first (stable otherwise)."""
    return sorted(keys, key=lambda k: urgency(warm_of(k)))
