"""The Events a reconcile posts: one per change a human should see in `kubectl describe`, not one per
reconcile (pure: the controller posts them)."""
from __future__ import annotations

from typing import NamedTuple

from . import conditions as cond
from . import drains
from .ownership import CHILD_CONFLICT
from .status import CHILD_REJECTED, Observed, unschedulable_pods


class Event(NamedTuple):
    reason: str
    message: str
    type_: str = "Normal"


def drain_events(previous: dict | None, surge: drains.Surge) -> list[Event]:
    """One Event when the surge for cordoned nodes starts or changes, one when it ends."""
    if not drains.changed(previous, surge):
        return []
    if surge.total:
        return [Event("DrainSurge", drains.message(surge))]
    return [Event("DrainSurgeEnded", (
        f"no engine pod left on a cordoned node ({', '.join((previous or {}).get('nodes') or [])}); "
        f"back to the desired replicas"))]


def transition_events(isvc: dict, previous: dict, updates: list[dict], observed: Observed) -> list[Event]:
    """The Events for the move from ``previous`` (the status before) to the conditions ``updates``."""
    out = []
    old_ready = cond.get(previous.get("conditions"), cond.READY) or {}
    new_ready = cond.get(updates, cond.READY)
    stuck = unschedulable_pods(observed.pods)
    old_prog = cond.get(previous.get("conditions"), cond.PROGRESSING) or {}
    new_prog = cond.get(updates, cond.PROGRESSING)
    told_stuck = bool(stuck) and old_prog.get("reason") != "InsufficientCapacity"
    if told_stuck:
        pod, msg = stuck[0]
        out.append(Event("Unschedulable", f"replica {pod} cannot be placed without breaking "
                                          f"{isvc['spec'].get('isolation', {}).get('mode', 'Dedicated')} isolation "
                                          f"or its pool/product constraints: {msg}", "Warning"))
    if new_ready is None:
        return out
    if new_ready["reason"] in (CHILD_REJECTED, CHILD_CONFLICT):
        if old_ready.get("reason") != new_ready["reason"] or old_ready.get("message") != new_ready["message"]:
            out.append(Event(new_ready["reason"], new_ready["message"], "Warning"))
    elif told_stuck and new_ready["reason"] == "Unschedulable":
        pass  # Ready=False for the replica just reported: one Event says it, not two
    elif new_ready["status"] != old_ready.get("status") or new_ready["reason"] != old_ready.get("reason"):
        kind = "Normal" if new_ready["status"] == "True" else "Warning"
        if old_ready or new_ready["status"] == "True":
            out.append(Event(new_ready["reason"], new_ready["message"], kind))
    if new_prog and new_prog["reason"] == "RollingOut" and old_prog.get("reason") != "RollingOut":
        out.append(Event("RollingOut", new_prog["message"]))
    return out
