"""Which service answers a request's ``model``, and through which LoRA adapter (pure).

A request's ``model`` is a base model (a service's served name, table.py) or
an adapter: an InferenceAdapter in the router's scope, named by its
``metadata.name``, whose ``spec.service`` names an InferenceService in its
own namespace. An adapter is served by its service's replicas, but only by
those whose guard says it holds the adapter ``Loaded`` (signals.py reads that
from the guard's ``gpufleet_guard_adapter_state``; choice.py keeps the rest
out of the choice).

A name is served once, by the object the API's rule (gpufleet_api.name_claims)
says owns it, the rule the operator reports as the NameConflict condition: the
namespace that claimed it first keeps it, whatever kind claims it later (an
adapter's name is not taken by a newer base model in another namespace); in
that namespace a base model keeps its name over an adapter, and the older of
two adapters keeps it. The router logs which one it left out.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

from gpufleet_api import name_claims

from .table import Route, Table

# The unknown-model 404 names at most this many of the served models (GET /v1/models lists them all).
LISTED_IN_404 = 20


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str          # what clients send as ``model``
    namespace: str
    service: str       # the InferenceService serving it
    parent: str        # that service's served model name: /v1/models' ``parent``
    root: str          # where it comes from (its source): /v1/models' ``root``


@dataclasses.dataclass(frozen=True)
class Catalog:
    adapters: dict[str, Adapter]      # by name
    problems: tuple[str, ...] = ()    # adapters left out, and why


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a request's ``model`` goes: a service, and the adapter to hold (None: the base model)."""
    route: Route
    adapter: Adapter | None = None


EMPTY = Catalog({})


def build_catalog(items: Iterable[dict], table: Table) -> Catalog:
    """The adapters in ``items`` (InferenceAdapter objects) whose service is routed in ``table`` and that own
    their name by ``table.claims`` (the table is built with the same adapters: ``build_table(..., adapters=)``)."""
    by_service = {(r.namespace, r.service): r for r in table.routes.values()}
    adapters: dict[str, Adapter] = {}
    problems = []
    ordered = sorted(items, key=lambda a: (a["metadata"].get("creationTimestamp") or "",
                                           a["metadata"].get("namespace", ""), a["metadata"]["name"]))
    for item in ordered:
        meta, spec = item["metadata"], item.get("spec") or {}
        ns, name = meta.get("namespace", ""), meta["name"]
        if meta.get("deletionTimestamp"):
            continue
        service = spec.get("service")
        route = by_service.get((ns, service)) if isinstance(service, str) else None
        if route is None:
            problems.append(f"{ns}/{name}: adapter of InferenceService {service!r}, which the router does not "
                            f"route in {ns!r}; not served")
            continue
        claim = name_claims.adapter_claim(item)
        conflict = table.claims.conflict(name_claims.ADAPTER, ns, name)
        if conflict is not None:
            problems.append(f"{ns}/{name}: {conflict.message}; not served")
            continue
        if claim is None or not table.claims.owns(claim):
            problems.append(f"{ns}/{name}: the route table was built without this adapter's claim to its name; "
                            f"not served")
            continue
        adapters[name] = Adapter(name=name, namespace=ns, service=route.service, parent=route.model,
                                 root=source_root(spec.get("source")) or name)
    return Catalog(adapters, tuple(problems))


def source_root(source: object) -> str:
    """The adapter's source as /v1/models shows it: the Hub repository (@revision), ``pvc://claim/path``,
    or the URI without credentials, query or fragment (a presigned URL's signature is a secret)."""
    if not isinstance(source, dict):
        return ""
    hub = source.get("huggingFace")
    if isinstance(hub, dict) and hub.get("name"):
        return f"{hub['name']}@{hub['revision']}" if hub.get("revision") else str(hub["name"])
    pvc = source.get("pvc")
    if isinstance(pvc, dict) and pvc.get("claimName"):
        return f"pvc://{pvc['claimName']}/{str(pvc.get('path') or '').lstrip('/')}"
    uri = source.get("uri")
    if isinstance(uri, str) and uri:
        parts = urlsplit(uri)
        return urlunsplit((parts.scheme, parts.hostname or "", parts.path, "", ""))
    return ""


def resolve(model: str, table: Table, catalog: Catalog) -> Target | None:
    """The service and adapter for ``model``; None when nothing in scope serves it."""
    route = table.routes.get(model)
    if route is not None:
        return Target(route)
    adapter = catalog.adapters.get(model)
    if adapter is None:
        return None
    route = table.routes.get(adapter.parent)
    if route is None or (route.namespace, route.service) != (adapter.namespace, adapter.service):
        return None   # the catalog is older than the table: its service left or changed its name
    return Target(route, adapter)


def served(table: Table, catalog: Catalog) -> list[str]:
    """Every model a request may name: base models and adapters, sorted."""
    return sorted([*table.routes, *catalog.adapters])


def not_found_message(model: str, table: Table, catalog: Catalog) -> str:
    """vLLM's words for an unknown model, then what is served here (at most ``LISTED_IN_404`` names)."""
    names = served(table, catalog)
    listed = ", ".join(names[:LISTED_IN_404]) if names else "(none)"
    more = f" and {len(names) - LISTED_IN_404} more (GET /v1/models lists them all)" \
        if len(names) > LISTED_IN_404 else ""
    return f"The model `{model}` does not exist. Served here: {listed}{more}."


def not_loaded_message(adapter: str, target: Route) -> str:
    """Why a request for ``adapter`` finds no replica to take it (503, retried shortly)."""
    return (f"The adapter `{adapter}` of {target.namespace}/{target.service} is not loaded on any ready replica "
            f"now; retry shortly (kubectl -n {target.namespace} get inferenceadapter {adapter} says where it is "
            f"loaded, or why not).")
