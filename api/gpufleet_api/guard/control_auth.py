"""Who may call a guard's control routes, and how the guard knows: the operator↔guard contract.

A guard's control routes (``PUT``/``GET /adapters``, ``/demand``, ``/audit``, vLLM's admin
routes) change or reveal what a replica serves. They accept the operator only, proven by a
Kubernetes identity and never by a source address (a mesh sidecar connects from 127.0.0.6, a
port-forward from loopback): the operator sends ``Authorization: Bearer <token>``, a projected
ServiceAccount token whose audience is ``GUARD_AUDIENCE``, and the guard checks it offline (the
engine pod has no Kubernetes credentials to ask TokenReview with) against the cluster's
service-account signing keys, which the operator reads from the API server (``/openid/v1/jwks``)
and writes into guard.json's live ``controlAuth`` section, so a rotated key reaches running
guards without a restart.

What only the pod itself calls (``POST /drain`` from its preStop hook) is served on a Unix
socket in a pod-local emptyDir (``ADMIN_SOCKET``): no address on any network reaches it.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from msgspec import Meta

from .. import typed

GUARD_AUDIENCE = "gpufleet-guard"
# The emptyDir both containers of an engine pod mount, and the guard's admin socket in it.
ADMIN_SOCKET_DIR = "/run/gpufleet"
ADMIN_SOCKET = f"{ADMIN_SOCKET_DIR}/guard.sock"
# The signatures a Kubernetes service-account issuer makes; nothing else is accepted (no "none",
# no HMAC: a public key must never be usable as a shared secret).
SIGNING_ALGORITHMS = ("RS256", "ES256")
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"


def service_account_subject(namespace: str, name: str) -> str:
    """The ``sub`` of a ServiceAccount's tokens: ``system:serviceaccount:<namespace>:<name>``."""
    return f"{SERVICE_ACCOUNT_PREFIX}{namespace}:{name}"


class JsonWebKey(typed.Model, frozen=True):
    """One public key of the issuer's key set (RFC 7517), as ``/openid/v1/jwks`` lists it; members
    other than these (``x5c``, ...) are dropped."""
    kty: Literal["RSA", "EC"]
    kid: Annotated[str, Meta(min_length=1)]
    alg: Optional[str] = None
    use: Optional[str] = None
    n: Optional[str] = None    # RSA modulus
    e: Optional[str] = None    # RSA exponent
    crv: Optional[str] = None  # EC curve
    x: Optional[str] = None
    y: Optional[str] = None


class ControlAuthConfig(typed.Model, frozen=True, forbid_unknown_fields=True):
    """guard.json's ``controlAuth``: the callers a guard's control routes accept.

    A token is accepted when it is signed by one of ``keys`` with RS256 or ES256, names
    ``issuer`` and ``audience``, has not expired, and its ``sub`` is one of ``subjects``."""
    issuer: Annotated[str, Meta(min_length=1)]
    subjects: Annotated[tuple[str, ...], Meta(min_length=1)]
    keys: Annotated[tuple[JsonWebKey, ...], Meta(min_length=1)]
    audience: Annotated[str, Meta(min_length=1)] = GUARD_AUDIENCE
