"""A service's autoscaler: the decisions of the pure policies (``autoscale.policy``,
``autoscale.pools``) applied, and the Scaling condition.

A unified service is sized by its replicas' signals and the requests routers hold for it
(``autoscale``). A disaggregated one in Auto mode has each pool sized by its own signals
(``autoscale_pools``), the decode pool then held to the measured prefill:decode ratio under
ratioPolicy Bound (``ratio_meter``): a decision writes the pool's ``status.pools[].desiredReplicas``,
which the reconciler applies to the pool's Deployment (``reconcile.replicas.desired_replicas``), and
``status.lastScaling.role`` and the Event name the pool. No scale-in while a drain's surge runs
(``autoscale.drain_hold``).

A decision is applied under the service's lock in the ``Controller`` (``act``), so it and a
reconcile never interleave: one Event, the status write (the tick's figures ride along), the
metric, and the scale-in mark on the least-loaded replica (``scale_in_marks``). A follower keeps
the same policy state warm (``follow``) and, on taking the Lease over, carries out the scale-out
its last reading asked for (``take_over``).
"""
from __future__ import annotations

import logging
from typing import Sequence

from gpufleet_api import InferenceServiceSpec
from gpufleet_api.guard.guard_config import Role
from gpufleet_kit.kube.errors import ApiError

from ..autoscale import policy
from ..autoscale import pools as pool_policy
from ..autoscale.drain_hold import hold_scale_in
from ..autoscale.signals import ReplicaSample
from ..autoscale.takeover import Warm, warm_decision
from ..manifests.pools import POOL_ROLES
from ..reconcile import conditions as cond
from ..reconcile import ratio as ratio_status
from ..reconcile.figures import FigurePacer
from ..reconcile.replicas import desired_replicas
from .pod_views import samples_by_role
from .ports import ServicePorts
from .scale_in_marks import ScaleInMarks

log = logging.getLogger(__name__)

# Scaling=True while ratioPolicy Bound keeps the decode pool from where its signals want it.
HELD_BY_RATIO = "HeldByRatio"
# One pool as the Scaling condition sees it: its role, what the policy observed, the replicas
# wanted and ready, and its thresholds.
PoolView = tuple[Role, policy.Observation, int, int, policy.Thresholds]


