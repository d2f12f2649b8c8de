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
import dataclasses
import logging
import time
from datetime import datetime, timezone
from typing import AsyncIterator, Callable, Iterable, Mapping, Sequence

from gpufleet_api import SpecError, parse_spec
from gpufleet_api import v1alpha1 as t
from gpufleet_api.guard.guard_config import Role
from gpufleet_kit.backoff import delay
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.errors import ApiError, Conflict

from .manifests import names, revision
from .manifests.guard_config import read_running
from .manifests.network_policy import EngineIngress
from .manifests.pools import POOL_ROLES, pools
from .metrics import OperatorMetrics
from .reconcile import conditions as cond
from .reconcile import drains
from .reconcile.child_events import AppliedChildren
from .reconcile.desired import (
    CanaryChildren,
    desired_children,
    draining_roles,
    spec_revision,
    stale_budgets,
    stale_deployments,
)
from .reconcile.replicas import desired_replicas
from .reconcile.status import (
    CHILD_REJECTED,
    Observed,
    child_rejected_conditions,
    crashlooping_pods,
    derive_status,
    invalid_status,
    rejected_for,
    unschedulable_pods,
)
from .reconcile.validation import validate
from .rollout import steps
from .rollout.status import rollout_conditions, rollout_patch

log = logging.getLogger(__name__)

PODMONITOR_API = "monitoring.coreos.com/v1"
STATUS_WRITE_ATTEMPTS = 5
# A refused child is not retried in a loop: the next spec change retries at
# once, otherwise the apply is tried again after this backoff (doubling).
REJECTED_RETRY_FIRST_S = 60.0
REJECTED_RETRY_MAX_S = 600.0  # under the 300 s resync plus this, every 15 min sees a try (the alert)

StatusUpdate = tuple[dict, list[dict]]  # (status fields, conditions by type)


def refused(e: ApiError) -> bool:
    """The API server will not take this object as it is: retrying the same
    request cannot succeed (schema or admission said no, or we may not)."""
    return e.status in (400, 403, 422) and not e.namespace_terminating


@dataclasses.dataclass
class _Rejection:
    generation: int
    retry_at: float
    failures: int   # in a row, of this generation


