"""The canary's state machine, as ``status.rollout`` (docs/rollouts.md). Pure.

Two deciders share it:

- ``plan`` (the reconciler, on every reconcile): from the spec's revision, what the stable
  Deployment runs and the last status, which template the stable gets (its own, or the spec's),
  whether a canary runs and at what weight, and the status to write. It starts a canary when the
  spec's revision differs from the stable's, and ends a promotion once the stable has rolled out.
- ``advance`` (the service loop, every second while a canary runs): the step's hold, readiness
  and SLO verdict move the canary to its next step, to Promoting, or back.

Phases: Progressing, Paused (a canary runs), Promoting (the stable rolls to the canary's revision
while the canary carries the traffic at full size), Promoted, RolledBack, Aborted (no canary).
"""
from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timezone

from gpufleet_api.v1alpha1 import RolloutSpec

from ..reconcile.events import Event

PROGRESSING, PAUSED, PROMOTING = "Progressing", "Paused", "Promoting"
PROMOTED, ROLLED_BACK, ABORTED = "Promoted", "RolledBack", "Aborted"
RUNNING = (PROGRESSING, PAUSED)  # a canary is judged and stepped

# Events (reason, message, type)
STARTED, STEP, ROLLED_BACK_EVENT, PROMOTED_EVENT, ABORTED_EVENT = (
    "CanaryStarted", "CanaryStep", "CanaryRolledBack", "CanaryPromoted", "CanaryAborted")


@dataclasses.dataclass(frozen=True)
class Live:
    """What runs: the stable Deployment's revision (None: no stable Deployment yet, or one without
    the label) and whether its rolling update is done (``revision.rolled_out``)."""
    stable_revision: str | None
    stable_rolled_out: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    stable_keeps_template: bool          # apply the live stable template (only its replicas change)
    canary_weight: int | None            # None: no canary Deployment
    promoting: bool                      # the stable rolls with maxSurge 0 / maxUnavailable 1
    rollout: dict                        # status.rollout
    events: tuple[Event, ...] = ()


def canary_replicas(weight_percent: int, stable_replicas: int) -> int:
    """ceil(weight% x the stable's replicas), at least 1."""
    return max(1, math.ceil(weight_percent * stable_replicas / 100))


