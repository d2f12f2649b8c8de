"""What the router does when every replica it tried refused a request (pure).

At ``maxReplicas`` no replica is coming: the client gets the refusal at once,
with the earliest Retry-After any replica gave, and a client that honours it
is served. Below ``maxReplicas`` the refusals are the shedding the autoscaler
adds a replica for, so the router keeps the request and tries again after the
replicas' earliest hint (a new replica, or room on the old ones), for at most
as long as a replica takes to start; only then does the client get the 429.
"""
from __future__ import annotations

MIN_WAIT_SECONDS = 0.2
DEFAULT_WAIT_SECONDS = 1.0


def wait_before_retrying(replicas: int, max_replicas: int, hints: list[float], remaining: float) -> float | None:
    """Seconds to hold the request before trying the replicas again, or None to answer the refusal now.

    ``replicas``: the service's replicas now; ``hints``: the Retry-After seconds the refusals carried;
    ``remaining``: how much longer the request may be held."""
    if replicas >= max_replicas or remaining <= MIN_WAIT_SECONDS:
        return None
    wait = min(hints) if hints else DEFAULT_WAIT_SECONDS
    return max(MIN_WAIT_SECONDS, min(wait, remaining))
