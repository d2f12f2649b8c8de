"""Conditions in the Kubernetes API conventions' shape, keyed by type."""
from __future__ import annotations

from datetime import datetime, timezone

from gpufleet_api import name_claims

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
ISOLATED = "Isolated"
SCALING = "Scaling"
FRAGMENTATION_OK = "FragmentationOK"
NAME_CONFLICT = name_claims.CONDITION   # the model name is another namespace's (reconcile/name_conflicts.py)

GATEWAY_READY = "GatewayReady"           # spec.gateway's InferencePool (reconcile/gateway_status.py)

ORDER = [READY, PROGRESSING, DEGRADED, ISOLATED, SCALING, FRAGMENTATION_OK, NAME_CONFLICT, GATEWAY_READY]


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: bool | str, reason: str, message: str = "", *,
              generation: int | None = None) -> dict:
    if isinstance(status, bool):
        status = "True" if status else "False"
    c: dict[str, str | int] = {"type": type_, "status": status, "reason": reason, "message": message}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def merge(previous: list[dict], updates: list[dict], now: str) -> list[dict]:
    """New conditions replace old ones of the same type; lastTransitionTime only
    moves when the status changes. Types not updated are kept."""
    by_type = {c["type"]: c for c in previous or []}
    for u in updates:
        old = by_type.get(u["type"])
        ltt = old["lastTransitionTime"] if old and old.get("status") == u["status"] and \
            old.get("lastTransitionTime") else now
        by_type[u["type"]] = {**u, "lastTransitionTime": ltt}
    return sorted(by_type.values(), key=lambda c: (ORDER.index(c["type"]) if c["type"] in ORDER else 99, c["type"]))


def same(a: list[dict] | None, b: list[dict] | None) -> bool:
    """The same conditions, whatever their order."""
    return {c["type"]: c for c in a or []} == {c["type"]: c for c in b or []}


def get(conditions: list[dict] | None, type_: str) -> dict | None:
    for c in conditions or []:
        if c.get("type") == type_:
            return c
    return None
