"""KV-block admission arithmetic. Pure: no clock, no I/O.

A request costs its reservation, ceil((prompt + reserved output) / block
size) per sequence — the reserved output is the whole budget (FullBudget) or
the learned prediction (Predicted, ``demand.py``), extended while the answer
streams past it — and is admitted only if both views agree:

- vLLM's view keeps the watermark free: blocks in use at the last metrics
  read, plus the budgets of requests admitted since (vLLM has not reported
  them yet), minus the budgets of requests finished since (vLLM frees their
  blocks at once; waiting for the next read would idle the pool for up to a
  poll interval after every completion). After the new request's budget,
  at least ``watermark`` blocks must stay free. This view also sees blocks
  the guard does not know about (requests that bypassed it, a guard restart).
- the guard's ledger protects the decodes it admitted: the reservations of
  all its in-flight requests, plus one safety margin, must fit in the pool.
  Predicted reservations are each request's expected blocks, with a
  variance; the margin is ``z`` standard deviations of their sum (``z`` the
  normal quantile of ``quantile``), so the answers in flight together fit at
  that quantile. Full budgets have no variance and need no margin. vLLM only reports what a
  request holds *now*, while a decode keeps growing; admitting on the
  current view alone can run the pool dry mid-decode and force preemptions.
  Extensions (``extend``) may take the reservations past the pool: then
  nothing new is admitted until enough requests finish.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

# vLLM keeps one block of the pool back (its null block): a pool of N blocks
# serves N - 1.
RESERVED_BY_ENGINE = 1
# Of the running sums behind ``held_per_request``, kept at each metrics read: ~20 reads (10 s at
# the default poll) make the average.
HELD_DECAY = 0.95
# The ledger's margin at quantile 1 would be infinite: it stands for this one.
HIGHEST_QUANTILE = 0.9999


@dataclass(frozen=True)
class KvSnapshot:
    """vLLM's KV pool at one metrics read."""
    total_blocks: int
    used_blocks: int

    @classmethod
    def from_usage(cls, total_blocks: int, usage_ratio: float) -> "KvSnapshot":
        # Round up: a partly reported block is a used block.
        used = math.ceil(max(0.0, min(1.0, usage_ratio)) * total_blocks - 1e-9)
        return cls(total_blocks, max(0, used))


