"""A service's fragmentation audit, and the restart of a replica losing memory to it.

Ticked by the service's loop (``service_loop.ServiceLoop``) when ``due``: every replica's /audit
report is judged by ``audit.fragmentation.evaluate`` (against the counters of the last audit), the
verdict written to ``status.fragmentation`` and the FragmentationOK condition, and, under
remediation RestartReplica, the replica losing memory deleted, only under every rule of
``audit.fragmentation.may_restart``. On a disaggregated service a replica is judged against the
other replicas of its own pool.
"""
from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Callable, Sequence

from gpufleet_api import InferenceServiceSpec
from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.errors import ApiError

from ..audit import fragmentation as frag
from ..autoscale import policy
from ..autoscale.signals import ReplicaSample
from ..manifests import names
from ..reconcile import conditions as cond
from ..reconcile import drains
from .pod_views import role_of
from .ports import ServicePorts

FIRST_AUDIT_DELAY_S = 15


class FragmentationAuditor:
    """``scaling_in``: whether a scale-in is under way (this pass's, or a replica still marked for
    one): no restart then."""

    def __init__(self, ports: ServicePorts, namespace: str, name: str, scaling_in: Callable[[], bool]):
        self.ports = ports
        self.ns, self.name = namespace, name
        self.scaling_in = scaling_in
        self.last_audit: float | None = None
        self.baseline: dict[str, tuple[int, int]] = {}  # pod -> (alloc retries, OOMs) at the last audit
        self.watching_since: float | None = None  # first tick of this operator process for the service

    def watching(self, now: float) -> None:
        """This operator process ticks the service from ``now`` on, unless it already did (no burst
        of restarts after a start)."""
        if self.watching_since is None:
            self.watching_since = now

    def due(self, body: dict, spec: InferenceServiceSpec, now: float) -> bool:
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
        result = frag.evaluate(replicas, cfg.threshold_percent / 100, cfg.remediation, self.baseline)
        self.baseline = frag.counters(replicas)
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
            scaling_in=self.scaling_in(),
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
                                      message=f"deleted {pod}: GPU memory fragmented and allocation retries or "
                                              f"OOMs rising ({why})")
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