def _iso(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _since(stamp: str | None, now: datetime) -> float:
    if not stamp:
        return 0.0
    try:
        then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return (now - then).total_seconds()


def _rolling(new: str) -> Plan:
    return Plan(False, None, False, {"stableRevision": new, "canaryWeightPercent": 0})


def plan(spec: RolloutSpec | None, *, unified: bool, new: str, live: Live, previous: dict | None,
         now: datetime) -> Plan:
    """The reconciler's decision; ``new``: the revision of the template built from the spec,
    ``previous``: status.rollout as last written."""
    prev = dict(previous or {})
    if spec is None or spec.strategy != "Canary" or not unified or live.stable_revision is None:
        return _rolling(new)  # today's rolling update (also: the first Deployment, or one from before revisions)
    stable, canary = live.stable_revision, prev.get("canaryRevision")
    if prev.get("phase") == PROMOTING and canary == new:
        if stable == new and live.stable_rolled_out:
            return Plan(False, None, False, {
                "stableRevision": new, "canaryWeightPercent": 0, "phase": PROMOTED, "step": prev.get("step"),
                "message": f"revision {new} promoted: the stable Deployment runs it on every replica; canary removed",
                "stepStartedAt": prev.get("stepStartedAt"), "sli": prev.get("sli") or []},
                (Event(PROMOTED_EVENT, f"revision {new} promoted: every stable replica runs it; canary removed",
                  "Normal"),))
        return Plan(False, 100, True, {**prev, "stableRevision": new, "canaryWeightPercent": 100,
                                       "message": f"promoting {new}: the stable Deployment rolls to it while the "
                                                  f"canary carries the traffic"})
    if stable == new:
        out = {k: v for k, v in prev.items() if k not in ("canaryRevision",)}
        out.update({"stableRevision": new, "canaryWeightPercent": 0})
        events: tuple[Event, ...] = ()
        if canary:  # the spec went back to what the stable runs while a canary ran
            out.update({"phase": ROLLED_BACK, "message": f"the spec is back on the stable revision {new}; "
                                                         f"canary {canary} removed"})
            events = (Event(ROLLED_BACK_EVENT, out["message"], "Normal"),)
        return Plan(False, None, False, out, events)
    # The spec asks for a revision the stable does not run.
    if spec.abort:
        message = (f"spec.rollout.abort is true: revision {new} is not started (the stable stays on {stable}); "
                   f"set abort to false to try it")
        events = ()
        if prev.get("phase") != ABORTED or canary:
            events = (Event(ABORTED_EVENT, f"canary {canary} rolled back: spec.rollout.abort is true" if canary
                       else message, "Warning" if canary else "Normal"),)
        return Plan(True, None, False, {"stableRevision": stable, "canaryWeightPercent": 0, "phase": ABORTED,
                                        "message": message, "sli": prev.get("sli") or []}, events)
    if prev.get("rolledBackRevision") == new:
        out = {k: v for k, v in prev.items() if k != "canaryRevision"}
        out.update({"stableRevision": stable, "canaryWeightPercent": 0, "phase": ROLLED_BACK})
        return Plan(True, None, False, out)
    if canary == new and prev.get("phase") in (PROGRESSING, PAUSED, PROMOTING):
        if prev.get("phase") == PROMOTING:  # the stable has yet to take the new template
            return Plan(False, 100, True, {**prev, "stableRevision": new, "canaryWeightPercent": 100})
        weight = int(prev.get("canaryWeightPercent") or spec.steps[0].weight_percent)
        phase = PAUSED if spec.paused else PROGRESSING
        out = {**prev, "stableRevision": stable, "canaryWeightPercent": weight, "phase": phase}
        if phase != prev.get("phase"):
            out["message"] = _step_message(spec, out)
        return Plan(True, weight, False, out)
    # A new canary (none ran, or the spec moved on from the one that did: it is replaced).
    weight = spec.steps[0].weight_percent
    out = {"stableRevision": stable, "canaryRevision": new, "canaryWeightPercent": weight, "step": 0,
           "phase": PAUSED if spec.paused else PROGRESSING, "stepStartedAt": _iso(now), "sli": []}
    out["message"] = _step_message(spec, out)
    replaced = f" (replacing canary {canary})" if canary and canary != new else ""
    return Plan(True, weight, False, out, (Event(STARTED, f"canary {new} started beside stable {stable}{replaced}: "
                                                     f"{weight}% of new requests", "Normal"),))


def _step_message(spec: RolloutSpec, rollout: dict) -> str:
    step = rollout.get("step") or 0
    hold = spec.steps[min(step, len(spec.steps) - 1)].hold_seconds
    paused = "; paused (spec.rollout.paused)" if rollout.get("phase") == PAUSED else ""
    return (f"canary {rollout.get('canaryRevision')} at step {step + 1} of {len(spec.steps)}: "
            f"{rollout.get('canaryWeightPercent')}% of new requests, holding {hold}s{paused}")


def advance(spec: RolloutSpec, rollout: dict, *, canary_ready: int, canary_desired: int,
            breach: str | None, now: datetime) -> tuple[dict, tuple[Event, ...]]:
    """The service loop's step: ``breach`` names the SLI and numbers of a breach (``analysis``),
    None when every judged SLI is inside the SLO. Returns the new status.rollout (the same dict
    when nothing changed) and the Events to record."""
    canary = rollout.get("canaryRevision")
    if not canary or rollout.get("phase") not in RUNNING:
        return rollout, ()
    steps = spec.steps
    step = min(int(rollout.get("step") or 0), len(steps) - 1)
    elapsed = _since(rollout.get("stepStartedAt"), now)
    all_ready = canary_ready >= canary_desired
    deadline = spec.analysis.progress_deadline_seconds
    why = None
    if spec.abort:
        return rollout, ()  # the reconciler rolls it back (plan)
    if breach:
        why = f"canary {canary} rolled back at {rollout.get('canaryWeightPercent')}%: {breach}"
    elif not all_ready and elapsed > deadline:
        why = (f"canary {canary} rolled back: {canary_ready} of {canary_desired} replicas ready {elapsed:.0f}s "
               f"after step {step + 1} began (analysis.progressDeadlineSeconds {deadline})")
    if why:
        out = {k: v for k, v in rollout.items() if k != "canaryRevision"}
        out.update({"canaryWeightPercent": 0, "phase": ROLLED_BACK, "message": why, "rolledBackRevision": canary})
        return out, (Event(ROLLED_BACK_EVENT, why, "Warning"),)
    if spec.paused:
        if rollout.get("phase") == PAUSED:
            return rollout, ()
        out = {**rollout, "phase": PAUSED}
        out["message"] = _step_message(spec, out)
        return out, ()
    last = len(steps) - 1
    if spec.promote and step < last:
        out = {**rollout, "phase": PROGRESSING, "step": last, "canaryWeightPercent": steps[last].weight_percent,
               "stepStartedAt": _iso(now)}
        out["message"] = _step_message(spec, out) + " (spec.rollout.promote)"
        return out, (Event(STEP, f"canary {canary}: spec.rollout.promote, {out['canaryWeightPercent']}% of new "
                                 f"requests", "Normal"),)
    if rollout.get("phase") == PAUSED:
        rollout = {**rollout, "phase": PROGRESSING}
        rollout["message"] = _step_message(spec, rollout)
    if not all_ready or (elapsed < steps[step].hold_seconds and not spec.promote):
        return rollout, ()
    if step >= last:
        out = {**rollout, "phase": PROMOTING, "canaryWeightPercent": 100,
               "message": f"promoting {canary}: the stable Deployment rolls to it while the canary carries the "
                          f"traffic"}
        return out, (Event(STEP, f"canary {canary} held 100% for {steps[step].hold_seconds}s inside the SLO: "
                            f"promoting the stable Deployment to it", "Normal"),)
    nxt = step + 1
    out = {**rollout, "step": nxt, "canaryWeightPercent": steps[nxt].weight_percent, "stepStartedAt": _iso(now),
           "sli": []}
    out["message"] = _step_message(spec, out)
    return out, (Event(STEP, f"canary {canary}: step {nxt + 1} of {len(steps)}, {steps[nxt].weight_percent}% of new "
                        f"requests", "Normal"),)
