"""InferenceAdapters by service, as the watch reports them. Pure (memory only).

The kopf handler feeds every InferenceAdapter event in (``upsert`` / ``remove``);
the fleet loop asks for a service's adapters each tick (``of``) without a
request to the API server, and for adapters whose service it does not know
(``services``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from gpufleet_api import SpecError, parse
from gpufleet_api.v1alpha1 import InferenceAdapterSpec

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Adapter:
    """One InferenceAdapter as the loops need it: its name, its service, its parsed spec (None when the
    API server let through what the types refuse), its generation and the body (for status and Events)."""
    namespace: str
    name: str
    service: str
    spec: InferenceAdapterSpec | None
    generation: int | None
    body: dict

    @property
    def status(self) -> dict:
        return self.body.get("status") or {}


def adapter_of(body: dict) -> Adapter:
    meta = body.get("metadata") or {}
    raw = body.get("spec") or {}
    try:
        spec: InferenceAdapterSpec | None = parse(InferenceAdapterSpec, raw)
    except SpecError:
        spec = None
    return Adapter(namespace=meta.get("namespace", ""), name=meta.get("name", ""),
                   service=str(raw.get("service") or ""), spec=spec, generation=meta.get("generation"),
                   body=copy.deepcopy(body))


class AdapterIndex:
    def __init__(self) -> None:
        self._adapters: dict[Key, Adapter] = {}
        self._by_service: dict[Key, set[str]] = {}

    def upsert(self, body: dict) -> Adapter:
        """Record an adapter (created, changed, or its status written); returns it."""
        adapter = adapter_of(body)
        key = (adapter.namespace, adapter.name)
        old = self._adapters.get(key)
        if old is not None and old.service != adapter.service:
            self._unlink(old)
        self._adapters[key] = adapter
        self._by_service.setdefault((adapter.namespace, adapter.service), set()).add(adapter.name)
        return adapter

    def remove(self, namespace: str, name: str) -> Adapter | None:
        old = self._adapters.pop((namespace, name), None)
        if old is not None:
            self._unlink(old)
        return old

    def _unlink(self, adapter: Adapter) -> None:
        skey = (adapter.namespace, adapter.service)
        names = self._by_service.get(skey, set())
        names.discard(adapter.name)
        if not names:
            self._by_service.pop(skey, None)

    def of(self, namespace: str, service: str) -> list[Adapter]:
        """The adapters naming a service, by name."""
        return [self._adapters[(namespace, n)] for n in sorted(self._by_service.get((namespace, service), ()))]

    def services(self) -> list[Key]:
        """Every (namespace, service) some adapter names."""
        return sorted(self._by_service)

    def get(self, namespace: str, name: str) -> Adapter | None:
        return self._adapters.get((namespace, name))

    def __len__(self) -> int:
        return len(self._adapters)
