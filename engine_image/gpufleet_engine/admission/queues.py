"""Multi-level queue with aging. Pure: callers pass the clock in.

Lower levels go first (L1 interactive before L2 standard before L3
background). Waiting promotes an entry by one level per ``aging_seconds``, so
a background request that has waited long enough competes with interactive
ones by arrival order and cannot starve.

Inside a class, tenants share fairly: each class's lane is a
``fair_share.FairLane`` keyed by the entry's tenant, and the scheduler charges
it the service each tenant receives (``charge``). A class competes with the
level of its longest-waiting entry (aging promises it that), and offers its
fair head, which may be younger. With one tenant (no tenant headers: every
entry is ``UNKNOWN_TENANT``'s) the lane is first come, first served.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, TypeVar

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_engine.admission.fair_share import FairLane
from gpufleet_engine.errors import GuardError

T = TypeVar("T")


class QueueFull(GuardError):
    """The queue already holds ``max_length`` entries."""


@dataclass(eq=False)
class Entry(Generic[T]):
    item: T
    queue_class: QueueClass
    enqueued_at: float
    seq: int
    queued: bool = field(default=True)

    def waited(self, now: float) -> float:
        return now - self.enqueued_at


class MultiLevelQueue(Generic[T]):
    def __init__(self, classes: Iterable[QueueClass], aging_seconds: float, max_length: int):
        self._classes = {c.name: c for c in classes}
        if not self._classes:
            raise ValueError("at least one queue class is needed")
        self._weights: dict[str, int] = {}  # tenants' weights, for every lane (tenant_keys.TenantKeys)
        self._lanes: dict[str, FairLane[Entry[T]]] = {name: FairLane(self._weights) for name in self._classes}
        self._aging = aging_seconds
        self._max_length = max_length
        self._top_level = min(c.level for c in self._classes.values())
        self._seq = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def classes(self) -> list[QueueClass]:
        return list(self._classes.values())

    def depth(self, class_name: str) -> int:
        return len(self._lanes.get(class_name, ()))

    def reconfigure(self, classes: Iterable[QueueClass], aging_seconds: float, max_length: int) -> None:
        """New classes, aging and length (a live config reload). Waiting entries keep their place
        and the class they arrived with; a lane of a class no longer configured is served until
        it is empty, then dropped."""
        new = {c.name: c for c in classes}
        if not new:
            raise ValueError("at least one queue class is needed")
        self._classes = new
        for name in new:
            if name not in self._lanes:
                self._lanes[name] = FairLane(self._weights)
        for name in [n for n, lane in self._lanes.items() if n not in new and not lane]:
            del self._lanes[name]
        self._aging = aging_seconds
        self._max_length = max_length
        self._top_level = min(c.level for c in new.values())

    def weigh(self, tenant: str, weight: int) -> None:
        """``tenant``'s fair-share weight in every class from now on."""
        self._weights[tenant] = weight
        for lane in self._lanes.values():
            lane.weigh(tenant, weight)

    def forget(self, tenant: str) -> None:
        """Drop what the lanes keep of ``tenant`` (no request of it is in the guard)."""
        self._weights.pop(tenant, None)
        for lane in self._lanes.values():
            lane.forget(tenant)

    def ahead(self, queue_class: QueueClass, tenant: str) -> int:
        """About how many queued entries a new one of ``queue_class`` and ``tenant`` would wait
        behind, before aging: every one of a better or equal class, and of its own class its fair
        position (``FairLane.ahead``)."""
        total = 0
        for name, lane in self._lanes.items():
            c = self._classes.get(name)
            if name == queue_class.name:
                total += lane.ahead(tenant)
            elif c is None or c.level <= queue_class.level:
                total += len(lane)
        return total

    def tenants(self) -> set[str]:
        """The tenants any lane keeps a counter or a weight for."""
        return set(self._weights).union(*(lane.tenants() for lane in self._lanes.values()))

    def counter(self, class_name: str, tenant: str) -> float:
        """The service ``tenant`` received in class ``class_name``, over its weight (fair_share.py)."""
        lane = self._lanes.get(class_name)
        return 0.0 if lane is None else lane.counter(tenant)

    def charge(self, class_name: str, tenant: str, prompt_tokens: int = 0, answer_tokens: int = 0) -> None:
        """Service ``tenant`` received in class ``class_name`` (ignored for a class no longer served)."""
        lane = self._lanes.get(class_name)
        if lane is not None:
            lane.charge(tenant, prompt_tokens, answer_tokens)

    def passed(self, class_name: str, tenant: str) -> None:
        """A request of ``tenant`` and class ``class_name`` was dispatched without queueing."""
        lane = self._lanes.get(class_name)
        if lane is not None:
            lane.passed(tenant)

    def push(self, item: T, class_name: str, now: float, tenant: str = UNKNOWN_TENANT) -> Entry[T]:
        if self._size >= self._max_length:
            raise QueueFull(f"queue holds {self._size} requests (maxQueueLength {self._max_length})")
        entry = Entry(item, self._classes[class_name], now, self._seq)
        self._seq += 1
        self._lanes[class_name].append(entry, tenant)
        self._size += 1
        return entry

    def effective_level(self, entry: Entry[T], now: float) -> int:
        promoted = math.floor(max(0.0, entry.waited(now)) / self._aging) if self._aging > 0 else 0
        return max(self._top_level, entry.queue_class.level - promoted)

    def peek(self, now: float) -> Entry[T] | None:
        """The entry ``pop`` would return, left in place."""
        best: Entry[T] | None = None
        best_key: tuple[int, int] | None = None
        for lane in self._lanes.values():
            oldest = lane.oldest()
            if oldest is None:
                continue
            # A class competes with its oldest entry, also its most promoted; it offers its fair head.
            key = (self.effective_level(oldest, now), oldest.seq)
            if best_key is None or key < best_key:
                best, best_key = lane.head(), key
        return best

    def entries(self) -> list[Entry[T]]:
        """Every entry, in no particular order."""
        return [entry for lane in self._lanes.values() for entry in lane]

    def ordered(self, now: float, prompt_tokens: Callable[[T], int] = lambda item: 0) -> list[Entry[T]]:
        """Every entry, in the order ``pop`` would return them if nothing changed meanwhile and each
        were charged its ``prompt_tokens`` when popped."""
        # Per class: its entries in fair order, and by age (its oldest left gives the class's level).
        fair = [lane.ordered(lambda e: prompt_tokens(e.item)) for lane in self._lanes.values() if lane]
        by_age = [sorted(entries, key=lambda e: e.seq) for entries in fair]
        next_fair, next_old = [0] * len(fair), [0] * len(fair)
        taken: set[int] = set()
        out: list[Entry[T]] = []
        for _ in range(sum(map(len, fair))):
            best, best_key = 0, None
            for i, ages in enumerate(by_age):
                while next_old[i] < len(ages) and ages[next_old[i]].seq in taken:
                    next_old[i] += 1
                if next_old[i] == len(ages):
                    continue
                oldest = ages[next_old[i]]
                key = (self.effective_level(oldest, now), oldest.seq)
                if best_key is None or key < best_key:
                    best, best_key = i, key
            entry = fair[best][next_fair[best]]
            next_fair[best] += 1
            taken.add(entry.seq)
            out.append(entry)
        return out

    def pop(self, now: float) -> Entry[T] | None:
        entry = self.peek(now)
        if entry is not None:
            self._lanes[entry.queue_class.name].remove(entry)
            self._size -= 1
            entry.queued = False
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Take out an entry that gave up (timed out, client gone); False if already popped."""
        if not entry.queued:
            return False
        self._lanes[entry.queue_class.name].remove(entry)
        self._size -= 1
        entry.queued = False
        return True
