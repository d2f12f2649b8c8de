"""The metric label a request is counted under: its tenant where it is a declared one, else one label
for everyone else. A label is never taken from what a client sends, so no caller can grow the number of
series (each tenant is declared; the declaration caps them at MAX_TENANTS)."""
from __future__ import annotations

from .declaration import UNKNOWN_TENANT


def tenant_label(tenant: str | None, declared: frozenset[str]) -> str:
    """``tenant`` if it is in ``declared``, else ``unknown`` (no identity, a refused key, a name no
    declaration holds)."""
    return tenant if tenant is not None and tenant in declared else UNKNOWN_TENANT
