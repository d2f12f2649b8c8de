"""Multi-level queue with aging. Pure: callers pass the clock in.

Lower levels go first (L1 interactive before L2 standard before L3
background). FIFO inside a class. Waiting promotes an entry by one level per
``aging_seconds``, so a background request that has waited long enough
competes with interactive ones by arrival order and cannot starve.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Iterable, TypeVar

from gpufleet_api.guard.guard_config import QueueClass
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
        self._lanes: dict[str, deque[Entry[T]]] = {name: deque() for name in self._classes}
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
            self._lanes.setdefault(name, deque())
        for name in [n for n, lane in self._lanes.items() if n not in new and not lane]:
            del self._lanes[name]
        self._aging = aging_seconds
        self._max_length = max_length
        self._top_level = min(c.level for c in new.values())

    def push(self, item: T, class_name: str, now: float) -> Entry[T]:
        if self._size >= self._max_length:
            raise QueueFull(f"queue holds {self._size} requests (maxQueueLength {self._max_length})")
        entry = Entry(item, self._classes[class_name], now, self._seq)
        self._seq += 1
        self._lanes[class_name].append(entry)
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
            if not lane:
                continue
            # The head of a lane is its oldest entry, hence also its most promoted.
            head = lane[0]
            key = (self.effective_level(head, now), head.seq)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def entries(self) -> list[Entry[T]]:
        """Every entry, in no particular order."""
        return [entry for lane in self._lanes.values() for entry in lane]

    def ordered(self, now: float) -> list[Entry[T]]:
        """Every entry, in the order ``pop`` would return them if nothing changed meanwhile."""
        return sorted(self.entries(), key=lambda e: (self.effective_level(e, now), e.seq))

    def pop(self, now: float) -> Entry[T] | None:
        entry = self.peek(now)
        if entry is not None:
            self._lanes[entry.queue_class.name].popleft()
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
