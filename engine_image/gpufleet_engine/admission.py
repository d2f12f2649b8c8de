"""KV-block admission arithmetic. Pure: no clock, no I/O.

The guard admits a request only if, after granting its whole block budget,
at least the watermark of blocks stays free. Two views of "used" are combined
and the larger one wins:

- vLLM's view: blocks in use at the last metrics read, plus the budgets of
  requests admitted since then (vLLM has not reported them yet), minus the
  budgets of requests finished since then (vLLM frees their blocks at once;
  waiting for the next read would leave the pool idle for up to a poll
  interval after every completion);
- the guard's ledger: the full budgets (prompt + max_tokens) of every request
  it has in flight. vLLM only counts blocks a request holds *now*, while a
  decoding request keeps growing to its budget; admitting against vLLM's view
  alone lets the pool run dry mid-decode and forces preemptions.

vLLM's view still matters for blocks the guard does not know about (requests
that bypassed it, a guard restart with requests still running).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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
    free_blocks: int      # free as seen before this request
    watermark: int

    @property
    def free_after(self) -> int:
        return self.free_blocks - self.cost


class KvLedger:
    """Blocks promised to in-flight requests, against vLLM's last reported usage."""

    def __init__(self, watermark_percent: int):
        self.watermark_percent = watermark_percent
        self.snapshot: KvSnapshot | None = None
        self._reserved: dict[object, int] = {}
        self._reserved_total = 0
        self._delta_since_read = 0

    def observe(self, snapshot: KvSnapshot) -> None:
        """A fresh metrics read: its usage already includes what was promised before it."""
        self.snapshot = snapshot
        self._delta_since_read = 0

    @property
    def known(self) -> bool:
        return self.snapshot is not None

    @property
    def total_blocks(self) -> int:
        return self.snapshot.total_blocks if self.snapshot else 0

    @property
    def watermark(self) -> int:
        return watermark_blocks(self.total_blocks, self.watermark_percent)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved_total

    @property
    def in_flight(self) -> int:
        return len(self._reserved)

    def free_blocks(self) -> int:
        """Free blocks as the guard sees them (may be negative when over-committed)."""
        if self.snapshot is None:
            return 0
        seen_by_vllm = max(0, self.snapshot.used_blocks + self._delta_since_read)
        return self.snapshot.total_blocks - max(seen_by_vllm, self._reserved_total)

    def evaluate(self, cost: int) -> Decision:
        free = self.free_blocks()
        mark = self.watermark
        if self.snapshot is None:
            return Decision(False, cost, free, mark)
        if not self._reserved and free == self.snapshot.total_blocks and cost <= free:
            # The pool is idle, so the watermark protects no one: a request
            # bigger than (pool - watermark) would otherwise be refused forever.
            return Decision(True, cost, free, mark)
        return Decision(free - cost >= mark, cost, free, mark)

    def try_admit(self, key: object, cost: int) -> Decision:
        """Reserve ``cost`` blocks for ``key`` if that keeps the watermark free."""
        decision = self.evaluate(cost)
        if decision.admitted:
            self._reserved[key] = cost
            self._reserved_total += cost
            self._delta_since_read += cost
        return decision

    def release(self, key: object) -> None:
        """The request finished (or failed): its budget is no longer promised."""
        cost = self._reserved.pop(key, None)
        if cost is not None:
            self._reserved_total -= cost
            self._delta_since_read -= cost
