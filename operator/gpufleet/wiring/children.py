"""The children of one InferenceService on the cluster, for the controller's reconcile: what runs (its
engine pods, its Deployments, the cordoned nodes under them), the apply of every child (a refused one
retried after a backoff, not in a loop), the removal of what a former shape or a finished canary left,
and the one-time discovery of the PodMonitor kind. The controller sequences these under the service's
lock; what to apply and what is stale are the pure ``reconcile.desired`` and ``rollout.steps``."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from datetime import datetime, timezone
from typing import Callable, Iterable, Mapping

from gpufleet_api import v1alpha1 as t
from gpufleet_api.guard.control_auth import ControlAuthConfig
from gpufleet_api.guard.guard_config import Role
from gpufleet_kit.backoff import delay
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.errors import ApiError

from ..manifests import names, revision
from ..manifests.guard_config import read_running
from ..manifests.network_policy import EngineIngress
from ..manifests.pools import POOL_ROLES, pools
from ..metrics import OperatorMetrics
from ..reconcile import drains
from ..reconcile.child_events import AppliedChildren
from ..reconcile.desired import CanaryChildren, desired_children, spec_revision, stale_budgets
from ..reconcile.ownership import Foreign, conflict_conditions, holder
from ..reconcile.status import Observed, child_rejected_conditions
from ..rollout import steps

log = logging.getLogger(__name__)

PODMONITOR_API = "monitoring.coreos.com/v1"
# A refused child is not retried in a loop: the next spec change retries at
# once, otherwise the apply is tried again after this backoff (doubling).
REJECTED_RETRY_FIRST_S = 60.0
REJECTED_RETRY_MAX_S = 600.0  # under the 300 s resync plus this, every 15 min sees a try (the alert)
# A child's name held by another object (reconcile/ownership.py) is looked at again on a timer of its own
# (the runtime's): the object is not watched, and its owner deleting it should free the service soon.
CONFLICT_RETRY_FIRST_S = 5.0
CONFLICT_RETRY_MAX_S = 60.0


def refused(e: ApiError) -> bool:
    """The API server will not take this object as it is: retrying the same
    request cannot succeed (schema or admission said no, or we may not)."""
    return e.status in (400, 403, 422) and not e.namespace_terminating


@dataclasses.dataclass
class Rejection:
    generation: int
    retry_at: float
    failures: int   # in a row, of this generation
    conflict: bool = False  # not refused: a child's name is held by another object (ChildConflict)


class ServiceChildren:
    def __init__(self, kube: KubeClient, metrics: OperatorMetrics, clock: Callable[[], float] = time.monotonic, *,
                 podmonitor_labels: Mapping[str, str] | None = None, engine_ingress: EngineIngress | None = None,
                 wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 adapter_private_sources: bool = False):
        self.kube, self.metrics = kube, metrics
        # Guards may fetch adapters from private addresses (--adapter-private-sources).
        self.adapter_private_sources = adapter_private_sources
        # Who the guards' control routes accept, into guard.json (the runtime's GuardIdentity sets it).
        self.control_auth: ControlAuthConfig | None = None
        # The fleet's OTLP receiver (--otlp-endpoint), into guard.json's tracing; empty: none.
        self.otlp_endpoint = ""
        self._clock = clock
        self._wall = wall  # the time a canary step starts (status.rollout.stepStartedAt)
        self._podmonitor_checked_at = -1e9
        self._has_podmonitor = False
        self._podmonitor_lock = asyncio.Lock()
        # Labels every PodMonitor gets, so the cluster's Prometheus selects it (--podmonitor-label).
        self.podmonitor_labels: Mapping[str, str] = podmonitor_labels or {}
        # Who may reach the engines' guard port; None: no NetworkPolicy (--network-policies).
        self.engine_ingress = engine_ingress
        # (namespace, name) -> the refused apply of its generation, and when it is tried again
        self.rejections: dict[tuple[str, str], Rejection] = {}
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

    async def rollout_plan(self, isvc: dict, spec: t.InferenceServiceSpec, replicas: Mapping[Role, int],
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

    async def remove_canary(self, isvc: dict, deployments: list[dict]) -> None:
        """Delete ``<service>-canary`` when no canary is wanted (its guards drain in their preStop hook)."""
        meta = isvc["metadata"]
        name = names.canary_deployment_name(meta["name"])
        if any(d["metadata"]["name"] == name and holder(isvc, d) is None for d in deployments):
            if await self.kube.delete("apps/v1", "Deployment", name, meta["namespace"]):
                log.info("%s/%s: deleted Deployment %s (no canary now)", meta["namespace"], meta["name"], name)

    async def foreign_children(self, isvc: dict, objs: list[dict]) -> list[Foreign]:
        """The objects already holding a child's name that are not the service's (reconcile/ownership.py).
        A child the operator applied or its watches showed as the service's is not read again; the
        others (its first apply in this process, a kind it does not watch) are read once each."""
        uid = isvc["metadata"].get("uid")
        out = []
        for obj in objs:
            meta = obj["metadata"]
            if uid is not None and self.applied.owner(obj["kind"], meta["namespace"], meta["name"]) == uid:
                continue
            existing = await self.kube.get_or_none(obj["apiVersion"], obj["kind"], meta["name"], meta["namespace"])
            who = None if existing is None else holder(isvc, existing)
            if who is not None:
                out.append(Foreign(obj["kind"], meta["name"], who))
        return out

    def _retry_later(self, key: tuple[str, str], generation: int, first: float, most: float,
                     conflict: bool = False) -> None:
        previous = self.rejections.get(key)
        failures = 1 if previous is None or previous.generation != generation or previous.conflict != conflict \
            else previous.failures + 1
        self.rejections[key] = Rejection(generation, self._clock() + delay(failures, first, most), failures, conflict)

    async def apply(self, isvc: dict, spec, replicas: Mapping[Role, int],
                    draining: Iterable[Role] = (), surge: drains.Surge | None = None,
                    canary: CanaryChildren | None = None) -> list[dict] | None:
        """Apply every child; the conditions that report a refused one, or the objects holding children's
        names that are not the service's (nothing applied then), None when all were taken."""
        meta = isvc["metadata"]
        key, gen = (meta["namespace"], meta["name"]), meta.get("generation", 0)
        objs = desired_children(isvc, spec, replicas, with_podmonitor=await self.has_podmonitor(),
                                podmonitor_labels=self.podmonitor_labels,
                                engine_ingress=self.engine_ingress, draining_roles=draining, surge=surge,
                                canary=canary, allow_private_sources=self.adapter_private_sources,
                                control_auth=self.control_auth, otlp_endpoint=self.otlp_endpoint)
        foreign = await self.foreign_children(isvc, objs)
        if foreign:
            log.warning("%s/%s: not applied: %s", key[0], key[1],
                        "; ".join(f"{f.kind} {f.name} is not its own ({f.holder})" for f in foreign))
            self._retry_later(key, gen, CONFLICT_RETRY_FIRST_S, CONFLICT_RETRY_MAX_S, conflict=True)
            return conflict_conditions(isvc, foreign, gen)
        for obj in objs:
            try:
                self.applied.applied(await self.kube.apply(obj))
            except ApiError as e:
                if not refused(e):
                    raise
                log.warning("%s/%s: %s %s refused: %s", key[0], key[1], obj["kind"], obj["metadata"]["name"], e)
                self.metrics.reconcile_errors.labels(*key).inc()
                self._retry_later(key, gen, REJECTED_RETRY_FIRST_S, REJECTED_RETRY_MAX_S)
                return child_rejected_conditions(kind=obj["kind"], name=obj["metadata"]["name"],
                                                 message=e.message, generation=gen)
        self.rejections.pop(key, None)
        return None