class Controller:
    def __init__(self, kube: KubeClient, metrics: OperatorMetrics, clock: Callable[[], float] = time.monotonic, *,
                 podmonitor_labels: Mapping[str, str] | None = None, engine_ingress: EngineIngress | None = None,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        self.kube = kube
        self._wall = wall  # the time a canary step starts (status.rollout.stepStartedAt)
        self.metrics = metrics
        self._clock = clock
        self._podmonitor_checked_at = -1e9
        self._has_podmonitor = False
        self._podmonitor_lock = asyncio.Lock()
        # Labels every PodMonitor gets, so the cluster's Prometheus selects it (--podmonitor-label).
        self.podmonitor_labels: Mapping[str, str] = podmonitor_labels or {}
        # Who may reach the engines' guard port; None: no NetworkPolicy (--network-policies).
        self.engine_ingress = engine_ingress
        # (namespace, name) -> monotonic time of the last successful reconcile, whoever asked for it
        self.last_reconciled: dict[tuple[str, str], float] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._rejections: dict[tuple[str, str], _Rejection] = {}
        # Cordoned nodes and the services with pods on them, fed by the runtime's watches.
        self.cordons = drains.CordonIndex()
        # What this operator last stored of each child: its own writes' watch events ask for nothing.
        self.applied = AppliedChildren()

    async def has_podmonitor(self) -> bool:
        # The Prometheus Operator may be installed after us: re-discover now and then. One asks at a
        # time: a burst of reconciles would each clear the discovery cache and ask again.
        async with self._podmonitor_lock:
            if self._clock() - self._podmonitor_checked_at > 300:
                self.kube.forget_discovery()
                self._has_podmonitor = await self.kube.has_kind(PODMONITOR_API, "PodMonitor")
                self._podmonitor_checked_at = self._clock()
        return self._has_podmonitor

    async def get(self, namespace: str, name: str) -> dict | None:
        return await self.kube.get_or_none(t.API_VERSION, t.KIND, name, namespace)

    def forget(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.last_reconciled.pop(key, None)
        self._rejections.pop(key, None)
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

    async def engine_pods(self, namespace: str, service: str) -> list[dict]:
        return await self.kube.list("v1", "Pod", namespace, label_selector=names.selector_string(service))

    async def observe(self, namespace: str, service: str, pods: list[dict]) -> tuple[Observed, list[dict]]:
        """What runs (``pods``: the service's engine pods), and every Deployment of the service's
        (labelled as its children are), which includes those of a shape it no longer has."""
        selector = names.selector_string(service)
        deployments = await self.kube.list("apps/v1", "Deployment", namespace, label_selector=selector)
        by_name = {d["metadata"]["name"]: d for d in deployments}
        return Observed(deployment=by_name.get(names.deployment_name(service)), pods=pods,
                        pools={role: by_name.get(names.deployment_name(service, role)) for role in POOL_ROLES}), \
            deployments

    async def cordoned_nodes(self, pods: list[dict]) -> set[str]:
        """The nodes of ``pods`` that are cordoned: as the node watch showed them, or read once when it
        has not shown one yet (a reconcile right after the operator starts)."""
        out = set()
        for node in drains.node_names(pods):
            known = self.cordons.cordoned(node)
            if known is None:
                obj = await self.kube.get_or_none("v1", "Node", node)
                if obj is None:
                    continue
                known = bool((obj.get("spec") or {}).get("unschedulable"))
                self.cordons.node_seen(node, known)
            if known:
                out.add(node)
        return out

    async def prune_budgets(self, isvc: dict, spec: t.InferenceServiceSpec) -> None:
        """Delete the PodDisruptionBudgets of the shape the service left (or the one budget over every
        pool an older operator made): a pod under two budgets cannot be evicted at all."""
        meta = isvc["metadata"]
        budgets = await self.kube.list("policy/v1", "PodDisruptionBudget", meta["namespace"],
                                       label_selector=names.selector_string(meta["name"]))
        for pdb in stale_budgets(isvc, spec, budgets):
            if await self.kube.delete("policy/v1", "PodDisruptionBudget", pdb["metadata"]["name"], meta["namespace"]):
                log.info("%s/%s: deleted PodDisruptionBudget %s of its former shape", meta["namespace"],
                         meta["name"], pdb["metadata"]["name"])

    async def drain_events(self, isvc: dict, previous: dict | None, surge: drains.Surge) -> None:
        """One Event when the surge for cordoned nodes starts or changes, one when it ends."""
        if not drains.changed(previous, surge):
            return
        if surge.total:
            await self.kube.event(isvc, reason="DrainSurge", message=drains.message(surge))
        else:
            await self.kube.event(isvc, reason="DrainSurgeEnded", message=(
                f"no engine pod left on a cordoned node ({', '.join((previous or {}).get('nodes') or [])}); "
                f"back to the desired replicas"))

    async def prune(self, isvc: dict, stale: list[dict], observed: Observed, spec: t.InferenceServiceSpec) -> None:
        """Delete the Deployments of the shape the service left (unified ↔ disaggregated), once every
        Deployment of its new shape exists: the old pods go as the new ones are created, never
        before, so a refused new Deployment leaves the old pool serving."""
        if not stale or any(observed.deployment_of(p.role) is None for p in pools(spec)):
            return
        meta = isvc["metadata"]
        for dep in stale:
            name = dep["metadata"]["name"]
            if await self.kube.delete("apps/v1", "Deployment", name, meta["namespace"]):
                log.info("%s/%s: deleted Deployment %s of its former shape", meta["namespace"], meta["name"], name)
                await self.kube.event(isvc, reason="PoolRemoved", message=(
                    f"deleted Deployment {name}: the service now runs "
                    f"{'prefill and decode pools' if spec.disaggregation else 'one unified pool'}"))

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
        rejection = self._rejections.get(key)
        if rejection is not None and rejection.generation != gen:
            rejection = self._rejections.pop(key)  # a new spec: try it at once
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
            pods = await self.engine_pods(ns, name)
            # Pods on cordoned nodes (kubectl drain): their replacements start before they are evicted.
            surge = drains.surge(pods, await self.cordoned_nodes(pods))
            if drains.changed(previous.get(drains.FIELD), surge):
                apply_children = True
            plan: steps.Plan | None = None
            canary: CanaryChildren | None = None
            if apply_children:
                plan, canary = await self._rollout_plan(isvc, spec, by_pool, pods)
                rejected = await self._apply_children(isvc, spec, by_pool, draining_roles(pods, spec), surge, canary)
            observed, deployments = await self.observe(ns, name, pods)
            keep_rejection = not apply_children and rejected_for(previous, gen)
            if not rejected and not keep_rejection:
                stale = stale_deployments(isvc, spec, deployments)
                await self.prune(isvc, stale, observed, spec)
                # Stale budgets come with a change of shape, or (a disaggregated service's) from an
                # operator that made one budget over every pool: no extra list for the others.
                if apply_children and (stale or spec.disaggregation is not None):
                    await self.prune_budgets(isvc, spec)
            if plan is not None and not rejected:
                for reason, message, type_ in plan.events:
                    await self.kube.event(isvc, reason=reason, message=message, type_=type_)

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
                return status, updates

            await self._events_for_transitions(isvc, previous, compute(previous)[1], observed)
            if not rejected:
                await self.drain_events(isvc, previous.get(drains.FIELD), surge)
            await self.update_status(isvc, compute)
            if apply_children and not rejected and (canary is None or canary.canary_replicas is None):
                # After the status that sets its weight to 0: the router stops sending it requests
                # first; those it holds drain in its pods' preStop hooks.
                await self._remove_canary(isvc, deployments)
            status = isvc.get("status") or {}
            self.metrics.desired_replicas.labels(ns, name).set(replicas)
            self.metrics.ready_replicas.labels(ns, name).set(status.get("readyReplicas", 0))
            self.metrics.crashlooping.labels(ns, name).set(len(crashlooping_pods(observed.pods)))
            self.metrics.reconcile_total.labels("InferenceService", "child_rejected" if rejected else "ok").inc()
            self.last_reconciled[key] = self._clock()
        except ApiError:
            self.metrics.reconcile_errors.labels(ns, name).inc()
            self.metrics.reconcile_total.labels("InferenceService", "error").inc()
            raise
        finally:
            self.metrics.reconcile_seconds.observe(self._clock() - started)

    async def _rollout_plan(self, isvc: dict, spec: t.InferenceServiceSpec, replicas: Mapping[Role, int],
                            pods: list[dict]) -> tuple[steps.Plan | None, CanaryChildren | None]:
        """The canary's plan (``rollout.steps.plan``) and what it changes in the children; (None, None)
        for a service that never had spec.rollout Canary (today's rolling update, no extra reads)."""
        meta = isvc["metadata"]
        ns, name = meta["namespace"], meta["name"]
        previous = (isvc.get("status") or {}).get("rollout")
        canary_spec = spec.rollout is not None and spec.rollout.strategy == "Canary" and spec.disaggregation is None
        if not canary_spec and not previous:
            return None, None
        if spec.disaggregation is not None:
            return steps.Plan(False, None, False, {}), None
        live_stable = await self.kube.get_or_none("apps/v1", "Deployment", names.deployment_name(name), ns)
        live = steps.Live(revision.of_deployment(live_stable), revision.rolled_out(live_stable))
        plan = steps.plan(spec.rollout, unified=True, new=spec_revision(isvc, spec), live=live, previous=previous,
                          now=self._wall())
        stable_running = None
        if plan.stable_keeps_template:
            cm = await self.kube.get_or_none("v1", "ConfigMap", names.configmap_name(name), ns)
            stable_running = read_running(((cm or {}).get("data") or {}).get(names.guard_config_key()))
        draining = any((p["metadata"].get("labels") or {}).get(names.LABEL_TRACK) == names.TRACK_CANARY
                       for p in pods)
        canary = CanaryChildren(
            stable_template=(live_stable or {}).get("spec", {}).get("template") if plan.stable_keeps_template else None,
            stable_running=stable_running,
            canary_replicas=None if plan.canary_weight is None else
            steps.canary_replicas(plan.canary_weight, replicas["unified"]),
            canary_key=plan.canary_weight is not None or draining, promoting=plan.promoting)
        return plan, canary

    async def _remove_canary(self, isvc: dict, deployments: list[dict]) -> None:
        """Delete ``<service>-canary`` when no canary is wanted (its guards drain in their preStop hook)."""
        meta = isvc["metadata"]
        name = names.canary_deployment_name(meta["name"])
        if any(d["metadata"]["name"] == name for d in deployments):
            if await self.kube.delete("apps/v1", "Deployment", name, meta["namespace"]):
                log.info("%s/%s: deleted Deployment %s (no canary now)", meta["namespace"], meta["name"], name)

    async def _apply_children(self, isvc: dict, spec, replicas: Mapping[Role, int],
                              draining: Iterable[Role] = (), surge: drains.Surge | None = None,
                              canary: CanaryChildren | None = None) -> list[dict] | None:
        """Apply every child; the conditions that report a refused one (None when all were taken)."""
        meta = isvc["metadata"]
        key, gen = (meta["namespace"], meta["name"]), meta.get("generation", 0)
        for obj in desired_children(isvc, spec, replicas, with_podmonitor=await self.has_podmonitor(),
                                     podmonitor_labels=self.podmonitor_labels,
                                     engine_ingress=self.engine_ingress, draining_roles=draining, surge=surge,
                                     canary=canary):
            try:
                self.applied.applied(await self.kube.apply(obj))
            except ApiError as e:
                if not refused(e):
                    raise
                log.warning("%s/%s: %s %s refused: %s", key[0], key[1], obj["kind"], obj["metadata"]["name"], e)
                self.metrics.reconcile_errors.labels(*key).inc()
                previous = self._rejections.get(key)
                failures = 1 if previous is None or previous.generation != gen else previous.failures + 1
                pause = delay(failures, REJECTED_RETRY_FIRST_S, REJECTED_RETRY_MAX_S)
                self._rejections[key] = _Rejection(gen, self._clock() + pause, failures)
                return child_rejected_conditions(kind=obj["kind"], name=obj["metadata"]["name"],
                                                 message=e.message, generation=gen)
        self._rejections.pop(key, None)
        return None

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

    async def _events_for_transitions(self, isvc: dict, previous: dict, updates: list[dict],
                                      observed: Observed) -> None:
        """One Event per change a human should see in `kubectl describe`, not one per reconcile."""
        old_ready = cond.get(previous.get("conditions"), cond.READY) or {}
        new_ready = cond.get(updates, cond.READY)
        stuck = unschedulable_pods(observed.pods)
        old_prog = cond.get(previous.get("conditions"), cond.PROGRESSING) or {}
        new_prog = cond.get(updates, cond.PROGRESSING)
        told_stuck = bool(stuck) and old_prog.get("reason") != "InsufficientCapacity"
        if told_stuck:
            pod, msg = stuck[0]
            await self.kube.event(isvc, reason="Unschedulable", type_="Warning",
                                  message=f"replica {pod} cannot be placed without breaking "
                                          f"{isvc['spec'].get('isolation', {}).get('mode', 'Dedicated')} isolation "
                                          f"or its pool/product constraints: {msg}")
        if new_ready is None:
            return
        if new_ready["reason"] == CHILD_REJECTED:
            if old_ready.get("reason") != CHILD_REJECTED or old_ready.get("message") != new_ready["message"]:
                await self.kube.event(isvc, reason=CHILD_REJECTED, message=new_ready["message"], type_="Warning")
        elif told_stuck and new_ready["reason"] == "Unschedulable":
            pass  # Ready=False for the replica just reported: one Event says it, not two
        elif new_ready["status"] != old_ready.get("status") or new_ready["reason"] != old_ready.get("reason"):
            kind = "Normal" if new_ready["status"] == "True" else "Warning"
            if old_ready or new_ready["status"] == "True":
                await self.kube.event(isvc, reason=new_ready["reason"], message=new_ready["message"], type_=kind)
        if new_prog and new_prog["reason"] == "RollingOut" and old_prog.get("reason") != "RollingOut":
            await self.kube.event(isvc, reason="RollingOut", message=new_prog["message"])
