"""Per-InferenceService control loop: read replicas, autoscale, audit fragmentation.

Ticked by the shared ``FleetLoop`` (one per operator). Decisions come
from the pure policies; this class does the reading and the writing: status
fields, one Event per action, metrics, the pod-deletion-cost mark before a
scale-in, and evictions for fragmentation remediation.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

from ..api import SpecError, parse_spec
from ..api import v1alpha1 as t
from ..audit import fragmentation as frag
from ..autoscale import policy
from ..autoscale.signals import bucket_delta, quantile_from_buckets
from ..kube.errors import ApiError
from ..manifests import names
from ..reconcile import conditions as cond

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
TTFT_WINDOW_S = 60
FIRST_AUDIT_DELAY_S = 15


def readable_replicas(pods: list[dict]) -> list[dict]:
    """Replica views ({name, ip, ready, deleting}) that serve traffic and can be read."""
    return [p for p in pods if p["ready"] and p.get("ip") and not p["deleting"]]


class ServiceLoop:
    def __init__(self, runtime, namespace: str, name: str):
        self.rt = runtime
        self.ns, self.name = namespace, name
        self.state = policy.PolicyState()
        self.ttft_history: collections.deque = collections.deque()
        self.last_audit: float | None = None
        self._spec_key: tuple | None = None
        self._spec = None

    def spec_of(self, body: dict):
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

    async def read_replicas(self, pods: list[dict]):
        ready = readable_replicas(pods)
        samples = await asyncio.gather(*(self.rt.reader.sample(p["name"], p["ip"]) for p in ready))
        for s in samples:
            if not s.ok:
                self.rt.metrics.read_errors.labels(self.ns, self.name).inc()
        return ready, list(samples)

    def ttft_p99(self, samples, now: float) -> float | None:
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

    async def tick(self, body: dict, pods: list[dict], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        spec = self.spec_of(body)
        if spec is None:
            return  # the reconciler reports InvalidSpec
        status = body.get("status") or {}
        ready, samples = await self.read_replicas(pods)
        updates: dict = {}
        kv = [s.kv_usage for s in samples if s.ok and s.kv_usage is not None]
        if kv:
            mean = sum(kv) / len(kv)
            self.rt.metrics.kv_usage.labels(self.ns, self.name).set(mean)
            updates["kvCacheUsagePercent"] = round(mean * 100)
        p99 = self.ttft_p99(samples, now)
        if p99 is not None:
            updates["ttftP99Milliseconds"] = round(p99 * 1000)
        if spec.autoscaling.mode == "Auto":
            await self.autoscale(body, spec, status, ready, samples, now, updates)
        if updates:
            await self.rt.controller.write_status(body, updates)
        if self.audit_due(body, spec, now):
            await self.audit(body, spec, ready, now)

    async def autoscale(self, body, spec, status, ready, samples, now, updates) -> None:
        current = status.get("desiredReplicas") or spec.autoscaling.min_replicas
        th = policy.Thresholds.from_spec(spec.autoscaling)
        decision, self.state, obs = policy.decide(th, current=current, ready=status.get("readyReplicas", 0),
                                                  samples=samples, state=self.state, now=now)
        if obs.unreadable:
            updates["conditions"] = cond.merge(status.get("conditions", []), [cond.condition(
                cond.SCALING, False, "MetricsUnavailable",
                f"cannot read {', '.join(obs.unreadable)}; not scaling in until they answer")], cond.now_iso())
        if decision is None or decision.target == current:
            return
        if decision.target < current:
            victim = policy.least_loaded(samples)
            if victim:
                await self.mark_for_removal(victim)
        stamp = cond.now_iso()
        direction = "up" if decision.target > current else "down"
        updates["desiredReplicas"] = decision.target
        updates["lastScaling"] = {"time": stamp, "from": current, "to": decision.target,
                                  "reason": decision.reason, "message": decision.message}
        updates["conditions"] = cond.merge(updates.get("conditions") or status.get("conditions", []), [
            cond.condition(cond.SCALING, True, decision.reason,
                           f"{current} -> {decision.target}: {decision.message}")], stamp)
        # The Event goes first: if the operator dies between the writes, the record of
        # the decision survives and its successor completes it from status.
        event_reason = "ScaledUp" if direction == "up" else "ScaledDown"
        await self.rt.kube.event(body, reason=event_reason,
                                 message=f"{current} -> {decision.target} replicas ({decision.reason}): "
                                         f"{decision.message}")
        await self.rt.controller.write_status(body, updates)
        updates.clear()
        self.rt.metrics.decisions.labels(self.ns, self.name, direction).inc()
        log.info("%s/%s: %s %d -> %d (%s)", self.ns, self.name, event_reason, current, decision.target,
                 decision.message)
        await self.rt.controller.reconcile(body)  # applies the new replica count to the Deployment

    async def mark_for_removal(self, pod: str) -> None:
        """The ReplicaSet removes the pod with the lowest deletion cost first."""
        try:
            await self.rt.kube.merge_patch("v1", "Pod", pod, {"metadata": {"annotations": {
                DELETION_COST: "-1000"}}}, self.ns)
        except ApiError as e:
            log.warning("could not mark %s for scale-in: %s", pod, e)

    # --- fragmentation audit ---------------------------------------------------------

    def audit_due(self, body, spec, now: float) -> bool:
        requested = (body.get("metadata", {}).get("annotations") or {}).get(names.ANNOTATION_AUDIT_REQUEST)
        if requested:
            return True
        interval = spec.audit.fragmentation.interval_seconds
        if self.last_audit is None:  # first audit soon after start, then on the interval
            self.last_audit = now - interval + FIRST_AUDIT_DELAY_S
        return now - self.last_audit >= interval

    async def audit(self, body, spec, ready, now: float) -> None:
        self.last_audit = now
        reports = await asyncio.gather(*(self.rt.reader.audit(p["name"], p["ip"]) for p in ready))
        replicas = [frag.replica_from_report(p["name"], rep, err) for p, (rep, err) in zip(ready, reports)]
        cfg = spec.audit.fragmentation
        result = frag.evaluate(replicas, cfg.threshold_percent / 100, cfg.remediation)
        stamp = cond.now_iso()
        previous = (body.get("status") or {}).get("fragmentation") or {}
        fstatus = {"percent": None if result.ratio is None else round(result.ratio * 100),
                   "worstReplica": result.worst, "time": stamp, "verdict": result.verdict,
                   "recommendation": result.recommendation}
        ok = result.verdict != "AboveThreshold"
        conds = cond.merge((body.get("status") or {}).get("conditions", []), [cond.condition(
            cond.FRAGMENTATION_OK, True if ok else False, result.verdict, result.recommendation)], stamp)
        await self.rt.controller.write_status(body, {"fragmentation": fstatus, "conditions": conds})
        if result.ratio is not None:
            self.rt.metrics.fragmentation.labels(self.ns, self.name).set(result.ratio)
        if result.verdict == "AboveThreshold":
            await self.rt.kube.event(body, reason="FragmentationHigh", type_="Warning",
                                     message=f"{result.worst}: {result.ratio:.0%} > "
                                             f"{cfg.threshold_percent}%; {result.recommendation}")
            if cfg.remediation == "RestartReplica":
                await self.remediate(body, result.worst)
        elif result.verdict != previous.get("verdict"):
            await self.rt.kube.event(body, reason=f"Fragmentation{result.verdict}", message=result.recommendation)
        annotations = body.get("metadata", {}).get("annotations") or {}
        if names.ANNOTATION_AUDIT_REQUEST in annotations:
            await self.rt.kube.merge_patch(t.API_VERSION, t.KIND, self.name, {"metadata": {"annotations": {
                names.ANNOTATION_AUDIT_REQUEST: None}}}, self.ns)

    async def remediate(self, body, pod: str) -> None:
        status = body.get("status") or {}
        pdb = await self.rt.kube.get_or_none("policy/v1", "PodDisruptionBudget", names.pdb_name(self.name), self.ns)
        allowed = (pdb or {}).get("status", {}).get("disruptionsAllowed", 0)
        ok, why = frag.can_restart(ready_replicas=status.get("readyReplicas", 0),
                                   desired_replicas=status.get("desiredReplicas", 0), pdb_disruptions_allowed=allowed)
        if not ok:
            await self.rt.kube.event(body, reason="RemediationDeferred", type_="Warning",
                                     message=f"not restarting {pod}: {why}")
            return
        try:  # the Eviction API re-checks the budget atomically
            await self.rt.kube.request("POST", f"/api/v1/namespaces/{self.ns}/pods/{pod}/eviction", body={
                "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": self.ns}})
            await self.rt.kube.event(body, reason="ReplicaRestarted",
                                     message=f"evicted {pod} to clear GPU memory fragmentation")
        except ApiError as e:
            await self.rt.kube.event(body, reason="RemediationDeferred", type_="Warning",
                                     message=f"eviction of {pod} refused: {e.message}")
