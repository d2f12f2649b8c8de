"""Which service serves which model, and its replicas (pure).

Built from the InferenceServices and engine pods the router lists: a
service's ``model`` is its served name (``spec.model.servedName``, else
``spec.model.name``, as the guard serves it); its replicas are its engine
pods, the guard's port on each pod IP."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from ..api import SpecError, parse_spec
from ..manifests import names
from ..manifests.guard_config import served_name
from .choice import Replica


@dataclasses.dataclass(frozen=True)
class Route:
    namespace: str
    service: str
    model: str
    block_size: int
    min_replicas: int
    max_replicas: int
    replicas: tuple[Replica, ...]


@dataclasses.dataclass(frozen=True)
class Table:
    routes: dict[str, Route]          # by served model name
    problems: tuple[str, ...] = ()    # services left out, and why

    @property
    def models(self) -> list[str]:
        return sorted(self.routes)


def build_table(services: Iterable[dict], pods: Iterable[dict], serving: Callable[[dict], bool],
                guard_port: int = names.GUARD_PORT) -> Table:
    """``serving(pod)``: whether the pod takes new requests (Ready, addressed, not terminating)."""
    by_service: dict[tuple[str, str], list[Replica]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        service = (meta.get("labels") or {}).get(names.LABEL_SERVICE)
        ip = (pod.get("status") or {}).get("podIP")
        if not service or not ip:
            continue
        by_service.setdefault((meta.get("namespace", ""), service), []).append(
            Replica(pod=meta["name"], address=f"{ip}:{guard_port}", serving=serving(pod)))
    routes: dict[str, Route] = {}
    problems = []
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
        replicas = sorted(by_service.get((ns, name), []), key=lambda r: r.pod)
        routes[model] = Route(namespace=ns, service=name, model=model, block_size=spec.engine.kv_cache.block_size,
                              min_replicas=spec.autoscaling.min_replicas,
                              max_replicas=spec.autoscaling.max_replicas, replicas=tuple(replicas))
    return Table(routes, tuple(problems))
