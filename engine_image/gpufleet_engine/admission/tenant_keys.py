"""The tenants the guard keys its fair lanes on (fair_share.py), from the headers the router sets.

The router names a request's tenant in ``GUARD_TENANT_HEADER`` and its declared weight in
``GUARD_WEIGHT_HEADER``, after dropping the copies a client sent (gpufleet_api.tenants.usage). Anything
that reaches the guard's port can send them too, so the guard bounds what it keeps: at most
``MAX_TENANTS`` named tenants (as many as a declaration may hold) plus ``UNKNOWN_TENANT``, the key of
requests without a tenant, with a name that is no DNS label (no declared tenant's), or arriving while
every named key is in use. A named tenant with no request in the guard is forgotten, least recently seen
first, when a new name needs its place; its counters go with it (``on_forget``), which costs it nothing
lasting: a tenant that returns is lifted to the others' level (fair_share.py).

A weight that is missing, not an integer, or outside 1..1000 counts as 1, and one outside is clamped;
``UNKNOWN_TENANT`` always weighs 1: it is nobody's declared weight. Pure: the HTTP layer passes headers in.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Callable

from gpufleet_api.tenants.declaration import MAX_TENANTS, UNKNOWN_TENANT
from gpufleet_api.v1alpha1.common import DNS_LABEL

MIN_WEIGHT, MAX_WEIGHT = 1, 1000
_NAME = re.compile(DNS_LABEL)


def tenant_name(header: str | None) -> str:
    """The tenant a header names: a DNS label of at most 63 characters, else ``UNKNOWN_TENANT``."""
    if header is None:
        return UNKNOWN_TENANT
    name = header.strip()
    return name if len(name) <= 63 and _NAME.fullmatch(name) else UNKNOWN_TENANT


def tenant_weight(header: str | None) -> int:
    """The weight a header gives: an integer clamped to 1..1000; 1 when missing or not an integer."""
    text = "" if header is None else header.strip()
    if not (text.isascii() and text.isdigit()):
        return MIN_WEIGHT
    digits = text.lstrip("0")
    if len(digits) > len(str(MAX_WEIGHT)):
        return MAX_WEIGHT
    return min(MAX_WEIGHT, max(MIN_WEIGHT, int(digits or "0")))


class TenantKeys:
    """Named tenants with requests in the guard (and the recently seen), at most ``capacity``."""

    def __init__(self, on_weigh: Callable[[str, int], None], on_forget: Callable[[str], None],
                 capacity: int = MAX_TENANTS):
        self._on_weigh = on_weigh
        self._on_forget = on_forget
        self._capacity = capacity
        # Per named tenant: its requests in the guard now, and its weight; least recently seen first.
        self._open: OrderedDict[str, int] = OrderedDict()
        self._weights: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def tenants(self) -> list[str]:
        """The named tenants kept, least recently seen first."""
        return list(self._open)

    def enter(self, name: str, weight: int) -> str:
        """A request of tenant ``name`` with ``weight`` arrived: the key it is queued and charged
        under until ``leave``."""
        if name == UNKNOWN_TENANT:
            return UNKNOWN_TENANT
        if name in self._open:
            self._open.move_to_end(name)
        elif len(self._open) < self._capacity or self._evict_one():
            self._open[name] = 0
        else:
            return UNKNOWN_TENANT
        self._open[name] += 1
        if self._weights.get(name) != weight:
            self._weights[name] = weight
            self._on_weigh(name, weight)
        return name

    def leave(self, key: str) -> None:
        """A request entered under ``key`` is done with the guard."""
        if key in self._open:
            self._open[key] -= 1

    def _evict_one(self) -> bool:
        idle = next((name for name, count in self._open.items() if count == 0), None)
        if idle is None:
            return False
        del self._open[idle]
        del self._weights[idle]
        self._on_forget(idle)
        return True
