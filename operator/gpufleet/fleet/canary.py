"""The canary's per-second pass (spec.rollout Canary): judge the canary replicas' SLIs over the
step, and move the canary on (``rollout.steps.advance``): next step, Promoting, or rolled back.

A change is written to status.rollout under the service's lock, on the freshest copy, with its
Event first; then the reconcile under the same lock applies it (the canary Deployment's replicas,
the stable's template when promoting, the canary deleted on a rollback). The SLI baselines (each
replica's counters when the step began) live in memory: after an operator restart the step's
window starts again from what the replicas report then (the first step's counts from zero:
its canary replicas started with it).
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Callable, Sequence

from gpufleet_api import InferenceServiceSpec

from ..autoscale.signals import ReplicaSample
from ..rollout import analysis, steps
from ..rollout.status import rollout_patch
from .ports import ServicePorts

log = logging.getLogger(__name__)

# status.rollout.sli is refreshed at most this often between transitions (at most as often as the
# service's figures: ``sli_write_seconds``, the longer of the two).
SLI_WRITE_S = 10.0
# The fields whose change the reconcile must apply.
APPLIED = ("canaryRevision", "canaryWeightPercent", "phase")


def _counters(sample: ReplicaSample) -> dict[str, tuple[float, float]]:
    return {sli: (events, good) for sli, events, good in sample.sli}


class CanaryLoop:
    def __init__(self, ports: ServicePorts, namespace: str, name: str,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sli_write_seconds: float = SLI_WRITE_S):
        self.ports = ports
        self.sli_write_seconds = sli_write_seconds
        self.ns, self.name = namespace, name
        self.wall = wall
        self._window: tuple | None = None  # (canary revision, step) the baselines belong to
        self._baselines: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}  # revision -> pod -> counters
        self._sli_written = -1e9

    def judge(self, spec: InferenceServiceSpec, rollout: dict, pods: Sequence[dict],
              samples: Sequence[ReplicaSample]) -> tuple[list[dict], str | None]:
        """status.rollout.sli rows of both revisions over the step, and the canary's breach (None: none)."""
        assert spec.rollout is not None
        key = (rollout.get("canaryRevision"), rollout.get("step"))
        read = {s.pod: _counters(s) for s in samples if s.ok}
        revision_of = {p["name"]: p.get("revision") for p in pods}
        revisions = [r for r in (rollout.get("canaryRevision"), rollout.get("stableRevision")) if r]
        by_revision = {r: {pod: c for pod, c in read.items() if revision_of.get(pod) == r} for r in revisions}
        if key != self._window:
            self._window = key
            # Every canary replica of the first step started with the canary: counted from zero, so
            # what they served before this loop first saw them (a restart, a slow watch) is judged too.
            self._baselines = {r: ({} if r == key[0] and not key[1] else pods) for r, pods in by_revision.items()}
            log.info("%s/%s: canary %s step %s: SLI window begins (%s)", self.ns, self.name, key[0], key[1],
                     ", ".join(f"{r}: {len(p)} replica(s) read" for r, p in by_revision.items()))
        rows, breach = [], None
        for r in revisions:
            totals = analysis.window(by_revision[r], self._baselines.get(r, {}))
            results = analysis.judge(totals, availability_percent=spec.slo.availability_percent,
                                     min_requests=spec.rollout.analysis.min_requests,
                                     max_burn_rate=spec.rollout.analysis.max_burn_rate)
            rows += analysis.status_rows(r, results)
            if r == rollout.get("canaryRevision"):
                worst = analysis.first_breach(results)
                breach = worst.describe() if worst else None
        return rows, breach

    async def tick(self, body: dict, spec: InferenceServiceSpec, pods: Sequence[dict],
                   samples: Sequence[ReplicaSample], now: float | None = None) -> None:
        assert spec.rollout is not None
        status = body.get("status") or {}
        rollout = status.get("rollout") or {}
        if not rollout.get("canaryRevision") or rollout.get("phase") not in steps.RUNNING:
            self._window = None
            return
        now = time.monotonic() if now is None else now
        canary = [p for p in pods if p.get("revision") == rollout["canaryRevision"] and p.get("track") == "canary"
                  and not p.get("deleting")]
        desired = steps.canary_replicas(int(rollout.get("canaryWeightPercent") or 0),
                                        status.get("desiredReplicas") or 0)
        rows, breach = self.judge(spec, rollout, pods, samples)
        new, events = steps.advance(spec.rollout, rollout, canary_ready=sum(1 for p in canary if p.get("ready")),
                                    canary_desired=desired, breach=breach, now=self.wall())
        transition = any(new.get(k) != rollout.get(k) for k in (*APPLIED, "step"))
        if not transition and new == rollout and (rows == rollout.get("sli")
                                                  or now - self._sli_written < self.sli_write_seconds):
            return
        if new.get("phase") in steps.RUNNING or new.get("phase") == steps.ROLLED_BACK:
            new = {**new, "sli": rows if not transition or new.get("phase") == steps.ROLLED_BACK else []}
        async with self.ports.locks.locked(self.ns, self.name) as fresh:
            if fresh is None:
                return
            current = (fresh.get("status") or {}).get("rollout") or {}
            if any(current.get(k) != rollout.get(k) for k in (*APPLIED, "step")):
                return  # the reconciler moved it meanwhile: decide again on the next tick
            for reason, message, type_ in events:
                await self.ports.events.event(fresh, reason=reason, message=message, type_=type_)
            await self.ports.status.write_status(fresh, {"rollout": rollout_patch(current, new)})
            self._sli_written = now
            if transition:
                log.info("%s/%s: canary %s -> %s %s%% (%s)", self.ns, self.name, rollout.get("phase"),
                         new.get("phase"), new.get("canaryWeightPercent"), new.get("message"))
                await self.ports.locks.reconcile_locked(fresh)
            body["status"] = fresh.get("status") or {}
            body["metadata"]["resourceVersion"] = fresh["metadata"].get("resourceVersion")