class ServiceAutoscaler:
    """``marks``: the scale-in marks it sets and clears; ``figures``: the service loop's pacer of the
    status figures (a decision's status write carries them)."""

    def __init__(self, ports: ServicePorts, namespace: str, name: str, marks: ScaleInMarks,
                 figures: FigurePacer):
        self.ports = ports
        self.ns, self.name = namespace, name
        self.marks = marks
        self.figures = figures
        self.state = policy.PolicyState()
        self.pool_states: dict[Role, policy.PolicyState] = {role: policy.PolicyState() for role in POOL_ROLES}
        self.scaled_in_this_pass = False

    def new_pass(self) -> None:
        self.scaled_in_this_pass = False

    def scaling_in(self) -> bool:
        """A scale-in this pass, or a replica still marked for one."""
        return self.scaled_in_this_pass or bool(self.marks.removals)

    # --- deciding -------------------------------------------------------------------------

    async def autoscale(self, body: dict, spec: InferenceServiceSpec, samples: list[ReplicaSample], now: float,
                        fields: dict, demand: int = 0) -> list[dict]:
        """Decide on the samples; act on a decision (and write ``fields`` with it).
        Returns the Scaling condition to write when there is no action but its state changed."""
        status = body.get("status") or {}
        current = status.get("desiredReplicas") or spec.autoscaling.min_replicas
        ready = status.get("readyReplicas", 0)
        th = policy.Thresholds.from_spec(spec.autoscaling)
        decision, self.state, obs = policy.decide(th, current=current, ready=ready, samples=samples,
                                                  state=self.state, now=now,
                                                  demand=demand)
        decision = hold_scale_in(status, decision, current)
        if decision is not None and decision.target != current:
            await self.act(body, spec, decision, current, samples, fields, now)
            return []
        return self.pool_conditions(body, [("unified", obs, current, ready, th)])

    async def autoscale_pools(self, body: dict, spec: InferenceServiceSpec,
                              samples: dict[Role, list[ReplicaSample]], now: float, fields: dict) -> list[dict]:
        """Each pool by its own signals, the decode pool then held to the measured ratio under
        ratioPolicy Bound; act on each decision (prefill first: the band follows it)."""
        assert spec.disaggregation is not None
        status = body.get("status") or {}
        current = desired_replicas(spec, status)
        ready = {p.get("role"): p.get("readyReplicas", 0) for p in status.get("pools") or []}
        views: dict[Role, PoolView] = {}
        decisions: dict[Role, policy.Decision | None] = {}
        for role in POOL_ROLES:
            th = pool_policy.pool_thresholds(spec, role)
            decision, self.pool_states[role], obs = policy.decide(
                th, current=current[role], ready=ready.get(role, 0), samples=samples[role],
                state=self.pool_states[role], now=now)
            decision = hold_scale_in(status, decision, current[role])
            decisions[role] = decision if decision is not None and decision.target != current[role] else None
            views[role] = (role, obs, current[role], ready.get(role, 0), th)
        held = None
        if spec.disaggregation.ratio_policy == "Bound":
            decisions["decode"], held = self.bound_decode(spec, status, fields, decisions, current, views["decode"])
        acted = False
        for role in POOL_ROLES:
            decision = decisions[role]
            if decision is None or decision.target == current[role]:
                continue
            acted = True
            if not await self.act(body, spec, decision, current[role], samples[role], fields, now, role=role):
                break  # the replicas changed meanwhile: the next tick decides again
        return [] if acted else self.pool_conditions(body, list(views.values()), held)

    def bound_decode(self, spec: InferenceServiceSpec, status: dict, fields: dict,
                     decisions: dict[Role, policy.Decision | None], current: dict[Role, int],
                     view: PoolView) -> tuple[policy.Decision | None, str | None]:
        """The decode pool's decision within the ratio band, and why it is held (None: not)."""
        assert spec.disaggregation is not None
        own = decisions["decode"]
        measured = ratio_status.measured_ratio(fields.get(ratio_status.FIELD) or status.get(ratio_status.FIELD))
        if measured is None:
            if own is None:
                return None, None
            why = ((fields.get(ratio_status.FIELD) or status.get(ratio_status.FIELD) or {}).get("message")
                   or "not measured yet")
            return policy.Decision(own.target, own.reason, f"{own.message}; ratio bound not applied: no "
                                                           f"measured ratio ({why})"), None
        prefill = decisions["prefill"].target if decisions["prefill"] is not None else current["prefill"]
        _, obs, decode_current, decode_ready, th = view
        band = pool_policy.ratio_band(measured.prefill, measured.decode, prefill,
                                      spec.disaggregation.ratio_tolerance_percent / 100,
                                      th.min_replicas, th.max_replicas)
        serving = decode_ready if obs.on_ready_only else decode_current
        return pool_policy.bound_decode(own, decode_current, band, th, obs, serving)

    def pool_conditions(self, body: dict, views: Sequence[PoolView], held: str | None = None) -> list[dict]:
        """The Scaling condition from each pool's observation (``views``): False while the
        autoscaler cannot see every replica or decides on the ready ones only, True with
        HeldByRatio while ratioPolicy Bound keeps the decode pool from where its signals want it
        (``held``), back to True once none of these holds."""
        gen = body.get("metadata", {}).get("generation")
        old = cond.get((body.get("status") or {}).get("conditions"), cond.SCALING) or {}
        unreadable = sorted(p for _, obs, *_ in views for p in obs.unreadable)
        waiting = [(name, obs, current, ready, th) for name, obs, current, ready, th in views if obs.on_ready_only]
        if unreadable:
            new = cond.condition(cond.SCALING, False, "MetricsUnavailable",
                                 f"cannot read {', '.join(unreadable)}; not scaling in until they "
                                 f"answer", generation=gen)
        elif waiting:
            new = cond.condition(cond.SCALING, False, "ReplicasNotReady", "; ".join(
                f"{'' if name == 'unified' else name + ': '}{obs.not_ready} of {current} replica(s) not ready for "
                f"more than {th.not_ready_grace_s:.0f}s; scaling decisions use the {ready} ready replica(s)"
                for name, obs, current, ready, th in waiting), generation=gen)
        elif held:
            new = cond.condition(cond.SCALING, True, HELD_BY_RATIO, held, generation=gen)
        elif old.get("reason") in ("MetricsUnavailable", "ReplicasNotReady"):
            new = cond.condition(cond.SCALING, True, "SignalsAvailable",
                                 f"reading all {sum(obs.readable for _, obs, *_ in views)} replica(s) again",
                                 generation=gen)
        elif old.get("reason") == HELD_BY_RATIO:
            new = cond.condition(cond.SCALING, True, "WithinRatioBound",
                                 "the decode pool is where its signals want it, within the ratio bound",
                                 generation=gen)
        else:
            return []
        if all(old.get(k) == new.get(k) for k in ("status", "reason", "message", "observedGeneration")):
            return []
        return [new]

    # --- a follower, and a new leader ----------------------------------------------------------

    def follow(self, body: dict, spec: InferenceServiceSpec, ready: list[dict], samples: list[ReplicaSample],
               now: float) -> Warm | None:
        """A follower's reading into the policy state, nothing acted on (``policy.follow``); the
        reading a new leader may act on (``take_over``), None for a disaggregated service: its pools
        are sized together (ratioPolicy Bound), so a new leader reads them before acting."""
        status = body.get("status") or {}
        if spec.disaggregation is not None:
            wanted = desired_replicas(spec, status)
            pools_ready = {p.get("role"): p.get("readyReplicas", 0) for p in status.get("pools") or []}
            by_role = samples_by_role(ready, samples)
            for role in POOL_ROLES:
                self.pool_states[role] = policy.follow(
                    pool_policy.pool_thresholds(spec, role), current=wanted[role], ready=pools_ready.get(role, 0),
                    samples=by_role[role], state=self.pool_states[role], now=now).watched
            return None
        current = self.current_replicas(spec, status, "unified")
        judgement = policy.follow(policy.Thresholds.from_spec(spec.autoscaling), current=current,
                                  ready=status.get("readyReplicas", 0), samples=samples, state=self.state, now=now)
        self.state = judgement.watched
        return Warm(now, current, body.get("metadata", {}).get("generation"), judgement)

    async def take_over(self, body: dict, spec: InferenceServiceSpec, warm: Warm, now: float, *,
                        max_age: float) -> bool:
        """Carry out the scale-out a follower's last reading asked for (``takeover.warm_decision``: a
        reading at most ``max_age`` old, on the replica count and generation that still stand). True
        when applied; False when there is none, or the replicas changed meanwhile (read again)."""
        if spec.disaggregation is not None or spec.autoscaling.mode != "Auto":
            return False
        current = self.current_replicas(spec, body.get("status") or {}, "unified")
        decision = warm_decision(warm, now=now, max_age=max_age, current=current,
                                 generation=body.get("metadata", {}).get("generation"))
        if decision is None or not await self.act(body, spec, decision, current, [], {}, now):
            return False
        self.state = warm.judgement.answered
        return True

    # --- acting ---------------------------------------------------------------------------------

    def current_replicas(self, spec: InferenceServiceSpec, status: dict, role: Role) -> int:
        """The replicas last wanted for a pool: the unified pool's desiredReplicas, or a pool's
        status.pools[].desiredReplicas as the reconciler applies it (inside the pool's bounds)."""
        if role == "unified":
            return status.get("desiredReplicas") or spec.autoscaling.min_replicas
        return desired_replicas(spec, status)[role]

    def replicas_fields(self, spec: InferenceServiceSpec, status: dict, role: Role, target: int) -> dict:
        """The status fields that record ``target`` replicas for a pool."""
        if role == "unified":
            return {"desiredReplicas": target}
        wanted = {**desired_replicas(spec, status), role: target}
        rows = {p.get("role"): p for p in status.get("pools") or []}
        return {"desiredReplicas": sum(wanted.values()),
                "pools": [{**rows.get(r, {"role": r}), "desiredReplicas": n} for r, n in wanted.items()]}

    async def act(self, body: dict, spec: InferenceServiceSpec, decision: policy.Decision, current: int,
                  samples: list[ReplicaSample], fields: dict, now: float, role: Role = "unified") -> bool:
        """Apply a decision for a pool (``role``; "unified" for a unified service) under the
        service's lock, on the freshest object: a reconcile holding an older copy cannot run in
        between, and a decision made on a replica count that changed meanwhile is dropped (the
        next tick decides again). True when applied; the tick's ``fields`` (the figures too) go
        with the decision's status write."""
        gen = body.get("metadata", {}).get("generation")
        pool = "" if role == "unified" else f"{role} "
        async with self.ports.locks.locked(self.ns, self.name) as fresh:
            if fresh is None:
                return False
            fresh_status = fresh.get("status") or {}
            fresh_current = self.current_replicas(spec, fresh_status, role)
            if fresh_current != current or fresh["metadata"].get("generation") != gen:
                log.info("%s/%s: %sreplicas changed to %d since the signals were read; not applying %d -> %d",
                         self.ns, self.name, pool, fresh_current, current, decision.target)
                return False
            direction = "up" if decision.target > current else "down"
            self.scaled_in_this_pass = self.scaled_in_this_pass or direction == "down"
            victim = policy.least_loaded(samples) if direction == "down" else None
            if victim:
                await self.marks.mark(victim, decision.target, role)
            else:
                await self.marks.release(role)
            stamp = cond.now_iso()
            last = {"time": stamp, "from": current, "to": decision.target, "reason": decision.reason,
                    "message": decision.message}
            if role != "unified":
                last["role"] = role
            # The Event goes first: if the operator dies between the writes, the record of
            # the decision survives and its successor completes it from status.
            event_reason = "ScaledUp" if direction == "up" else "ScaledDown"
            await self.ports.events.event(fresh, reason=event_reason,
                                          message=f"{pool.replace(' ', ': ')}{current} -> {decision.target} "
                                                  f"replicas ({decision.reason}): {decision.message}")
            ride = self.figures.plan(fields, fresh_status, now, urgent=True)
            try:
                await self.ports.status.write_status(fresh, {
                    **ride, **self.replicas_fields(spec, fresh_status, role, decision.target), "lastScaling": last,
                }, [cond.condition(cond.SCALING, True, decision.reason, f"{pool}{current} -> {decision.target}: "
                                   f"{decision.message}", generation=gen)])
            except ApiError:
                if victim:  # no scale-in will follow: the mark must not outlive the decision
                    await self.marks.unmark(victim)
                raise
            self.figures.wrote(ride, now)
            fields.clear()
            self.ports.metrics.decisions.labels(self.ns, self.name, direction).inc()
            log.info("%s/%s: %s%s %d -> %d (%s)", self.ns, self.name, pool, event_reason, current, decision.target,
                     decision.message)
            await self.ports.locks.reconcile_locked(fresh)  # applies the new replica count to the Deployment
            # The fleet's copy catches up through the watch; until then it must not decide from the old count.
            body["status"] = fresh.get("status") or {}
            body["metadata"]["resourceVersion"] = fresh["metadata"].get("resourceVersion")
            return True
