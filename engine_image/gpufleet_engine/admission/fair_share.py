"""Fair shares between tenants inside one queue class: the Virtual Token Counter (VTC) of "Fairness in
Serving Large Language Models" (Sheng et al., OSDI '24). Pure; each queue class of the guard's
``queues.MultiLevelQueue`` is one.

Each tenant has a counter of the service it received, in weighted tokens divided by its declared weight:
a prompt token counts ``prompt_weight``, an answer token ``answer_weight`` (answers cost the engine more
per token; the paper's 1 and 2). The next request is the oldest of the backlogged tenant (one with a
request waiting) whose counter is least, ties to the earliest arrival. So while the class is saturated,
tenants receive service in proportion to their weights whatever their request rates: a flood only
lengthens its own tenant's line.

A tenant that becomes backlogged has its counter lifted to the least counter of the backlogged tenants
(to the last one to leave, when none is), never lowered: time spent idle is not banked as a credit that
would let it take the whole class for a while on its return.

How it fits the guard's queue (``queues.MultiLevelQueue``): a ``FairLane`` has the deque operations a
class's lane uses there (``append`` with the entry's tenant, ``popleft``, ``remove``, ``len``, iteration,
and ``head`` for ``lane[0]``). ``peek`` takes a lane's effective level from ``oldest()`` (aging promises a
class its longest-waiting entry's level; the head the lane offers is the fair one, which may be younger).
The scheduler charges a request's prompt tokens when it dispatches it, and the exchange its answer tokens
as they stream (every 16 events, the rest at the end); a request dispatched with nothing waiting
``passed`` through the lane. Levels still decide between classes; the counters only decide within one.

State: one counter per tenant seen, kept while the tenant is idle (lifting needs it); ``retain`` drops
the tenants no longer declared, ``forget`` one idle tenant. The guard keys its lanes on a bounded set
of tenants (``tenant_keys.TenantKeys``), so the state is bounded whatever the headers say.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable, Generic, Hashable, Iterable, Iterator, Mapping, TypeVar

E = TypeVar("E", bound=Hashable)


class FairLane(Generic[E]):
    def __init__(self, weights: Mapping[str, int] | None = None, prompt_weight: float = 1.0,
                 answer_weight: float = 2.0):
        if prompt_weight < 0 or answer_weight < 0:
            raise ValueError("token weights must not be negative")
        self._weights = dict(weights or {})
        self._prompt_weight = prompt_weight
        self._answer_weight = answer_weight
        self._counters: dict[str, float] = {}
        self._waiting: dict[str, deque[tuple[int, E]]] = {}  # backlogged tenants only
        self._tenant_of: dict[E, str] = {}
        self._last_left = 0.0  # the counter of the last tenant whose line emptied
        self._seq = 0

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._tenant_of))

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def tenants(self) -> set[str]:
        """The tenants a counter is kept for."""
        return set(self._counters)

    def configure(self, weights: Mapping[str, int]) -> None:
        """New weights (a reload); counters are kept."""
        self._weights = dict(weights)

    def weigh(self, tenant: str, weight: int) -> None:
        """``tenant``'s weight from now on (its counter so far is kept)."""
        self._weights[tenant] = weight

    def forget(self, tenant: str) -> None:
        """Drop the counter and weight of ``tenant`` if it has nothing waiting; else nothing."""
        if tenant not in self._waiting:
            self._counters.pop(tenant, None)
            self._weights.pop(tenant, None)

    def retain(self, tenants: Iterable[str]) -> None:
        """Forget the counters of idle tenants not in ``tenants`` (no longer declared)."""
        keep = set(tenants) | set(self._waiting)
        self._counters = {t: c for t, c in self._counters.items() if t in keep}

    def append(self, entry: E, tenant: str) -> None:
        if entry in self._tenant_of:
            raise ValueError("the entry is already in the lane")
        line = self._waiting.get(tenant)
        if line is None:
            floor = min((self._counters[t] for t in self._waiting), default=self._last_left)
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)
            line = self._waiting[tenant] = deque()
        line.append((self._seq, entry))
        self._seq += 1
        self._tenant_of[entry] = tenant

    def passed(self, tenant: str) -> None:
        """An entry of ``tenant`` went straight to the engine with nothing waiting in the lane: as if
        it were appended and taken at once (lifted, then the last to leave). Without this, service
        received while nobody waited would count against the tenant once others arrive."""
        if self._waiting:
            return
        self._counters[tenant] = max(self._counters.get(tenant, 0.0), self._last_left)
        self._last_left = self._counters[tenant]

    def head(self) -> E | None:
        """The entry ``popleft`` would take: the oldest of the backlogged tenant with the least counter."""
        best = self._head_tenant()
        return None if best is None else self._waiting[best][0][1]

    def oldest(self) -> E | None:
        """The entry that has waited longest, whichever its tenant (for aging)."""
        heads = [line[0] for line in self._waiting.values()]
        return min(heads, key=lambda h: h[0])[1] if heads else None

    def ordered(self, prompt_tokens: Callable[[E], int]) -> list[E]:
        """Every entry, in the order ``popleft`` would take them if each were charged its
        ``prompt_tokens`` when taken and nothing else changed (answers are not known yet)."""
        lines = {tenant: list(line) for tenant, line in self._waiting.items()}
        heap = [(self._counters[tenant], line[0][0], tenant) for tenant, line in lines.items()]
        heapq.heapify(heap)
        taken = dict.fromkeys(lines, 0)
        out: list[E] = []
        while heap:
            counter, _, tenant = heapq.heappop(heap)
            line, i = lines[tenant], taken[tenant]
            entry = line[i][1]
            out.append(entry)
            taken[tenant] = i + 1
            if i + 1 < len(line):
                counter += prompt_tokens(entry) * self._prompt_weight / self._weights.get(tenant, 1)
                heapq.heappush(heap, (counter, line[i + 1][0], tenant))
        return out

    def ahead(self, tenant: str) -> int:
        """About how many waiting entries a new entry of ``tenant`` would be served after: its own
        tenant's, and of each other backlogged tenant's as many as its weight's share of the turns
        meanwhile (requests of equal cost, counters about level: a newcomer is lifted to the least).
        With one tenant, the lane's length. O(tenants), for the TTFT control's predicted wait."""
        own = len(self._waiting.get(tenant, ()))
        weight = self._weights.get(tenant, 1)
        return own + sum(min(len(line), math.ceil((own + 1) * self._weights.get(other, 1) / weight))
                         for other, line in self._waiting.items() if other != tenant)

    def popleft(self) -> E:
        tenant = self._head_tenant()
        if tenant is None:
            raise IndexError("pop from an empty lane")
        _, entry = self._waiting[tenant].popleft()
        self._left(entry, tenant)
        return entry

    def remove(self, entry: E) -> None:
        """Take out an entry that gave up; ValueError if it is not in the lane (as deque.remove)."""
        tenant = self._tenant_of.get(entry)
        if tenant is None:
            raise ValueError("the entry is not in the lane")
        line = self._waiting[tenant]
        line.remove(next(item for item in line if item[1] is entry))
        self._left(entry, tenant)

    def charge(self, tenant: str, prompt_tokens: int = 0, answer_tokens: int = 0) -> None:
        """Service ``tenant`` received: a dispatched request's prompt, an answer's tokens."""
        cost = prompt_tokens * self._prompt_weight + answer_tokens * self._answer_weight
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / self._weights.get(tenant, 1)

    def _head_tenant(self) -> str | None:
        best: str | None = None
        best_key: tuple[float, int] | None = None
        for tenant, line in self._waiting.items():
            key = (self._counters[tenant], line[0][0])
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best

    def _left(self, entry: E, tenant: str) -> None:
        del self._tenant_of[entry]
        if not self._waiting[tenant]:
            del self._waiting[tenant]
            self._last_left = self._counters[tenant]
