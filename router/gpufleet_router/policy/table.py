"""Which service serves which model, and its replicas (pure).

Built from the InferenceServices and engine pods the router lists: a
service's ``model`` is its served name (``spec.model.servedName``, else
``spec.model.name``, as the guard serves it); its replicas are its engine
pods, the guard's port on each pod IP.

A disaggregated service's pods carry their pool in the ``gpufleet.dev/role``
label (``prefill`` or ``decode``); pods without it are unified. The router
reads the role from the pods, not from the spec, so a service changing shape
is routed by the pods that exist: while a rollout replaces unified pods by
prefill and decode pools, both kinds are in its route."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from gpufleet_api import engine_pods as pods_api
from gpufleet_api import name_claims
from gpufleet_api.engine_pods import DECODE, PREFILL, ROLES, UNIFIED
from gpufleet_api.route import SpecError, route_view

from .replicas import Replica

_LABELLED = {PREFILL, DECODE}   # the values of gpufleet.dev/role


@dataclasses.dataclass(frozen=True)
class Route:
    namespace: str
    service: str
    model: str
    block_size: int
    min_replicas: int
    max_replicas: int
    replicas: tuple[Replica, ...]         # unified pods
    prefill: tuple[Replica, ...] = ()
    decode: tuple[Replica, ...] = ()

    # A disaggregated service's bounds per pool ((role, maxReplicas), ...); unified: max_replicas.
    pool_max: tuple[tuple[str, int], ...] = ()
    # spec.engine.kvTier Shared: every replica loads from the service's KV store what another computed.
    kv_tier: bool = False
    # The model the engines load (spec.model.name): /v1/models' ``root``, as vLLM's; "": the served name.
    model_root: str = ""
    # A canary in progress (status.rollout): its pods' gpufleet.dev/revision and its share of new requests.
    canary_revision: str = ""
    canary_weight: int = 0
    # spec.admission.queueClasses' names, and whether a gateway's picker sends the service's requests through
    # the router (RouteView.via_router).
    queue_classes: tuple[str, ...] = ()
    via_router: bool = False
    ttft_objective_seconds: float = 0.0   # RouteView's: 0, none

    @property
    def root(self) -> str:
        return self.model_root or self.model

    def max_of(self, role: str) -> int:
        """The most replicas ``role``'s pool can have: whether a refused request may wait for a scale-out."""
        return dict(self.pool_max).get(role, self.max_replicas)

    def pool(self, role: str) -> tuple[Replica, ...]:
        pools: dict[str, tuple[Replica, ...]] = {UNIFIED: self.replicas, PREFILL: self.prefill, DECODE: self.decode}
        return pools[role]


@dataclasses.dataclass(frozen=True)
class Table:
    routes: dict[str, Route]          # by served model name
    problems: tuple[str, ...] = ()    # services and pods left out, and why
    # Who owns each name clients send, over the services and the adapters the table was built with.
    claims: name_claims.Decision = name_claims.EMPTY

    @property
    def models(self) -> list[str]:
        return sorted(self.routes)


def build_table(services: Iterable[dict], pods: Iterable[dict], serving: Callable[[dict], bool],
                guard_port: int = pods_api.GUARD_PORT, adapters: Iterable[dict] = ()) -> Table:
    """``serving(pod)``: whether the pod takes new requests (Ready, addressed, not terminating).
    Each service is read through the API's route view (gpufleet_api.route), the one place that
    says what of an InferenceService the router routes by. ``adapters``: the InferenceAdapters in
    scope, which claim names too (adapters.build_catalog serves those the table's claims say own theirs)."""
    services = list(services)
    claims = name_claims.decide_objects(services, adapters)
    by_pool: dict[tuple[str, str, str], list[Replica]] = {}
    problems = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        service = labels.get(pods_api.LABEL_SERVICE)
        ip = (pod.get("status") or {}).get("podIP")
        if not service or not ip:
            continue
        ns = meta.get("namespace", "")
        role = labels.get(pods_api.LABEL_ROLE, UNIFIED)
        if role != UNIFIED and role not in _LABELLED:
            # A pool the router does not know how to use (a newer operator's): sending it requests
            # as if it were unified could answer them wrongly, so it gets none.
            problems.append(f"{ns}/{meta['name']}: {pods_api.LABEL_ROLE}={role!r} is not prefill or decode; "
                            f"the pod gets no requests")
            continue
        by_pool.setdefault((ns, service, role), []).append(
            Replica(pod=meta["name"], address=f"{ip}:{guard_port}", serving=serving(pod),
                    revision=str(labels.get(pods_api.LABEL_REVISION, "")),
                    terminating=bool(meta.get("deletionTimestamp"))))
    routes: dict[str, Route] = {}
    views = []
    for isvc in services:
        meta = isvc["metadata"]
        try:
            views.append(route_view(isvc))
        except SpecError as e:
            problems.append(f"{meta.get('namespace', '')}/{meta['name']}: invalid spec ({e}); not routed")
    for view in views:
        ns, name = view.namespace, view.service
        if view.deleting:
            continue
        conflict = claims.conflict(name_claims.SERVICE, ns, name)
        if conflict is not None:
            problems.append(f"{ns}/{name}: {conflict.message}; not routed")
            continue
        pools = {role: tuple(sorted(by_pool.get((ns, name, role), []), key=lambda r: r.pod)) for role in ROLES}
        routes[view.model] = Route(namespace=ns, service=name, model=view.model, block_size=view.block_size,
                                   min_replicas=view.min_replicas, max_replicas=view.max_replicas,
                                   replicas=pools[UNIFIED], pool_max=view.pool_max, kv_tier=view.kv_tier,
                                   prefill=pools[PREFILL], decode=pools[DECODE], model_root=view.model_root,
                                   canary_revision=view.canary_revision, canary_weight=view.canary_weight,
                                   queue_classes=view.queue_classes, via_router=view.via_router,
                                   ttft_objective_seconds=view.ttft_objective_seconds)
    return Table(routes, tuple(problems), claims)
