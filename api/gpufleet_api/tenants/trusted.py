"""The tenant a trusted gateway names (identity Trusted): its tenant header, else, where the platform
accepts it, the Gateway API Inference Extension's fairness id. Only for a gateway that authenticates
callers and sets these headers itself, dropping the ones clients send (as classHeaderPolicy Trusted)."""
from __future__ import annotations

from typing import Mapping

from .declaration import FAIRNESS_ID_HEADERS, TrustedIdentity
from .identity import Identified, Refused


def identify(headers: Mapping[str, str], trusted: TrustedIdentity, declared: frozenset[str]) -> Identified | Refused:
    """The declared tenant the gateway named in ``headers`` (names lower case, as aiohttp's CIMultiDict
    and Envoy's ext_proc both give them), or why not: no header (missing) or a name not declared
    (unknown; a gateway's fairness id may name a user or a flow, not one of our tenants)."""
    names = [trusted.tenant_header]
    if trusted.fairness_id == "AsTenant":
        names += FAIRNESS_ID_HEADERS
    for name in names:
        value = headers.get(name)
        if value is not None and value.strip():
            tenant = value.strip()
            if tenant in declared:
                return Identified(tenant)
            return Refused("unknown", f"The {name} header names no tenant declared here.")
    return Refused("missing", f"This service takes requests only through its gateway, which names the tenant "
                              f"in the {trusted.tenant_header} header.")