def block_cost(prompt_tokens: int, max_tokens: int, block_size: int, sequences: int = 1) -> int:
    """Blocks one request can hold at its longest: ceil((prompt + max_tokens) / block size) per sequence."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return sequences * math.ceil((prompt_tokens + max_tokens) / block_size)


def watermark_blocks(total_blocks: int, percent: int) -> int:
    """Blocks kept free: ``percent`` of the pool, rounded up so a nonzero percent keeps at least one."""
    return math.ceil(total_blocks * percent / 100)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    cost: int
    free_blocks: int      # free in vLLM's view before this request
    watermark: int
    unreserved_blocks: int  # pool capacity not promised to the guard's in-flight requests


class KvLedger:
    """Blocks promised to in-flight requests, against vLLM's last reported usage."""

    def __init__(self, watermark_percent: int, quantile: float = 0.9):
        self.watermark_percent = watermark_percent
        self.quantile = quantile
        self.snapshot: KvSnapshot | None = None
        self._reserved: dict[object, int] = {}
        self._reserved_total = 0
        self._variance: dict[object, float] = {}   # blocks², of the requests with a predicted reservation
        self._variance_total = 0.0
        self._delta_since_read = 0
        self._held_sum = 0.0      # blocks vLLM held at its reads, decayed
        self._in_flight_sum = 0.0  # requests in flight at those reads, decayed alike

    @property
    def quantile(self) -> float:
        return self._quantile

    @quantile.setter
    def quantile(self, q: float) -> None:
        if not 0 < q <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        self._quantile = q
        self._z = max(0.0, NormalDist().inv_cdf(min(q, HIGHEST_QUANTILE)))

    def margin(self, extra_variance: float = 0.0) -> int:
        """Blocks kept for the answers in flight running longer than expected, together."""
        variance = self._variance_total + extra_variance
        return math.ceil(self._z * math.sqrt(variance) - 1e-9) if variance > 0 else 0

    def observe(self, snapshot: KvSnapshot) -> None:
        """A fresh metrics read: its usage already includes what was promised before it."""
        self.snapshot = snapshot
        self._delta_since_read = 0
        if self._reserved:
            self._held_sum = HELD_DECAY * self._held_sum + snapshot.used_blocks
            self._in_flight_sum = HELD_DECAY * self._in_flight_sum + len(self._reserved)

    @property
    def held_per_request(self) -> float | None:
        """Blocks a request in flight holds in vLLM, on average over the last reads (weighted by
        the requests in flight at each); None before a read with requests in flight. Less than
        its reservation: answers grow until they end, and end at different times."""
        return self._held_sum / self._in_flight_sum if self._in_flight_sum else None

    def held_history(self) -> tuple[float, float] | None:
        """(blocks per request in flight, the weight of the reads behind it), or None before any."""
        avg = self.held_per_request
        return None if avg is None else (avg, self._in_flight_sum)

    def seed_held(self, blocks: float, weight: float) -> bool:
        """Start ``held_per_request`` from the service's other replicas (``demand_prior``), as if
        this ledger had read ``weight`` requests in flight holding ``blocks`` each; not once it has
        a read of its own with requests in flight."""
        if self._in_flight_sum or blocks <= 0 or weight <= 0:
            return False
        self._held_sum, self._in_flight_sum = blocks * weight, weight
        return True

    @property
    def known(self) -> bool:
        return self.snapshot is not None

    @property
    def total_blocks(self) -> int:
        return self.snapshot.total_blocks if self.snapshot else 0

    @property
    def capacity(self) -> int:
        return max(0, self.total_blocks - RESERVED_BY_ENGINE)

    @property
    def watermark(self) -> int:
        return watermark_blocks(self.total_blocks, self.watermark_percent)

    @property
    def expected_blocks(self) -> int:
        """Blocks the in-flight requests are expected to hold: their reservations, without the margin."""
        return self._reserved_total

    @property
    def reserved_blocks(self) -> int:
        """Blocks promised to in-flight requests: their reservations and the margin."""
        return self._reserved_total + self.margin()

    @property
    def in_flight(self) -> int:
        return len(self._reserved)

    def free_blocks(self) -> int:
        """Free blocks in vLLM's view, corrected for what the guard admitted and finished since the read."""
        if self.snapshot is None:
            return 0
        used = max(0, self.snapshot.used_blocks + self._delta_since_read)
        return max(0, self.snapshot.total_blocks - used)

    def held_blocks(self) -> int:
        """Blocks vLLM holds in its view, corrected for what the guard admitted and finished since the read."""
        return self.total_blocks - self.free_blocks()

    def unreserved_blocks(self) -> int:
        return self.capacity - self.reserved_blocks

    def evaluate(self, cost: int, variance: float = 0.0) -> Decision:
        """Whether a request of ``cost`` blocks (``variance`` blocks² around them) may be admitted now."""
        free = self.free_blocks()
        mark = self.watermark
        unreserved = self.unreserved_blocks()
        if self.snapshot is None:
            return Decision(False, cost, free, mark, unreserved)
        fits = self._reserved_total + cost + self.margin(variance) <= self.capacity
        if not self._reserved and free == self.snapshot.total_blocks:
            # The pool is idle, so the watermark protects no one: a request
            # bigger than (pool - watermark) would otherwise be refused forever.
            return Decision(fits, cost, free, mark, unreserved)
        return Decision(fits and free - cost >= mark, cost, free, mark, unreserved)

    def try_admit(self, key: object, cost: int, variance: float = 0.0) -> Decision:
        """Reserve ``cost`` blocks for ``key`` if both views allow it."""
        decision = self.evaluate(cost, variance)
        if decision.admitted:
            self._reserved[key] = cost
            self._reserved_total += cost
            self._delta_since_read += cost
            self._set_variance(key, variance)
        return decision

    def _set_variance(self, key: object, variance: float) -> None:
        """``key``'s variance is now ``variance`` (0: none), and the total follows."""
        self._variance_total -= self._variance.pop(key, 0.0)
        if variance > 0:
            self._variance[key] = variance
            self._variance_total += variance
        if not self._variance:
            self._variance_total = 0.0  # no float residue once nothing varies

    def fits_empty(self, cost: int) -> bool:
        """Whether ``cost`` blocks fit the pool with nothing else in it (unknown pool: assume so)."""
        return self.snapshot is None or cost <= self.capacity

    def extend(self, key: object, extra: int, variance: float | None = None) -> None:
        """An admitted request grew past its reservation by ``extra`` blocks: it holds them now.
        ``variance``: around its new reservation (None: unchanged)."""
        if key not in self._reserved:
            return
        if variance is not None:
            self._set_variance(key, variance)
        if extra <= 0:
            return
        self._reserved[key] += extra
        self._reserved_total += extra
        self._delta_since_read += extra

    def resize(self, key: object, cost: int, variance: float = 0.0) -> None:
        """``key``'s reservation is now ``cost`` blocks (``variance`` around them): a request
        admitted before its size was known (``Scheduler.grant_ahead``) is now measured."""
        old = self._reserved.get(key)
        if old is None:
            return
        self._reserved[key] = cost
        self._reserved_total += cost - old
        self._delta_since_read += cost - old
        self._set_variance(key, variance)

    def reservation(self, key: object) -> int:
        return self._reserved.get(key, 0)

    def release(self, key: object) -> None:
        """The request finished (or failed): its budget is no longer promised."""
        cost = self._reserved.pop(key, None)
        self._set_variance(key, 0.0)
        if cost is not None:
            self._reserved_total -= cost
            self._delta_since_read -= cost
