"""status.rollout as a merge patch, and the conditions a canary adds. Pure."""
from __future__ import annotations

from ..reconcile import conditions as cond
from . import steps

CANARY = "Canary"
CANARY_ROLLED_BACK = "CanaryRolledBack"


def rollout_patch(current: dict | None, new: dict) -> dict | None:
    """``new`` as the merge patch that turns ``current`` into it: a key ``new`` drops is written as
    null (a merge patch keeps what it does not name). None: remove status.rollout (``new`` empty)."""
    if not new:
        return None
    return {**{k: None for k in (current or {}) if k not in new}, **new}


def rollout_conditions(rollout: dict, updates: list[dict], generation: int) -> list[dict]:
    """The reconciler's conditions with what the canary says: Progressing True (reason Canary) while
    a canary runs or is promoted; Degraded True (reason CanaryRolledBack, the SLI and its numbers)
    after a rollback, while no replica is missing (that says more) and the spec asks for the
    rolled-back revision."""
    phase, message = rollout.get("phase"), rollout.get("message", "")
    out = []
    for u in updates:
        if u["type"] == cond.PROGRESSING and phase in (*steps.RUNNING, steps.PROMOTING) and u["reason"] != \
                "InsufficientCapacity":
            u = cond.condition(cond.PROGRESSING, True, CANARY, message, generation=generation)
        elif u["type"] == cond.DEGRADED and phase == steps.ROLLED_BACK and u["status"] == "False" \
                and rollout.get("rolledBackRevision"):
            u = cond.condition(cond.DEGRADED, True, CANARY_ROLLED_BACK, message, generation=generation)
        out.append(u)
    return out
