"""One reconciliation of one InferenceService: parse → decide → apply → status.

The decisions are pure (``reconcile.*``, ``manifests.*``); this module only
sequences them and does the I/O through the one ``KubeClient``.

Work on one service is serialised: every reconcile and every autoscaler
action takes the service's lock and re-reads the object inside it, so a copy
read before the autoscaler's write can never re-apply an old replica count.
Status is written per condition type over the freshest copy, guarded by its
resourceVersion, so the writers (reconcile, autoscaler, audits) never put back
each other's conditions from stale copies.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import datetime, timezone
from typing import AsyncIterator, Callable, Mapping, Sequence

from gpufleet_api import SpecError, parse_spec
from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.errors import ApiError, Conflict

from ..manifests.network_policy import EngineIngress
from ..metrics import OperatorMetrics
from ..reconcile import conditions as cond
from ..reconcile import drains, name_conflicts
from ..reconcile.desired import CanaryChildren, draining_roles, stale_deployments
from ..reconcile.events import Event, drain_events, transition_events
from ..reconcile.ownership import CHILD_CONFLICT, cleared
from ..reconcile.replicas import desired_replicas
from ..reconcile.status import crashlooping_pods, derive_status, invalid_status, rejected_for
from ..reconcile.validation import validate
from ..rollout import steps
from ..rollout.status import rollout_conditions, rollout_patch
from .children import ServiceChildren
from .gateway import ServiceGateway

log = logging.getLogger(__name__)

STATUS_WRITE_ATTEMPTS = 5

StatusUpdate = tuple[dict, list[dict]]  # (status fields, conditions by type)


class Controller:
    def __init__(self, kube: KubeClient, metrics: OperatorMetrics, clock: Callable[[], float] = time.monotonic, *,
                 podmonitor_labels: Mapping[str, str] | None = None, engine_ingress: EngineIngress | None = None,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 adapter_private_sources: bool = False):
        self.kube = kube
        self.metrics = metrics
        self._clock = clock
        # The children's reads and writes; its cordon index and applied-children memory are the ones the
        # runtime's watches feed.
        self.children = ServiceChildren(kube, metrics, clock, podmonitor_labels=podmonitor_labels,
                                        engine_ingress=engine_ingress, wall=wall,
                                        adapter_private_sources=adapter_private_sources)
        self.cordons, self.applied = self.children.cordons, self.children.applied
        # spec.gateway's InferencePool and HTTPRoute: reported in GatewayReady, never failing the reconcile.
        self.gateway = ServiceGateway(kube, clock)
        # Who owns each model name across namespaces, fed by the runtime's watches: a service that lost its
        # name gets the NameConflict condition in its reconcile.
        self.names = name_conflicts.NameClaimIndex()
        # (namespace, name) -> monotonic time of the last successful reconcile, whoever asked for it
        self.last_reconciled: dict[tuple[str, str], float] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def conflict_retry_in(self, namespace: str, name: str) -> float | None:
        """Seconds until the service's children are looked at again for a name another object holds
        (ChildConflict; None: no conflict). That object is not watched: the runtime asks again then."""
        rejection = self.children.rejections.get((namespace, name))
        if rejection is None or not rejection.conflict:
            return None
        return max(0.0, rejection.retry_at - self._clock())

    async def get(self, namespace: str, name: str) -> dict | None:
        return await self.kube.get_or_none(t.API_VERSION, t.KIND, name, namespace)

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.last_reconciled.pop(key, None)
        self.children.rejections.pop(key, None)
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            del self._locks[key]

    # --- serialisation ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def locked(self, namespace: str, name: str) -> AsyncIterator[dict | None]:
        """Hold the service's lock; yields its freshest copy, None when it is gone or going."""
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            isvc = await self.get(namespace, name)
            yield None if isvc is None or isvc["metadata"].get("deletionTimestamp") else isvc

    async def reconcile(self, isvc: dict, apply_children: bool = True) -> None:
        """Reconcile the service ``isvc`` names (the copy itself may be stale: it is re-read under the lock)."""
        meta = isvc["metadata"]
        await self.reconcile_key(meta["namespace"], meta["name"], apply_children)

    async def reconcile_key(self, namespace: str, name: str, apply_children: bool = True) -> None:
        async with self.locked(namespace, name) as fresh:
            if fresh is not None:
                await self.reconcile_locked(fresh, apply_children)

    # --- status -------------------------------------------------------------------

    async def write_status(self, isvc: dict, fields: dict | None = None, conditions: Sequence[dict] = ()) -> None:
        """Write changed status fields, and ``conditions`` merged by type over the freshest copy."""
        await self.update_status(isvc, lambda _status: (fields or {}, list(conditions)))

    async def update_status(self, isvc: dict, compute: Callable[[dict], StatusUpdate]) -> None:
        """``compute(status) -> (fields, conditions by type)``, run on ``isvc``'s status.

        A write that replaces ``conditions`` (a list the merge patch replaces whole)
        carries the resourceVersion it was computed from; on a conflict the object is
        re-read and ``compute`` runs again on what another writer left. ``isvc`` is
        updated in place to what the server stored.
        """
        meta = isvc["metadata"]
        for _attempt in range(STATUS_WRITE_ATTEMPTS):
            current = isvc.get("status") or {}
            fields, updates = compute(current)
            patch = {k: v for k, v in fields.items() if current.get(k) != v}
            body: dict = {"status": patch}
            if updates:
                merged = cond.merge(current.get("conditions", []), updates, cond.now_iso())
                if not cond.same(merged, current.get("conditions")):
                    patch["conditions"] = merged
                    body["metadata"] = {"resourceVersion": meta.get("resourceVersion")}
            if not patch:
                return
            try:
                stored = await self.kube.merge_patch(t.API_VERSION, t.KIND, meta["name"], body,
                                                     meta["namespace"], subresource="status")
            except Conflict:
                fresh = await self.get(meta["namespace"], meta["name"])
                if fresh is None:
                    return
                isvc["status"] = fresh.get("status") or {}
                meta["resourceVersion"] = fresh["metadata"].get("resourceVersion")
                continue
            isvc["status"] = stored.get("status") or {**current, **patch}
            meta["resourceVersion"] = stored.get("metadata", {}).get("resourceVersion", meta.get("resourceVersion"))
            return
        raise Conflict(409, "Conflict", f"status of {meta['namespace']}/{meta['name']} kept changing under "
                                        f"{STATUS_WRITE_ATTEMPTS} writes")

    # --- reconcile ----------------------------------------------------------------

    async def reconcile_locked(self, isvc: dict, apply_children: bool = True) -> None:
        """Apply the children for the spec, then derive status from what runs.

        The caller holds the service's lock and read ``isvc`` inside it. ``apply_children=False``
        only refreshes status (a pod changed: nothing of ours to re-apply); it still applies
        when this generation never was, or when a refused child is due another try.
        """
        started = self._clock()
        meta = isvc["metadata"]
        ns, name, gen = meta["namespace"], meta["name"], meta.get("generation", 0)
        key = (ns, name)
        previous = isvc.get("status") or {}
        rejections = self.children.rejections
        rejection = rejections.get(key)
        if rejection is not None and rejection.generation != gen:
            rejection = rejections.pop(key)  # a new spec: try it at once
        if previous.get("observedGeneration") != gen or (
                rejected_for(previous, gen) and (rejection is None or started >= rejection.retry_at)):
            apply_children = True
        if (previous.get("rollout") or {}).get("canaryRevision"):
            # A canary's steps move on what its Deployments' status shows (a promotion ends when the
            # stable Deployment has rolled out): while one runs, a status move runs the plan too.
            apply_children = True
        try:
            try:
                spec = parse_spec(isvc.get("spec"))
                problems = validate(spec)
            except SpecError as e:
                spec, problems = None, [str(e)]
            if problems:
                await self._report_invalid(isvc, problems)
                self.metrics.reconcile_total.labels("InferenceService", "invalid_spec").inc()
                return
            assert spec is not None  # a spec that did not parse has its problem listed
            self.metrics.set_spec_gauges(ns, name, spec)
            by_pool = desired_replicas(spec, previous)
            replicas = sum(by_pool.values())
            rejected: list[dict] | None = None
            # Read before the apply: the guard ConfigMap keeps the guard.json of a pool whose pods
            # still run (draining after a change of shape; their preStop hook reads it).
            pods = await self.children.engine_pods(ns, name)
            # Pods on cordoned nodes (kubectl drain): their replacements start before they are evicted.
            surge = drains.surge(pods, await self.children.cordoned_nodes(pods))
            if drains.changed(previous.get(drains.FIELD), surge):
                apply_children = True
            plan: steps.Plan | None = None
            canary: CanaryChildren | None = None
            if apply_children:
                plan, canary = await self.children.rollout_plan(isvc, spec, by_pool, pods)
                rejected = await self.children.apply(isvc, spec, by_pool, draining_roles(pods, spec), surge, canary)
            observed, deployments = await self.children.observe(ns, name, pods)
            keep_rejection = not apply_children and rejected_for(previous, gen)
            conflict = rejected is not None and cond.get(rejected, CHILD_CONFLICT) is not None
            if not rejected and not keep_rejection:
                stale = stale_deployments(isvc, spec, deployments)
                await self.children.prune(isvc, stale, observed, spec)
                # Stale budgets come with a change of shape, or (a disaggregated service's) from an
                # operator that made one budget over every pool: no extra list for the others.
                if apply_children and (stale or spec.disaggregation is not None):
                    await self.children.prune_budgets(isvc, spec)
            if plan is not None and not rejected:
                await self._post(isvc, plan.events)
            gateway = await self.gateway.reconcile(isvc, spec, apply=apply_children)

            def compute(current: dict) -> StatusUpdate:
                status = derive_status(service=name, namespace=ns, generation=gen, spec=spec, desired=replicas,
                                       observed=observed, previous=current,
                                       pool_desired=by_pool if spec.disaggregation is not None else None,
                                       surge=surge)
                updates = status.pop("conditions")
                # What the Deployments were given: a refused apply leaves the surge to its retry.
                status[drains.FIELD] = current.get(drains.FIELD) if rejected else drains.status(surge)
                if plan is not None and not rejected:
                    status["rollout"] = rollout_patch(current.get("rollout"), plan.rollout)
                    updates = rollout_conditions(plan.rollout, updates, gen)
                if rejected:
                    updates = rejected + [u for u in updates if u["type"] not in (cond.READY, cond.PROGRESSING)]
                elif keep_rejection:  # refreshing counts only: the refusal stands until the next try
                    updates = [u for u in updates if u["type"] not in (cond.READY, cond.PROGRESSING)]
                updates += name_conflicts.condition(self.names.conflict(t.KIND, ns, name),
                                                    current.get("conditions"), gen)
                if apply_children and not conflict:  # every child's name was looked at and is the service's
                    updates += cleared(current, gen)
                if gateway.fields is not None:
                    status.update(gateway.fields)
                if gateway.condition is not None:
                    updates.append(gateway.condition)
                return status, updates

            first = compute(previous)[1]
            await self._post(isvc, transition_events(isvc, previous, first, observed))
            name_conflict = name_conflicts.started(previous.get("conditions"), first)
            if name_conflict is not None:
                await self._post(isvc, [Event(cond.NAME_CONFLICT, name_conflict, "Warning")])
            if not rejected:
                await self._post(isvc, drain_events(previous.get(drains.FIELD), surge))
            await self.update_status(isvc, compute)
            if apply_children and not rejected and (canary is None or canary.canary_replicas is None):
                # After the status that sets its weight to 0: the router stops sending it requests
                # first; those it holds drain in its pods' preStop hooks.
                await self.children.remove_canary(isvc, deployments)
            status = isvc.get("status") or {}
            self.metrics.desired_replicas.labels(ns, name).set(replicas)
            self.metrics.ready_replicas.labels(ns, name).set(status.get("readyReplicas", 0))
            self.metrics.crashlooping.labels(ns, name).set(len(crashlooping_pods(observed.pods)))
            result = "child_conflict" if conflict else "child_rejected" if rejected else "ok"
            self.metrics.reconcile_total.labels("InferenceService", result).inc()
            self.last_reconciled[key] = self._clock()
        except ApiError:
            self.metrics.reconcile_errors.labels(ns, name).inc()
            self.metrics.reconcile_total.labels("InferenceService", "error").inc()
            raise
        finally:
            self.metrics.reconcile_seconds.observe(self._clock() - started)

    async def _report_invalid(self, isvc: dict, problems: list[str]) -> None:
        meta = isvc["metadata"]
        status = invalid_status(generation=meta.get("generation", 0), problems=problems)
        updates = status.pop("conditions")
        old = cond.get((isvc.get("status") or {}).get("conditions"), cond.READY)
        new = cond.get(updates, cond.READY)
        assert new is not None  # invalid_status always says Ready=False
        if not old or old.get("message") != new["message"]:
            await self.kube.event(isvc, reason="InvalidSpec", message=new["message"], type_="Warning")
        await self.write_status(isvc, status, updates)

    async def _post(self, isvc: dict, events: Sequence[Event]) -> None:
        for e in events:
            await self.kube.event(isvc, reason=e.reason, message=e.message, type_=e.type_)
