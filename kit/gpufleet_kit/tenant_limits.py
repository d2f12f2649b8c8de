"""Per-tenant limits that refill: requests per second, tokens per minute and requests in flight (pure:
callers pass the clock in).

Each rate is a token bucket: it holds at most one period's worth (a second's requests, a minute's
tokens), refills continuously at the declared rate, and a request takes from it. A refusal says when the
budget it lacks will have refilled: its Retry-After, in whole seconds rounded up, so a client that
waits that long finds room (unless others of the same tenant took it first).

Tokens are charged in two steps: at admission an estimate (the prompt plus the answer's expected length),
at the end the real count corrects it (``Limiter.finish``): an answer longer than its estimate leaves the
bucket in debt, which later requests wait for; a shorter one gives the difference back. A request whose
estimate exceeds a whole minute's worth is admitted from a full bucket (else it could never be) and
leaves the bucket in debt.

State is kept for declared tenants only (``configure``), so it is bounded by the declaration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal, Mapping

from gpufleet_api.tenants.declaration import TenantLimits

Limit = Literal["requests_per_second", "tokens_per_minute", "concurrent_requests"]
# Retry-After for a refusal at the concurrency limit: when one of the tenant's requests ends is not known.
CONCURRENCY_RETRY_SECONDS = 1
_EPSILON = 1e-9  # float noise must not round a whole second up to the next one


class TokenBucket:
    """Up to ``capacity`` units, refilled at ``rate`` per second; may go below zero (a debt)."""

    def __init__(self, capacity: float, rate: float, now: float):
        if capacity <= 0 or rate <= 0:
            raise ValueError(f"a bucket needs a positive capacity and rate, got {capacity} and {rate}")
        self.capacity = capacity
        self.rate = rate
        self._level = capacity
        self._at = now

    def level(self, now: float) -> float:
        return min(self.capacity, self._level + max(0.0, now - self._at) * self.rate)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (at most a full bucket is asked for); 0 if now."""
        need = min(amount, self.capacity)
        return max(0.0, (need - self.level(now)) / self.rate)

    def take(self, amount: float, now: float) -> None:
        """Take ``amount`` (negative gives back, never above capacity)."""
        self._level = min(self.capacity, self.level(now) - amount)
        self._at = max(self._at, now)

    def resize(self, capacity: float, rate: float, now: float) -> None:
        """New limits (a reload): the level kept, cut to the new capacity; refilling at the new rate."""
        level = self.level(now)
        self.capacity, self.rate = capacity, rate
        self._level, self._at = min(capacity, level), max(self._at, now)


@dataclass(frozen=True)
class Refusal:
    """Over ``limit``: HTTP 429, ``Retry-After: retry_after_seconds``."""
    tenant: str
    limit: Limit
    retry_after_seconds: int

    @property
    def message(self) -> str:
        what = {"requests_per_second": "requests per second", "tokens_per_minute": "tokens per minute",
                "concurrent_requests": "requests in flight"}[self.limit]
        return (f"Tenant {self.tenant!r} is over its limit of {what}. "
                f"Retry after {self.retry_after_seconds} s.")


@dataclass(eq=False)
class Ticket:
    """An admitted request: what it was charged, to be corrected by ``Limiter.finish``."""
    tenant: str
    estimated_tokens: int
    finished: bool = field(default=False)


@dataclass
class _State:
    limits: TenantLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


def retry_after(seconds: float) -> int:
    """``seconds`` as a Retry-After: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(seconds - _EPSILON))


class Limiter:
    """The limits of a namespace's tenants."""

    def __init__(self, limits: Mapping[str, TenantLimits], now: float):
        self._states: dict[str, _State] = {}
        self.configure(limits, now)

    def configure(self, limits: Mapping[str, TenantLimits], now: float) -> None:
        """The declared limits (start and reload share this path). A tenant kept keeps its budget and its
        requests in flight, so a reload neither resets a budget nor forgets a debt; a tenant gone is
        forgotten."""
        states: dict[str, _State] = {}
        for tenant, lim in limits.items():
            old = self._states.get(tenant)
            states[tenant] = _State(
                lim,
                _bucket(old.requests if old else None, lim.requests_per_second, 1.0, now),
                _bucket(old.tokens if old else None, lim.tokens_per_minute, 60.0, now),
                old.in_flight if old else 0)
        self._states = states

    def admit(self, tenant: str, estimated_tokens: int, now: float) -> Ticket | Refusal:
        """Charge one request and ``estimated_tokens`` to ``tenant``, or refuse it naming the limit that
        refills last (all of them must have room) and when. Nothing is charged on a refusal."""
        state = self._states.get(tenant)
        if state is None:
            raise LookupError(f"tenant {tenant!r} is not declared: identify callers before limiting them")
        refusals: list[tuple[float, Limit]] = []
        if state.requests is not None and (w := state.requests.wait(1, now)) > 0:
            refusals.append((w, "requests_per_second"))
        if state.tokens is not None and (w := state.tokens.wait(estimated_tokens, now)) > 0:
            refusals.append((w, "tokens_per_minute"))
        cap = state.limits.concurrent_requests
        if cap is not None and state.in_flight >= cap:
            refusals.append((CONCURRENCY_RETRY_SECONDS, "concurrent_requests"))
        if refusals:
            wait, limit = max(refusals)
            return Refusal(tenant, limit, retry_after(wait))
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(estimated_tokens, now)
        state.in_flight += 1
        return Ticket(tenant, estimated_tokens)

    def finish(self, ticket: Ticket, real_tokens: int, now: float) -> None:
        """``ticket``'s request ended having used ``real_tokens`` (prompt plus answer): the estimate
        corrected, its place in flight freed. Once per ticket; again does nothing."""
        if ticket.finished:
            return
        ticket.finished = True
        state = self._states.get(ticket.tenant)
        if state is None:
            return  # the tenant was removed while the request ran
        if state.tokens is not None:
            state.tokens.take(real_tokens - ticket.estimated_tokens, now)
        state.in_flight = max(0, state.in_flight - 1)

    def used(self, now: float) -> Iterator[tuple[str, Limit, float]]:
        """(tenant, limit, share in use now) for each declared limit: a bucket's share taken (over 1 while
        in debt), requests in flight over the concurrency limit."""
        for tenant, state in self._states.items():
            buckets: tuple[tuple[Limit, TokenBucket | None], ...] = (("requests_per_second", state.requests),
                                                                     ("tokens_per_minute", state.tokens))
            for limit, bucket in buckets:
                if bucket is not None:
                    yield tenant, limit, (bucket.capacity - bucket.level(now)) / bucket.capacity
            cap = state.limits.concurrent_requests
            if cap is not None:
                yield tenant, "concurrent_requests", state.in_flight / cap

    def in_flight(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return state.in_flight if state else 0


def _bucket(old: TokenBucket | None, per_period: int | None, period: float, now: float) -> TokenBucket | None:
    if per_period is None:
        return None
    if old is None:
        return TokenBucket(per_period, per_period / period, now)
    old.resize(per_period, per_period / period, now)
    return old
