"""Per-InferenceService control loop: read replicas, autoscale, audit fragmentation.

Ticked by the shared ``FleetLoop`` (one per operator). Decisions come
from the pure policies; this class does the reading and the writing: status
fields (the fast-moving figures, KV usage and TTFT p99, at most every
``figures_interval`` seconds, everything else at once: ``reconcile.figures``),
one Event per action, metrics, the pod-deletion-cost mark before a
scale-in (cleared from a replica that outlives it), and evictions for
fragmentation remediation (only under every rule of
``audit.fragmentation.may_restart``). An action is applied under the
service's lock in the ``Controller``, so it and a reconcile never interleave.

A disaggregated service (spec.disaggregation) is read and audited like any other. In Auto mode
each pool is sized by its own signals (``autoscale.pools``): a decision writes the pool's
``status.pools[].desiredReplicas``, which the reconciler applies to the pool's Deployment
(``reconcile.replicas.desired_replicas``), and ``status.lastScaling.role`` and the Event name the
pool. The decode pods' finished requests give the live prefill:decode ratio
(``status.prefillDecodeRatio``, every ``RATIO_UPDATE_S``), which ratioPolicy Bound holds the decode
pool to. Its fragmentation remediation judges a replica against the other replicas of its own pool.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from datetime import datetime, timezone
from typing import Sequence

from gpufleet_api import InferenceServiceSpec, SpecError, parse_spec
from gpufleet_api import v1alpha1 as t
from gpufleet_api.guard.guard_config import Role
from gpufleet_kit.kube.errors import ApiError

from ..adapters.index import Adapter
from ..audit import fragmentation as frag
from ..autoscale import policy
from ..autoscale import pools as pool_policy
from ..autoscale.signals import ReplicaSample, bucket_delta, quantile_from_buckets
from ..autoscale.takeover import Warm, warm_decision
from ..autoscale.token_window import TokenWindow
from ..manifests import names
from ..manifests.pools import POOL_ROLES
from ..planning.live_ratio import live_ratio
from ..reconcile import conditions as cond
from ..reconcile import drains, figures
from ..reconcile import ratio as ratio_status
from ..reconcile.replicas import desired_replicas
from .adapter_sync import AdapterSync
from .canary import SLI_WRITE_S, CanaryLoop
from .demand_share import DemandShare
from .ports import ServicePorts

log = logging.getLogger(__name__)

# Scaling=True while ratioPolicy Bound keeps the decode pool from where its signals want it.
HELD_BY_RATIO = "HeldByRatio"
# One pool as the Scaling condition sees it: its role, what the policy observed, the replicas
# wanted and ready, and its thresholds.
PoolView = tuple[Role, policy.Observation, int, int, policy.Thresholds]

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
TTFT_WINDOW_S = 60
FIRST_AUDIT_DELAY_S = 15
RATIO_UPDATE_S = 30.0


def readable_replicas(pods: list[dict]) -> list[dict]:
    """Replica views ({name, ip, ready, deleting, role}) that serve traffic and can be read."""
    return [p for p in pods if p["ready"] and p.get("ip") and not p["deleting"]]


def hold_scale_in(status: dict, decision: policy.Decision | None, current: int) -> policy.Decision | None:
    """No scale-in while replacements for pods on cordoned nodes run (status.drain): the surge is not
    capacity the autoscaler decided, and a scale-in then could remove the replacement a drain waits for."""
    if decision is not None and decision.target < current and drains.surging(status):
        return None
    return decision


def role_of(pod: dict) -> Role:
    return pod.get("role") or "unified"


class ServiceLoop:
    """``figures_interval``: seconds between writes of the fast-moving status figures
    (``reconcile.figures``; 0: every change)."""

    def __init__(self, ports: ServicePorts, namespace: str, name: str,
                 figures_interval: float = figures.DEFAULT_INTERVAL_S):
        self.ports = ports
        self.ns, self.name = namespace, name
        self.state = policy.PolicyState()
        self.pool_states: dict[Role, policy.PolicyState] = {role: policy.PolicyState() for role in POOL_ROLES}
        self.tokens = TokenWindow()  # the decode pods' finished requests (the live prefill:decode ratio)
        self.ratio_measured: float | None = None
        self.ttft_history: collections.deque = collections.deque()
        self.last_audit: float | None = None
        self._spec_key: tuple | None = None
        self._spec: InferenceServiceSpec | None = None
        # pod marked for scale-in -> (its pool, the pool's replica count it was marked for)
        self.removals: dict[str, tuple[Role, int]] = {}
        self.watching_since: float | None = None  # first tick of this operator process for the service
        self.audit_baseline: dict[str, tuple[int, int]] = {}  # pod -> (alloc retries, OOMs) at the last audit
        self.scaled_in_this_pass = False
        self.figures = figures.FigurePacer(figures_interval)
        self.demand_share = DemandShare(ports.objects, ports.replicas, namespace, name)
        self.adapters = AdapterSync(ports, namespace, name, figures_interval=figures_interval)
        self.canary = CanaryLoop(ports, namespace, name, sli_write_seconds=max(SLI_WRITE_S, figures_interval))
        self.warm: Warm | None = None  # the last reading as a follower, until this loop leads (``take_over``)

    def spec_of(self, body: dict) -> InferenceServiceSpec | None:
        """The parsed spec, parsed once per generation; None when invalid."""
        meta = body.get("metadata", {})
        key = (meta.get("uid"), meta.get("generation"))
        if key != self._spec_key or key == (None, None):
            try:
                self._spec = parse_spec(body.get("spec"))
            except SpecError:
                self._spec = None
            self._spec_key = key
        return self._spec

    # --- reading ---------------------------------------------------------------

    async def read_replicas(self, spec: InferenceServiceSpec, pods: list[dict], now: float, *,
                            leading: bool = True) -> tuple[list[dict], list[ReplicaSample], float | None]:
        """The reads of every tick, the leader's and a follower's alike, into this loop's state: the
        ready replicas, their samples, and the TTFT p99 for status (its window advanced); the adapters'
        request rates and the decode pool's token window advanced too. A follower (``leading``
        False) counts no read errors: it exports no per-service series."""
        ready = readable_replicas(pods)
        samples = list(await asyncio.gather(*(self.ports.replicas.sample(p["name"], p["ip"]) for p in ready)))
        if leading:
            for s in samples:
                if not s.ok:
                    self.ports.metrics.read_errors.labels(self.ns, self.name).inc()
        if spec.engine.lora is not None:
            self.adapters.observe(samples, now)
        if spec.disaggregation is not None:
            decode = {p["name"] for p in ready if role_of(p) == "decode"}
            self.tokens = self.tokens.advance([s for s in samples if s.pod in decode], now)
        return ready, samples, self.ttft_p99(samples, now)

    def ttft_p99(self, samples: Sequence[ReplicaSample], now: float) -> float | None:
        merged: dict[float, float] = {}
        for s in samples:
            for le, count in s.ttft_buckets:
                merged[le] = merged.get(le, 0.0) + count
        snapshot = tuple(sorted(merged.items()))
        self.ttft_history.append((now, snapshot))
        while self.ttft_history and now - self.ttft_history[0][0] > TTFT_WINDOW_S:
            self.ttft_history.popleft()
        if len(self.ttft_history) < 2 or not snapshot:
            return None
        return quantile_from_buckets(bucket_delta(snapshot, self.ttft_history[0][1]), 0.99)

    # --- one tick -----------------------------------------------------------------

    async def sync_adapters(self, body: dict, pods: list[dict], adapters: Sequence[Adapter],
                            now: float | None = None) -> None:
        """Only the adapters' pass, for a service the loop does not tick (no ready replica): their
        status still says why they are not loaded (LoraDisabled, Placing)."""
        spec = self.spec_of(body)
        if spec is not None:
            await self.adapters.tick(spec, readable_replicas(pods), adapters,
                                     time.monotonic() if now is None else now)

    async def tick(self, body: dict, pods: list[dict], now: float | None = None, demand: int = 0,
                   adapters: Sequence[Adapter] = (), audits: bool = True) -> None:
        """``demand``: requests routers hold for the service (it may be at zero replicas);
        ``adapters``: the InferenceAdapters naming it; ``audits``: False while a new leader's first
        pass runs (the fragmentation audit, due or requested, waits for the next tick)."""
        now = time.monotonic() if now is None else now
        if self.watching_since is None:
            self.watching_since = now
        self.scaled_in_this_pass = False
        self.warm = None  # the leader's own reads supersede a follower's
        spec = self.spec_of(body)
        if spec is None:
            return  # the reconciler reports InvalidSpec
        ready, samples, p99 = await self.read_replicas(spec, pods, now)
        if spec.engine.lora is not None or adapters:
            # Before autoscaling: a replica that just became ready gets its adapters first.
            await self.adapters.tick(spec, ready, adapters, now)
        fields: dict = {}
        kv = [s.kv_usage for s in samples if s.ok and s.kv_usage is not None]
        if kv:
            mean = sum(kv) / len(kv)
            self.ports.metrics.kv_usage.labels(self.ns, self.name).set(mean)
            fields["kvCacheUsagePercent"] = round(mean * 100)
        waste = [s.kv_waste for s in samples if s.ok and s.kv_waste is not None]
        if waste:
            fields["kvWastePercent"] = round(100 * sum(waste) / len(waste))
        if p99 is not None:
            fields["ttftP99Milliseconds"] = round(p99 * 1000)
        conditions: list[dict] = []
        if spec.disaggregation is not None:
            roles = {p["name"]: role_of(p) for p in ready}
            by_role = {role: [s for s in samples if roles.get(s.pod) == role] for role in POOL_ROLES}
            self.measure_ratio(body, spec, now, fields)
            if spec.autoscaling.mode == "Auto":
                conditions = await self.autoscale_pools(body, spec, by_role, now, fields)
        elif spec.autoscaling.mode == "Auto":
            conditions = await self.autoscale(body, spec, samples, now, fields, demand)
        # The figures at most every figures_interval; conditions and other fields at once, with the figures.
        write = self.figures.plan(fields, body.get("status") or {}, now, urgent=bool(conditions),
                                  limits=figures.limits(spec))
        if write or conditions:
            await self.ports.status.write_status(body, write, conditions)
            self.figures.wrote(write, now)
        if spec.rollout is not None and spec.rollout.strategy == "Canary" and spec.disaggregation is None:
            await self.canary.tick(body, spec, pods, samples)
        await self.release_deletion_costs(body, pods)
        if spec.admission.reservation == "Predicted":
            # A disaggregated service's answer lengths are what its decode pods see (a prefill pod
            # answers one token), and its guards of both pools read the one demand.json.
            sharing = [p for p in ready if role_of(p) == "decode"] if spec.disaggregation else ready
            await self.demand_share.tick(body, sharing, pods, now)
        if audits and self.audit_due(body, spec, now):
            await self.audit(body, spec, ready, now, samples=samples, pods=pods)

    # --- following, and taking over -------------------------------------------------------

    async def follow(self, body: dict, pods: list[dict], now: float | None = None) -> None:
        """A follower's tick: ``tick``'s reads into the same state, and nothing written (no status,
        no scaling, no Event, no metric, no call to a replica but the reads), so that this replica,
        should it take the Lease over, decides on what the leader would have seen (``take_over``).
        Only an autoscaled service has state worth keeping warm."""
        now = time.monotonic() if now is None else now
        spec = self.spec_of(body)
        if spec is None or spec.autoscaling.mode != "Auto":
            self.warm = None
            return
        ready, samples, _ = await self.read_replicas(spec, pods, now, leading=False)
        status = body.get("status") or {}
        if spec.disaggregation is not None:
            roles = {p["name"]: role_of(p) for p in ready}
            wanted = desired_replicas(spec, status)
            pools_ready = {p.get("role"): p.get("readyReplicas", 0) for p in status.get("pools") or []}
            for role in POOL_ROLES:
                self.pool_states[role] = policy.follow(
                    pool_policy.pool_thresholds(spec, role), current=wanted[role], ready=pools_ready.get(role, 0),
                    samples=[s for s in samples if roles.get(s.pod) == role], state=self.pool_states[role],
                    now=now).watched
            # Its pools are sized together (ratioPolicy Bound): a new leader reads them before acting.
            self.warm = None
            return
        current = self.current_replicas(spec, status, "unified")
        judgement = policy.follow(policy.Thresholds.from_spec(spec.autoscaling), current=current,
                                  ready=status.get("readyReplicas", 0), samples=samples, state=self.state, now=now)
        self.state = judgement.watched
        self.warm = Warm(now, current, body.get("metadata", {}).get("generation"), judgement)

    async def take_over(self, body: dict, pods: list[dict], now: float | None = None, *, max_age: float,
                        demand: int = 0, adapters: Sequence[Adapter] = (), audits: bool = True) -> None:
        """This loop's first tick under a new leader. A scale-out its last reading as a follower
        asked for is carried out at once, before the replicas are read again
        (``takeover.warm_decision``: a reading at most ``max_age`` old, on the replica count and
        generation that still stand); otherwise, or when the replicas changed meanwhile, an
        ordinary tick."""
        now = time.monotonic() if now is None else now
        warm, self.warm = self.warm, None
        spec = self.spec_of(body)
        if warm is not None and spec is not None and spec.disaggregation is None \
                and spec.autoscaling.mode == "Auto":
            current = self.current_replicas(spec, body.get("status") or {}, "unified")
            decision = warm_decision(warm, now=now, max_age=max_age, current=current,
                                     generation=body.get("metadata", {}).get("generation"))
            if decision is not None:
                if self.watching_since is None:
                    self.watching_since = now
                if await self.act(body, spec, decision, current, [], {}, now):
                    self.state = warm.judgement.answered
                    return
        await self.tick(body, pods, now, demand, adapters, audits=audits)

    # --- autoscaling ------------------------------------------------------------------

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
        return self.signal_conditions(body, obs, current, ready, th)

    def signal_conditions(self, body: dict, obs: policy.Observation, current: int, ready: int,
                          th: policy.Thresholds) -> list[dict]:
        """Scaling=False while the autoscaler cannot see every replica, back to True once it can."""
        return self.pool_conditions(body, [("unified", obs, current, ready, th)])

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

    # --- disaggregated services --------------------------------------------------------

    def measure_ratio(self, body: dict, spec: InferenceServiceSpec, now: float, fields: dict) -> None:
        """Every RATIO_UPDATE_S, the live prefill:decode ratio of the token window (``read_replicas``
        adds the decode pods' finished requests to it) into ``fields`` when it says something new."""
        if self.ratio_measured is not None and now - self.ratio_measured < RATIO_UPDATE_S:
            return
        self.ratio_measured = now
        ratio = live_ratio(spec, self.tokens.demand(now))
        new = ratio_status.ratio_status(ratio, (body.get("status") or {}).get(ratio_status.FIELD), cond.now_iso())
        if new is not None:
            fields[ratio_status.FIELD] = new

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
                await self.mark_for_removal(victim, decision.target, role)
            else:
                await self.release_marks(role)
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
                    await self.unmark(victim)
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

    # --- the scale-in mark -----------------------------------------------------------

    async def mark_for_removal(self, pod: str, target: int, role: Role = "unified") -> None:
        """The ReplicaSet removes the pod with the lowest deletion cost first."""
        try:
            await self.ports.objects.merge_patch("v1", "Pod", pod, {"metadata": {"annotations": {
                DELETION_COST: "-1000"}}}, self.ns)
            self.removals[pod] = (role, target)
        except ApiError as e:
            log.warning("could not mark %s for scale-in: %s", pod, e)

    async def release_deletion_costs(self, body: dict, pods: list[dict]) -> None:
        """Clear the mark on a replica that outlived its scale-in (the ReplicaSet took
        another, e.g. a not-ready one): left, it would make that replica the next one
        removed however busy it is by then. Counted per pool: each pool's ReplicaSet
        removes its own pods."""
        live = [p for p in pods if not p["deleting"]]
        names_live = {p["name"] for p in live}
        for name in [n for n in self.removals if n not in names_live]:
            del self.removals[name]  # removed as intended
        status = body.get("status") or {}
        wanted: dict[Role | None, int | None] = {"unified": status.get("desiredReplicas")}
        wanted.update({p.get("role"): p.get("desiredReplicas") for p in status.get("pools") or []})
        counts = collections.Counter(role_of(p) for p in live)
        for p in live:
            mark = self.removals.get(p["name"])
            if mark is None:
                target = wanted.get(role_of(p))
                if not p.get("marked") or target is None:
                    continue
                role = role_of(p)  # a mark from before a restart
            else:
                role, target = mark
            if counts[role] <= target:  # the scale-in is done and this one stayed
                await self.unmark(p["name"])

    async def release_marks(self, role: Role) -> None:
        for name in [n for n, (r, _) in self.removals.items() if r == role]:
            await self.unmark(name)

    async def unmark(self, pod: str) -> None:
        try:
            await self.ports.objects.merge_patch("v1", "Pod", pod,
                                                 {"metadata": {"annotations": {DELETION_COST: None}}}, self.ns)
        except ApiError as e:
            if e.status != 404:
                log.warning("could not clear the scale-in mark on %s: %s", pod, e)
                return
        self.removals.pop(pod, None)

    # --- fragmentation audit ---------------------------------------------------------

    def audit_due(self, body: dict, spec: InferenceServiceSpec, now: float) -> bool:
        requested = (body.get("metadata", {}).get("annotations") or {}).get(names.ANNOTATION_AUDIT_REQUEST)
        if requested:
            return True
        interval = spec.audit.fragmentation.interval_seconds
        if self.last_audit is None:  # first audit soon after start, then on the interval
            self.last_audit = now - interval + FIRST_AUDIT_DELAY_S
        return now - self.last_audit >= interval

    async def audit(self, body: dict, spec: InferenceServiceSpec, ready: list[dict], now: float, *,
                    samples: Sequence[ReplicaSample] = (), pods: Sequence[dict] = ()) -> None:
        self.last_audit = now
        reports = await asyncio.gather(*(self.ports.replicas.audit(p["name"], p["ip"]) for p in ready))
        replicas = [frag.replica_from_report(p["name"], rep, err) for p, (rep, err) in zip(ready, reports)]
        cfg = spec.audit.fragmentation
        result = frag.evaluate(replicas, cfg.threshold_percent / 100, cfg.remediation, self.audit_baseline)
        self.audit_baseline = frag.counters(replicas)
        stamp = cond.now_iso()
        previous = (body.get("status") or {}).get("fragmentation") or {}
        fstatus = {**previous, "percent": None if result.ratio is None else round(result.ratio * 100),
                   "worstReplica": result.worst, "losingMemoryReplica": result.restart_candidate, "time": stamp,
                   "verdict": result.verdict, "recommendation": result.recommendation}
        ok = result.verdict != "AboveThreshold"
        await self.ports.status.write_status(body, {"fragmentation": fstatus}, [cond.condition(
            cond.FRAGMENTATION_OK, ok, result.verdict, result.recommendation,
            generation=body.get("metadata", {}).get("generation"))])
        if result.ratio is not None:
            self.ports.metrics.fragmentation.labels(self.ns, self.name).set(result.ratio)
        if result.verdict == "AboveThreshold":
            await self.ports.events.event(body, reason="FragmentationHigh", type_="Warning",
                                     message=f"{result.worst}: {result.ratio:.0%} > "
                                             f"{cfg.threshold_percent}%; {result.recommendation}")
            if cfg.remediation == "RestartReplica" and result.restart_candidate:
                await self.remediate(body, result.restart_candidate, spec, samples, pods, now)
        elif result.verdict != previous.get("verdict"):
            await self.ports.events.event(body, reason=f"Fragmentation{result.verdict}", message=result.recommendation)
        annotations = body.get("metadata", {}).get("annotations") or {}
        if names.ANNOTATION_AUDIT_REQUEST in annotations:
            await self.ports.objects.merge_patch(t.API_VERSION, t.KIND, self.name, {"metadata": {"annotations": {
                names.ANNOTATION_AUDIT_REQUEST: None}}}, self.ns)

    def restart_context(self, body: dict, spec: InferenceServiceSpec, samples: Sequence[ReplicaSample],
                        pods: Sequence[dict], now: float, pod: str | None = None) -> frag.RestartContext:
        """``pod``: the replica to restart; on a disaggregated service the context is its pool's (the
        other pool cannot carry its load)."""
        status = body.get("status") or {}
        last = (status.get("fragmentation") or {}).get("lastRestartTime")
        ready, desired = status.get("readyReplicas", 0), status.get("desiredReplicas", 0)
        if spec.disaggregation is not None and pod is not None:
            role = next((role_of(p) for p in pods if p["name"] == pod), None)
            pods = [p for p in pods if role_of(p) == role]
            pool = {p.get("role"): p for p in status.get("pools") or []}.get(role) or {}
            ready, desired = pool.get("readyReplicas", 0), pool.get("desiredReplicas", 0)
            samples = [s for s in samples if s.pod in {p["name"] for p in pods}]
        return frag.RestartContext(
            now=now, watching_since=self.watching_since if self.watching_since is not None else now,
            cooldown_seconds=spec.audit.fragmentation.restart_cooldown_seconds,
            last_restart_ago=_seconds_since(last),
            ready_replicas=ready, desired_replicas=desired,
            pods_terminating=sum(1 for p in pods if p["deleting"]), node_drain=drains.surging(status),
            scaling_in=self.scaled_in_this_pass or bool(self.removals),
            kv_usage={s.pod: s.kv_usage for s in samples if s.ok and s.kv_usage is not None},
            kv_high=policy.Thresholds.from_spec(spec.autoscaling).kv_high)

    async def remediate(self, body: dict, pod: str, spec: InferenceServiceSpec, samples: Sequence[ReplicaSample],
                        pods: Sequence[dict], now: float) -> None:
        ok, why = frag.may_restart(pod, self.restart_context(body, spec, samples, pods, now, pod))
        if not ok:
            await self.ports.events.event(body, reason="RemediationDeferred", type_="Warning",
                                     message=f"not restarting {pod}: {why}")
            return
        # Deleted, not evicted: the pool's budget keeps every desired replica (docs/drains.md), and the
        # rules above are this restart's own budget (one at a time, every replica ready, headroom).
        try:
            await self.ports.objects.delete("v1", "Pod", pod, self.ns)
        except ApiError as e:
            await self.ports.events.event(body, reason="RemediationDeferred", type_="Warning",
                                     message=f"deletion of {pod} failed: {e.message}")
            return
        await self.ports.events.event(body, reason="ReplicaRestarted",
                                 message=f"deleted {pod}: GPU memory fragmented and allocation retries or OOMs "
                                         f"rising ({why})")
        fstatus = (body.get("status") or {}).get("fragmentation") or {}
        await self.ports.status.write_status(body, {"fragmentation": {
            **fstatus, "lastRestartTime": cond.now_iso(), "lastRestartedReplica": pod}})


def _seconds_since(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return (datetime.now(timezone.utc) - then).total_seconds()
