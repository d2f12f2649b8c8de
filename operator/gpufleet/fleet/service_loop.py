"""Per-InferenceService control loop: read replicas, autoscale, audit fragmentation.

Ticked by the shared ``FleetLoop`` (one per operator). Decisions come
from the pure policies; this class does the reading and the writing: status
fields, one Event per action, metrics, the pod-deletion-cost mark before a
scale-in (cleared from a replica that outlives it), and evictions for
fragmentation remediation (only under every rule of
``audit.fragmentation.may_restart``). An action is applied under the
service's lock in the ``Controller``, so it and a reconcile never interleave.

A disaggregated service (spec.disaggregation) is read and audited like any other, but the
autoscaler sizes one unified pool only: its pools keep the replicas the reconciler gives them
(``reconcile.replicas.desired_replicas``; status says so with Scaling=False). Its fragmentation
remediation judges a replica against the other replicas of its own pool.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from datetime import datetime, timezone
from typing import Sequence

from ..api import InferenceServiceSpec, SpecError, parse_spec
from ..api import v1alpha1 as t
from ..audit import fragmentation as frag
from ..autoscale import policy
from ..autoscale.signals import ReplicaSample, bucket_delta, quantile_from_buckets
from ..kube.errors import ApiError
from ..manifests import names
from ..reconcile import conditions as cond
from .demand_share import DemandShare
from .ports import ServicePorts

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
TTFT_WINDOW_S = 60
FIRST_AUDIT_DELAY_S = 15


def readable_replicas(pods: list[dict]) -> list[dict]:
    """Replica views ({name, ip, ready, deleting, role}) that serve traffic and can be read."""
    return [p for p in pods if p["ready"] and p.get("ip") and not p["deleting"]]


def role_of(pod: dict) -> str:
    return pod.get("role") or "unified"


class ServiceLoop:
    def __init__(self, ports: ServicePorts, namespace: str, name: str):
        self.ports = ports
        self.ns, self.name = namespace, name
        self.state = policy.PolicyState()
        self.ttft_history: collections.deque = collections.deque()
        self.last_audit: float | None = None
        self._spec_key: tuple | None = None
        self._spec: InferenceServiceSpec | None = None
        self.removals: dict[str, int] = {}  # pod marked for scale-in -> the replica count it was marked for
        self.watching_since: float | None = None  # first tick of this operator process for the service
        self.audit_baseline: dict[str, tuple[int, int]] = {}  # pod -> (alloc retries, OOMs) at the last audit
        self.scaled_in_this_pass = False
        self.demand_share = DemandShare(ports.objects, ports.replicas, namespace, name)

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

    async def read_replicas(self, pods: list[dict]) -> tuple[list[dict], list[ReplicaSample]]:
        ready = readable_replicas(pods)
        samples = await asyncio.gather(*(self.ports.replicas.sample(p["name"], p["ip"]) for p in ready))
        for s in samples:
            if not s.ok:
                self.ports.metrics.read_errors.labels(self.ns, self.name).inc()
        return ready, list(samples)

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

    async def tick(self, body: dict, pods: list[dict], now: float | None = None, demand: int = 0) -> None:
        """``demand``: requests routers hold for the service (it may be at zero replicas)."""
        now = time.monotonic() if now is None else now
        if self.watching_since is None:
            self.watching_since = now
        self.scaled_in_this_pass = False
        spec = self.spec_of(body)
        if spec is None:
            return  # the reconciler reports InvalidSpec
        ready, samples = await self.read_replicas(pods)
        fields: dict = {}
        kv = [s.kv_usage for s in samples if s.ok and s.kv_usage is not None]
        if kv:
            mean = sum(kv) / len(kv)
            self.ports.metrics.kv_usage.labels(self.ns, self.name).set(mean)
            fields["kvCacheUsagePercent"] = round(mean * 100)
        waste = [s.kv_waste for s in samples if s.ok and s.kv_waste is not None]
        if waste:
            fields["kvWastePercent"] = round(100 * sum(waste) / len(waste))
        p99 = self.ttft_p99(samples, now)
        if p99 is not None:
            fields["ttftP99Milliseconds"] = round(p99 * 1000)
        conditions: list[dict] = []
        if spec.autoscaling.mode == "Auto" and spec.disaggregation is None:
            conditions = await self.autoscale(body, spec, samples, now, fields, demand)
        if fields or conditions:
            await self.ports.status.write_status(body, fields, conditions)
        await self.release_deletion_costs(body, pods)
        if spec.admission.reservation == "Predicted":
            # A disaggregated service's answer lengths are what its decode pods see (a prefill pod
            # answers one token), and its guards of both pools read the one demand.json.
            sharing = [p for p in ready if role_of(p) == "decode"] if spec.disaggregation else ready
            await self.demand_share.tick(body, sharing, pods, now)
        if self.audit_due(body, spec, now):
            await self.audit(body, spec, ready, now, samples=samples, pods=pods)

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
        if decision is not None and decision.target != current:
            await self.act(body, spec, decision, current, samples, fields)
            return []
        return self.signal_conditions(body, obs, current, ready, th)

    def signal_conditions(self, body: dict, obs: policy.Observation, current: int, ready: int,
                          th: policy.Thresholds) -> list[dict]:
        """Scaling=False while the autoscaler cannot see every replica, back to True once it can."""
        gen = body.get("metadata", {}).get("generation")
        old = cond.get((body.get("status") or {}).get("conditions"), cond.SCALING) or {}
        if obs.unreadable:
            new = cond.condition(cond.SCALING, False, "MetricsUnavailable",
                                 f"cannot read {', '.join(sorted(obs.unreadable))}; not scaling in until they "
                                 f"answer", generation=gen)
        elif obs.on_ready_only:
            new = cond.condition(cond.SCALING, False, "ReplicasNotReady",
                                 f"{obs.not_ready} of {current} replica(s) not ready for more than "
                                 f"{th.not_ready_grace_s:.0f}s; scaling decisions use the {ready} ready "
                                 f"replica(s)", generation=gen)
        elif old.get("reason") in ("MetricsUnavailable", "ReplicasNotReady"):
            new = cond.condition(cond.SCALING, True, "SignalsAvailable",
                                 f"reading all {obs.readable} replica(s) again", generation=gen)
        else:
            return []
        if all(old.get(k) == new.get(k) for k in ("status", "reason", "message", "observedGeneration")):
            return []
        return [new]

    async def act(self, body: dict, spec: InferenceServiceSpec, decision: policy.Decision, current: int,
                  samples: list[ReplicaSample], fields: dict) -> None:
        """Apply a decision under the service's lock, on the freshest object: a reconcile
        holding an older copy cannot run in between, and a decision made on a replica
        count that changed meanwhile is dropped (the next tick decides again)."""
        gen = body.get("metadata", {}).get("generation")
        async with self.ports.locks.locked(self.ns, self.name) as fresh:
            if fresh is None:
                return
            fresh_current = (fresh.get("status") or {}).get("desiredReplicas") or spec.autoscaling.min_replicas
            if fresh_current != current or fresh["metadata"].get("generation") != gen:
                log.info("%s/%s: replicas changed to %d since the signals were read; not applying %d -> %d",
                         self.ns, self.name, fresh_current, current, decision.target)
                return
            direction = "up" if decision.target > current else "down"
            self.scaled_in_this_pass = direction == "down"
            victim = policy.least_loaded(samples) if direction == "down" else None
            if victim:
                await self.mark_for_removal(victim, decision.target)
            else:
                await self.release_all_marks()
            stamp = cond.now_iso()
            # The Event goes first: if the operator dies between the writes, the record of
            # the decision survives and its successor completes it from status.
            event_reason = "ScaledUp" if direction == "up" else "ScaledDown"
            await self.ports.events.event(fresh, reason=event_reason,
                                     message=f"{current} -> {decision.target} replicas ({decision.reason}): "
                                             f"{decision.message}")
            try:
                await self.ports.status.write_status(fresh, {
                    **fields, "desiredReplicas": decision.target,
                    "lastScaling": {"time": stamp, "from": current, "to": decision.target,
                                    "reason": decision.reason, "message": decision.message},
                }, [cond.condition(cond.SCALING, True, decision.reason, f"{current} -> {decision.target}: "
                                   f"{decision.message}", generation=gen)])
            except ApiError:
                if victim:  # no scale-in will follow: the mark must not outlive the decision
                    await self.unmark(victim)
                raise
            fields.clear()
            self.ports.metrics.decisions.labels(self.ns, self.name, direction).inc()
            log.info("%s/%s: %s %d -> %d (%s)", self.ns, self.name, event_reason, current, decision.target,
                     decision.message)
            await self.ports.locks.reconcile_locked(fresh)  # applies the new replica count to the Deployment
            # The fleet's copy catches up through the watch; until then it must not decide from the old count.
            body["status"] = fresh.get("status") or {}
            body["metadata"]["resourceVersion"] = fresh["metadata"].get("resourceVersion")

    # --- the scale-in mark -----------------------------------------------------------

    async def mark_for_removal(self, pod: str, target: int) -> None:
        """The ReplicaSet removes the pod with the lowest deletion cost first."""
        try:
            await self.ports.objects.merge_patch("v1", "Pod", pod, {"metadata": {"annotations": {
                DELETION_COST: "-1000"}}}, self.ns)
            self.removals[pod] = target
        except ApiError as e:
            log.warning("could not mark %s for scale-in: %s", pod, e)

    async def release_deletion_costs(self, body: dict, pods: list[dict]) -> None:
        """Clear the mark on a replica that outlived its scale-in (the ReplicaSet took
        another, e.g. a not-ready one): left, it would make that replica the next one
        removed however busy it is by then."""
        live = [p for p in pods if not p["deleting"]]
        names_live = {p["name"] for p in live}
        for name in [n for n in self.removals if n not in names_live]:
            del self.removals[name]  # removed as intended
        desired = (body.get("status") or {}).get("desiredReplicas")
        for p in live:
            target = self.removals.get(p["name"])
            if target is None:
                if not p.get("marked") or desired is None:
                    continue
                target = desired  # a mark from before a restart
            if len(live) <= target:  # the scale-in is done and this one stayed
                await self.unmark(p["name"])

    async def release_all_marks(self) -> None:
        for name in list(self.removals):
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
                        pods: Sequence[dict], now: float, pdb_allowed: int,
                        pod: str | None = None) -> frag.RestartContext:
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
            pods_terminating=sum(1 for p in pods if p["deleting"]), pdb_disruptions_allowed=pdb_allowed,
            scaling_in=self.scaled_in_this_pass or bool(self.removals),
            kv_usage={s.pod: s.kv_usage for s in samples if s.ok and s.kv_usage is not None},
            kv_high=policy.Thresholds.from_spec(spec.autoscaling).kv_high)

    async def remediate(self, body: dict, pod: str, spec: InferenceServiceSpec, samples: Sequence[ReplicaSample],
                        pods: Sequence[dict], now: float) -> None:
        pdb = await self.ports.objects.get_or_none("policy/v1", "PodDisruptionBudget", names.pdb_name(self.name),
                                                   self.ns)
        allowed = (pdb or {}).get("status", {}).get("disruptionsAllowed", 0)
        ok, why = frag.may_restart(pod, self.restart_context(body, spec, samples, pods, now, allowed, pod))
        if not ok:
            await self.ports.events.event(body, reason="RemediationDeferred", type_="Warning",
                                     message=f"not restarting {pod}: {why}")
            return
        try:  # the Eviction API re-checks the budget atomically
            await self.ports.objects.evict(pod, self.ns)
        except ApiError as e:
            await self.ports.events.event(body, reason="RemediationDeferred", type_="Warning",
                                     message=f"eviction of {pod} refused: {e.message}")
            return
        await self.ports.events.event(body, reason="ReplicaRestarted",
                                 message=f"evicted {pod}: GPU memory fragmented and allocation retries or OOMs "
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
