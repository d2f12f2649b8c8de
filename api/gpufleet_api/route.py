"""The operator↔router contract: what the router routes by, derived from an InferenceService in one place.

The router lists InferenceServices and engine pods; from each service it needs only this view: the
model name it is served under, the replica bounds of each pool (whether a refused request may wait for a
scale-out), the KV block size, the KV tier, and a canary in progress. The operator's autoscaler reads the
same bounds through ``max_replicas``, so the router never disagrees with it about how far a pool can grow."""
from __future__ import annotations

import dataclasses

from . import SpecError, parse_spec
from .engine_pods import DECODE, PREFILL, UNIFIED, Role
from .v1alpha1 import ROUTER, InferenceServiceSpec

__all__ = ["RouteView", "SpecError", "gateway_via_router", "max_replicas", "route_view", "served_name"]


def served_name(spec: InferenceServiceSpec) -> str:
    """The model name clients send (spec.model.servedName, else spec.model.name), as the guard serves it."""
    return spec.model.served_name or spec.model.name


def max_replicas(spec: InferenceServiceSpec, role: Role = UNIFIED) -> int:
    """The most replicas ``role``'s pool can have: spec.autoscaling's for a unified service, the pool's own
    (spec.disaggregation.prefill / decode) for a disaggregated one."""
    if role != UNIFIED and spec.disaggregation is not None:
        return getattr(spec.disaggregation, role).max_replicas
    return spec.autoscaling.max_replicas


@dataclasses.dataclass(frozen=True)
class RouteView:
    """One InferenceService as the router sees it."""
    namespace: str
    service: str
    model: str                 # the served name: the key of the route
    model_root: str            # spec.model.name, /v1/models' ``root`` as vLLM gives it
    block_size: int
    min_replicas: int
    max_replicas: int
    pool_max: tuple[tuple[str, int], ...] = ()   # a disaggregated service's ((role, maxReplicas), ...)
    kv_tier: bool = False      # spec.engine.kvTier Shared with a KV connector: replicas share computed KV
    canary_revision: str = ""  # status.rollout.canaryRevision: the canary pods' gpufleet.dev/revision
    canary_weight: int = 0     # its share of new requests, 0..100
    gateway: bool = False      # spec.gateway: an InferencePool <service> names the router's Endpoint Picker
    created: str = ""          # metadata.creationTimestamp: the older of two services claiming a name keeps it
    deleting: bool = False
    # spec.admission.queueClasses' names: what a gateway's objective header may name as the request's class.
    queue_classes: tuple[str, ...] = ()
    # Behind a Gateway API gateway, the endpoint picker sends this service's requests to the router's own pods
    # rather than to an engine pod: the prefill/decode hand-off and stream resumption need the router in the
    # data path (docs/gateway-epp.md). ``gateway_via_router`` computes it.
    via_router: bool = False
    # spec.slo.ttftP99Milliseconds in seconds: a request whose first token came later has its trace kept by the
    # router's tail rule (docs/tracing.md), as the guard keeps its own.
    ttft_objective_seconds: float = 0.0


def route_view(isvc: dict) -> RouteView:
    """The view of one InferenceService object; SpecError (naming the field) when its spec is invalid."""
    meta = isvc.get("metadata") or {}
    spec = parse_spec(isvc.get("spec"))
    canary_revision, canary_weight = _canary(isvc)
    return RouteView(
        namespace=meta.get("namespace", ""), service=meta.get("name", ""), model=served_name(spec),
        model_root=spec.model.name, block_size=spec.engine.kv_cache.block_size,
        min_replicas=spec.autoscaling.min_replicas, max_replicas=max_replicas(spec),
        pool_max=((PREFILL, max_replicas(spec, PREFILL)), (DECODE, max_replicas(spec, DECODE)))
        if spec.disaggregation else (),
        kv_tier=spec.engine.kv_tier == "Shared" and spec.engine.kv_transfer is not None,
        canary_revision=canary_revision, canary_weight=canary_weight,
        gateway=spec.gateway is not None,
        created=meta.get("creationTimestamp") or "", deleting=bool(meta.get("deletionTimestamp")),
        queue_classes=tuple(c.name for c in spec.admission.queue_classes), via_router=gateway_via_router(spec),
        ttft_objective_seconds=spec.slo.ttft_p99_milliseconds / 1000)


def gateway_via_router(spec: InferenceServiceSpec) -> bool:
    """Whether a gateway's endpoint picker sends this service's requests through the router (its own pods) rather
    than straight to an engine pod: spec.gateway.dataPath Router; unset, a disaggregated service (its request needs
    a prefill and then a decode with the prefill's hand-off, which no single pick of one endpoint can carry)."""
    data_path = spec.gateway.data_path if spec.gateway is not None else None
    if data_path is not None:
        return data_path == ROUTER
    return spec.disaggregation is not None


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
