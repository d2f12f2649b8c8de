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

from gpufleet_api import SpecError, parse_spec

from ..manifests import names
from ..manifests.guard_config import served_name
from .choice import Replica


class Role:
    """An engine pod's pool: the ``role`` label of the router's per-role metrics."""
    UNIFIED = "unified"   # no role label: prefill and decode in one engine
    PREFILL = "prefill"
    DECODE = "decode"


ROLES = (Role.UNIFIED, Role.PREFILL, Role.DECODE)
_LABELLED = {Role.PREFILL, Role.DECODE}   # the values of gpufleet.dev/role


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

    @property
    def root(self) -> str:
        return self.model_root or self.model

    def max_of(self, role: str) -> int:
        """The most replicas ``role``'s pool can have: whether a refused request may wait for a scale-out."""
        return dict(self.pool_max).get(role, self.max_replicas)

    def pool(self, role: str) -> tuple[Replica, ...]:
        return {Role.UNIFIED: self.replicas, Role.PREFILL: self.prefill, Role.DECODE: self.decode}[role]


@dataclasses.dataclass(frozen=True)
class Table:
    routes: dict[str, Route]          # by served model name
    problems: tuple[str, ...] = ()    # services and pods left out, and why

    @property
    def models(self) -> list[str]:
        return sorted(self.routes)


def build_table(services: Iterable[dict], pods: Iterable[dict], serving: Callable[[dict], bool],
                guard_port: int = names.GUARD_PORT) -> Table:
    """``serving(pod)``: whether the pod takes new requests (Ready, addressed, not terminating)."""
    by_pool: dict[tuple[str, str, str], list[Replica]] = {}
    problems = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        service = labels.get(names.LABEL_SERVICE)
        ip = (pod.get("status") or {}).get("podIP")
        if not service or not ip:
            continue
        ns = meta.get("namespace", "")
        role = labels.get(names.LABEL_ROLE, Role.UNIFIED)
        if role != Role.UNIFIED and role not in _LABELLED:
            # A pool the router does not know how to use (a newer operator's): sending it requests
            # as if it were unified could answer them wrongly, so it gets none.
            problems.append(f"{ns}/{meta['name']}: {names.LABEL_ROLE}={role!r} is not prefill or decode; "
                            f"the pod gets no requests")
            continue
        by_pool.setdefault((ns, service, role), []).append(
            Replica(pod=meta["name"], address=f"{ip}:{guard_port}", serving=serving(pod),
                    revision=str(labels.get(names.LABEL_REVISION, "")),
                    terminating=bool(meta.get("deletionTimestamp"))))
    routes: dict[str, Route] = {}
    # Oldest first: when two services claim one model name, the one that had it first keeps it.
    ordered = sorted(services, key=lambda s: (s["metadata"].get("creationTimestamp") or "",
                                              s["metadata"].get("namespace", ""), s["metadata"]["name"]))
    for isvc in ordered:
        meta = isvc["metadata"]
        ns, name = meta.get("namespace", ""), meta["name"]
        if meta.get("deletionTimestamp"):
            continue
        try:
            spec = parse_spec(isvc.get("spec"))
        except SpecError as e:
            problems.append(f"{ns}/{name}: invalid spec ({e}); not routed")
            continue
        model = served_name(spec)
        if model in routes:
            kept = routes[model]
            problems.append(f"{ns}/{name}: serves model {model!r}, which {kept.namespace}/{kept.service} "
                            f"already serves; not routed (give one of them another spec.model.servedName)")
            continue
        canary_revision, canary_weight = _canary(isvc)
        pools = {role: tuple(sorted(by_pool.get((ns, name, role), []), key=lambda r: r.pod)) for role in ROLES}
        routes[model] = Route(namespace=ns, service=name, model=model, block_size=spec.engine.kv_cache.block_size,
                              min_replicas=spec.autoscaling.min_replicas,
                              max_replicas=spec.autoscaling.max_replicas, replicas=pools[Role.UNIFIED],
                              pool_max=((Role.PREFILL, spec.disaggregation.prefill.max_replicas),
                                        (Role.DECODE, spec.disaggregation.decode.max_replicas))
                              if spec.disaggregation else (),
                              kv_tier=spec.engine.kv_tier == "Shared" and spec.engine.kv_transfer is not None,
                              prefill=pools[Role.PREFILL], decode=pools[Role.DECODE], model_root=spec.model.name,
                              canary_revision=canary_revision, canary_weight=canary_weight)
    return Table(routes, tuple(problems))


def _canary(isvc: dict) -> tuple[str, int]:
    """(status.rollout.canaryRevision, canaryWeightPercent clamped to 0..100); ("", 0) without a canary."""
    rollout = (isvc.get("status") or {}).get("rollout") or {}
    revision = rollout.get("canaryRevision")
    weight = rollout.get("canaryWeightPercent")
    if not isinstance(revision, str) or not revision:
        return "", 0
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        weight = 0
    return revision, int(min(100, max(0, weight)))
