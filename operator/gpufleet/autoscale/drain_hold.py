"""The autoscaler during a node drain: no scale-in while the replacements of pods on cordoned nodes run
(``reconcile.drains``' surge)."""
from __future__ import annotations

from collections.abc import Mapping

from ..reconcile.drains import surging
from .policy import Decision


def hold_scale_in(status: Mapping, decision: Decision | None, current: int) -> Decision | None:
    """No scale-in while replacements for pods on cordoned nodes run (status.drain): the surge is not
    capacity the autoscaler decided, and a scale-in then could remove the replacement a drain waits for."""
    if decision is not None and decision.target < current and surging(status):
        return None
    return decision
