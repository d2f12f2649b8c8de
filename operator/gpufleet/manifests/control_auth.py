"""The operator's token and the cluster's key set → guard.json's ``controlAuth``. Pure.

The guards accept the caller whose ServiceAccount tokens the operator itself sends: its issuer and
subject are read from its own token (a projected token for the guard's audience), and the keys
that verify it from the API server's ``/openid/v1/jwks`` (gpufleet_api.guard.control_auth).
"""
from __future__ import annotations

import base64
import json

from gpufleet_api import typed
from gpufleet_api.guard.control_auth import GUARD_AUDIENCE, ControlAuthConfig, JsonWebKey

from ..errors import OperatorError


class IdentityError(OperatorError):
    """The operator's guard token or the cluster's key set cannot make a ``controlAuth``."""


def token_claims(token: str) -> dict:
    """The claims of the operator's own token, unverified: it read the token from its own
    projected volume; the guards verify it."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise IdentityError("the guard token is not a JWT (three dot-separated parts)")
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, UnicodeDecodeError) as e:
        raise IdentityError(f"the guard token's claims are not JSON: {e}") from None
    if not isinstance(claims, dict):
        raise IdentityError("the guard token's claims are not a JSON object")
    return claims


def build_control_auth(token: str, jwks: object) -> ControlAuthConfig:
    """Who the guards accept: the issuer and subject of ``token``, the signing keys of ``jwks``."""
    claims = token_claims(token)
    issuer, subject, audience = claims.get("iss"), claims.get("sub"), claims.get("aud")
    if not isinstance(issuer, str) or not issuer or not isinstance(subject, str) or not subject:
        raise IdentityError("the guard token names no issuer (iss) or subject (sub): it must be a "
                            "ServiceAccount token")
    audiences = audience if isinstance(audience, list) else [audience]
    if GUARD_AUDIENCE not in audiences:
        raise IdentityError(f"the guard token's audience is {audience!r}, not {GUARD_AUDIENCE!r}: project the "
                            f"ServiceAccount token with audience {GUARD_AUDIENCE} (the chart does)")
    listed = jwks.get("keys") if isinstance(jwks, dict) else None
    if not isinstance(listed, list):
        raise IdentityError("the API server's /openid/v1/jwks has no 'keys' list")
    keys = []
    for raw in listed:
        if isinstance(raw, dict) and raw.get("use", "sig") == "sig" and raw.get("kty") in ("RSA", "EC"):
            try:
                keys.append(typed.convert(JsonWebKey, raw))
            except typed.Invalid:
                continue  # a key the guards could not use anyway
    if not keys:
        raise IdentityError("the API server's /openid/v1/jwks lists no RSA or EC signing key")
    return ControlAuthConfig(issuer=issuer, subjects=(subject,), keys=tuple(keys))
