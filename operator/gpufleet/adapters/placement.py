"""Which replicas hold which LoRA adapter: pure placement, no I/O.

vLLM runs at most ``maxAdaptersPerBatch`` adapters in one batch (GPU slots)
and keeps ``cpuCacheAdapters`` of them in memory; an adapter outside that cache
is read from disk again before its request runs, and another is evicted. When
every replica registers every adapter and a router spreads requests evenly,
each replica sees every adapter, and once adapters outnumber the cache each
request risks a load (llm-d-router#709's "eviction storms").

So each adapter is held by a bounded set of replicas sized by its traffic:

- ``wanted`` replicas = its share of all adapter traffic times the replicas,
  over ``TARGET_SHARE`` (a replica should carry at most that share of an
  adapter's load), rounded up, at least 1 (or ``minReplicas``), at most the
  replicas (or ``maxReplicas``);
- adapters are placed hottest first, each on the least-loaded replicas (load:
  the traffic shares placed there) that still have room in the cache
  (``capacity``); when every cache is full, on the least-loaded replicas under
  the hard limit (``limit``: the guard's ``maxAdapters``), where it will be
  evicted and loaded again at times; with no room at all it is left out
  (TooManyAdapters);
- replicas that hold an adapter now keep it while it is still wanted there
  (a move costs a load on the new replica), so placement changes only when
  traffic or replicas do; but when keeping them leaves the busiest replica
  more than ``MOVE_SLACK`` above what a placement from scratch would give it
  (a placement made before any traffic, when every adapter counted the same),
  the placement from scratch is taken, matched to the current holders.

Traffic is requests per second; with no traffic yet every adapter counts the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

# A replica should carry at most this share of one adapter's traffic before the adapter gets another.
TARGET_SHARE = 0.8
# Sticky holders are kept while the busiest replica's adapter traffic stays within this fraction above
# what a placement from scratch gives it; past that the placement from scratch is taken (its replicas
# matched to the current holders to move as few adapters as it can): stickiness cannot freeze a
# placement made before the traffic was known.
MOVE_SLACK = 0.1


@dataclass
class Placement:
    holders: dict[str, list[str]]                      # adapter → replicas, in replica order
    unplaced: list[str] = field(default_factory=list)  # adapters no replica has room for
    overflowing: list[str] = field(default_factory=list)  # replicas holding more than their cache

    def adapters_on(self, replica: str) -> list[str]:
        return sorted(a for a, rs in self.holders.items() if replica in rs)


def wanted_replicas(rate: float, total: float, count: int, replicas: int,
                    bounds: tuple[int, int] | None = None) -> int:
    """How many replicas should hold an adapter with ``rate`` of ``total`` adapter traffic."""
    if replicas == 0:
        return 0
    share = rate / total if total > 0 else 1.0 / max(count, 1)
    wanted = max(1, math.ceil(share * replicas / TARGET_SHARE - 1e-9))
    low, high = bounds or (1, replicas)
    return max(min(wanted, high, replicas), min(low, replicas), 1)


def place(adapters: Mapping[str, float], replicas: Sequence[str], capacity: int,
          current: Mapping[str, Collection[str]] | None = None,
          bounds: Mapping[str, tuple[int, int]] | None = None, limit: int | None = None) -> Placement:
    """Place ``adapters`` (name → requests/s) on ``replicas``; ``capacity`` adapters fit one
    replica's cache, ``limit`` (default ``capacity``) is the most one replica may hold."""
    sticky = _place(adapters, replicas, capacity, current, bounds, limit)
    if not current:
        return sticky
    fresh = _place(adapters, replicas, capacity, None, bounds, limit)
    if _busiest(sticky, adapters, replicas) <= _busiest(fresh, adapters, replicas) * (1 + MOVE_SLACK) + 1e-9:
        return sticky
    return _matched(fresh, current, replicas)


def _busiest(p: Placement, adapters: Mapping[str, float], replicas: Sequence[str]) -> float:
    """The largest adapter traffic one replica carries (each adapter's split evenly over its holders)."""
    load = dict.fromkeys(replicas, 0.0)
    for a, rs in p.holders.items():
        for r in rs:
            load[r] += max(adapters.get(a, 0.0), 0.0) / len(rs)
    return max(load.values(), default=0.0)


def _matched(p: Placement, current: Mapping[str, Collection[str]], replicas: Sequence[str]) -> Placement:
    """``p`` with its replicas renamed (a permutation: every replica is alike) so that as many
    adapters as it can stay where they are now; pairs by the most adapters in common first."""
    wanted = {r: set(p.adapters_on(r)) for r in replicas}
    have = {r: {a for a, rs in current.items() if r in rs} for r in replicas}
    pairs = sorted(((len(wanted[f] & have[c]), f, c) for f in replicas for c in replicas),
                   key=lambda t: (-t[0], replicas.index(t[1]), replicas.index(t[2])))
    rename: dict[str, str] = {}
    for _, f, c in pairs:
        if f not in rename and c not in rename.values():
            rename[f] = c
    holders = {a: sorted((rename[r] for r in rs), key=replicas.index) for a, rs in p.holders.items()}
    return Placement(holders, p.unplaced, sorted((rename[r] for r in p.overflowing), key=replicas.index))


def _place(adapters: Mapping[str, float], replicas: Sequence[str], capacity: int,
           current: Mapping[str, Collection[str]] | None,
           bounds: Mapping[str, tuple[int, int]] | None, limit: int | None) -> Placement:
    current = current or {}
    bounds = bounds or {}
    limit = max(limit if limit is not None else capacity, capacity)
    ready = list(replicas)
    total = sum(max(r, 0.0) for r in adapters.values())
    count = len(adapters)
    share = {a: (max(r, 0.0) / total if total > 0 else 1.0 / max(count, 1)) for a, r in adapters.items()}
    load = {r: 0.0 for r in ready}
    held = {r: 0 for r in ready}
    holders: dict[str, list[str]] = {}
    unplaced: list[str] = []
    # Hottest first; ties by name so the answer does not depend on the mapping's order.
    for adapter in sorted(adapters, key=lambda a: (-share[a], a)):
        wanted = wanted_replicas(adapters[adapter], total, count, len(ready), bounds.get(adapter))
        per_replica = share[adapter] / max(wanted, 1)
        now = set(current.get(adapter, ()))
        chosen: list[str] = []
        # Room in a cache first, then up to the hard limit; within each, the replicas that
        # hold it now first (no load), then the least loaded.
        for room, holding in ((capacity, True), (capacity, False), (limit, True), (limit, False)):
            if len(chosen) >= wanted:
                break
            free = sorted((r for r in ready if r not in chosen and held[r] < room and (r in now) == holding),
                          key=lambda r: (load[r], held[r], r))
            chosen += free[:wanted - len(chosen)]
        if not chosen:
            unplaced.append(adapter)
            continue
        for r in chosen:
            load[r] += per_replica
            held[r] += 1
        holders[adapter] = sorted(chosen, key=ready.index)
    return Placement(holders, sorted(unplaced), sorted(r for r in ready if held[r] > capacity))
