"""One reconciliation of one InferenceService: parse → decide → apply → status.

The decisions are pure (``reconcile.*``, ``manifests.*``); this module only
sequences them and does the I/O through the one ``KubeClient``.
"""
from __future__ import annotations

import logging
import time

from .api import SpecError, parse_spec
from .api import v1alpha1 as t
from .kube.client import KubeClient
from .kube.errors import ApiError
from .manifests import names
from .metrics import OperatorMetrics
from .reconcile import conditions as cond
from .reconcile.desired import desired_children
from .reconcile.replicas import target_replicas
from .reconcile.status import Observed, crashlooping_pods, derive_status, invalid_status, unschedulable_pods
from .reconcile.validation import validate

log = logging.getLogger(__name__)

PODMONITOR_API = "monitoring.coreos.com/v1"


class Controller:
    def __init__(self, kube: KubeClient, metrics: OperatorMetrics):
        self.kube = kube
        self.metrics = metrics
        self._podmonitor_checked_at = 0.0
        self._has_podmonitor = False
        # (namespace, name) -> monotonic time of the last successful reconcile, whoever asked for it
        self.last_reconciled: dict[tuple[str, str], float] = {}

    async def has_podmonitor(self) -> bool:
        # The Prometheus Operator may be installed after us: re-discover now and then.
        if time.monotonic() - self._podmonitor_checked_at > 300:
            self.kube.forget_discovery()
            self._has_podmonitor = await self.kube.has_kind(PODMONITOR_API, "PodMonitor")
            self._podmonitor_checked_at = time.monotonic()
        return self._has_podmonitor

    async def get(self, namespace: str, name: str) -> dict | None:
        return await self.kube.get_or_none(t.API_VERSION, t.KIND, name, namespace)

    async def observe(self, namespace: str, service: str) -> Observed:
        dep = await self.kube.get_or_none("apps/v1", "Deployment", names.deployment_name(service), namespace)
        pods = await self.kube.list("v1", "Pod", namespace, label_selector=names.selector_string(service))
        return Observed(deployment=dep, pods=pods)

    async def write_status(self, isvc: dict, status: dict) -> None:
        previous = isvc.get("status") or {}
        changed = {k: v for k, v in status.items() if previous.get(k) != v}
        if not changed:
            return
        meta = isvc["metadata"]
        await self.kube.merge_patch(t.API_VERSION, t.KIND, meta["name"], {"status": changed},
                                    meta["namespace"], subresource="status")
        isvc["status"] = {**previous, **changed}

    async def reconcile(self, isvc: dict, apply_children: bool = True) -> None:
        """Apply the children for the spec, then derive status from what runs.

        ``apply_children=False`` only refreshes status (a pod changed: nothing of
        ours to re-apply); it still applies when this generation never was.
        """
        started = time.monotonic()
        meta = isvc["metadata"]
        ns, name, gen = meta["namespace"], meta["name"], meta.get("generation", 0)
        previous = isvc.get("status") or {}
        if previous.get("observedGeneration") != gen:
            apply_children = True
        now = cond.now_iso()
        try:
            try:
                spec = parse_spec(isvc.get("spec"))
                problems = validate(spec)
            except SpecError as e:
                spec, problems = None, [str(e)]
            if problems:
                await self._report_invalid(isvc, problems, previous, now)
                self.metrics.reconcile_total.labels("InferenceService", "invalid_spec").inc()
                return
            self.metrics.set_spec_gauges(ns, name, spec)
            replicas = target_replicas(spec, previous)
            if apply_children:
                for obj in desired_children(isvc, spec, replicas, with_podmonitor=await self.has_podmonitor()):
                    await self.kube.apply(obj)
            observed = await self.observe(ns, name)
            status = derive_status(service=name, namespace=ns, generation=gen, spec=spec, desired=replicas,
                                   observed=observed, previous=previous, now=now)
            await self._events_for_transitions(isvc, previous, status, observed)
            await self.write_status(isvc, status)
            self.metrics.desired_replicas.labels(ns, name).set(replicas)
            self.metrics.ready_replicas.labels(ns, name).set(status["readyReplicas"])
            self.metrics.crashlooping.labels(ns, name).set(len(crashlooping_pods(observed.pods)))
            self.metrics.reconcile_total.labels("InferenceService", "ok").inc()
            self.last_reconciled[(ns, name)] = time.monotonic()
        except ApiError:
            self.metrics.reconcile_errors.labels(ns, name).inc()
            self.metrics.reconcile_total.labels("InferenceService", "error").inc()
            raise
        finally:
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)

    async def _report_invalid(self, isvc: dict, problems: list[str], previous: dict, now: str) -> None:
        meta = isvc["metadata"]
        status = invalid_status(generation=meta.get("generation", 0), problems=problems, previous=previous, now=now)
        old = cond.get(previous.get("conditions"), cond.READY)
        new = cond.get(status["conditions"], cond.READY)
        if not old or old.get("message") != new["message"]:
            await self.kube.event(isvc, reason="InvalidSpec", message=new["message"], type_="Warning")
        await self.write_status(isvc, status)

    async def _events_for_transitions(self, isvc: dict, previous: dict, status: dict, observed: Observed) -> None:
        """One Event per change a human should see in `kubectl describe`, not one per reconcile."""
        old_ready = cond.get(previous.get("conditions"), cond.READY) or {}
        new_ready = cond.get(status["conditions"], cond.READY)
        stuck = unschedulable_pods(observed.pods)
        old_prog = cond.get(previous.get("conditions"), cond.PROGRESSING) or {}
        new_prog = cond.get(status["conditions"], cond.PROGRESSING)
        if stuck and old_prog.get("reason") != "InsufficientCapacity":
            pod, msg = stuck[0]
            await self.kube.event(isvc, reason="Unschedulable", type_="Warning",
                                  message=f"replica {pod} cannot be placed without breaking "
                                          f"{isvc['spec'].get('isolation', {}).get('mode', 'Dedicated')} isolation "
                                          f"or its pool/product constraints: {msg}")
        if new_ready["status"] != old_ready.get("status") or new_ready["reason"] != old_ready.get("reason"):
            kind = "Normal" if new_ready["status"] == "True" else "Warning"
            if old_ready or new_ready["status"] == "True":
                await self.kube.event(isvc, reason=new_ready["reason"], message=new_ready["message"], type_=kind)
        if new_prog["reason"] == "RollingOut" and old_prog.get("reason") != "RollingOut":
            await self.kube.event(isvc, reason="RollingOut", message=new_prog["message"])
