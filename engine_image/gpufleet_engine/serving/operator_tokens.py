"""The check of a control route's caller: a bearer token signed by the cluster's service-account
issuer, for the guard's audience, naming the operator (gpufleet_api.guard.control_auth).

Offline: the engine pod has no Kubernetes credentials to ask TokenReview with, so the token is
checked against the issuer's public keys that guard.json's live ``controlAuth`` carries. A token
that passed is remembered until it expires (the operator sends the same one for up to an hour),
so a verified caller costs one dictionary lookup; a new ``controlAuth`` (a rotated key, another
subject) forgets them all. No I/O.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import jwt

from gpufleet_api import typed
from gpufleet_api.guard.control_auth import SIGNING_ALGORITHMS, ControlAuthConfig
from gpufleet_engine.errors import GuardError

# Clock skew between the API server that signed a token and this node.
LEEWAY_SECONDS = 30
CACHE_ENTRIES = 64
_KEY_TYPE = {"RS256": "RSA", "ES256": "EC"}


class Refused(GuardError):
    """The caller is not the operator; the message says why, and never holds the token."""


@dataclass(frozen=True)
class Caller:
    subject: str
    expires: float


class OperatorTokens:
    """Verifies ``Authorization`` headers against the ``controlAuth`` of guard.json (``configure``
    again when it changes)."""

    def __init__(self, config: ControlAuthConfig | None, clock: Callable[[], float] = time.time,
                 cache_entries: int = CACHE_ENTRIES):
        self._clock = clock
        self._cache_entries = cache_entries
        self._verified: OrderedDict[str, Caller] = OrderedDict()
        self.configure(config)

    def configure(self, config: ControlAuthConfig | None) -> None:
        self.config = config
        self._keys: dict[str, jwt.PyJWK] = {}
        self._key_problems: dict[str, str] = {}
        for key in config.keys if config is not None else ():
            try:
                self._keys[key.kid] = jwt.PyJWK(typed.to_builtins(key, omit_none=True))
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError) as e:
                # One unusable key must not lock the operator out while another signs its tokens.
                self._key_problems[key.kid] = str(e)
        self._verified.clear()

    def verify(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` header proves, or Refused saying what is wrong."""
        config = self.config
        if config is None:
            raise Refused("this guard accepts no caller on its control routes: guard.json has no "
                          "controlAuth (the operator writes it: the cluster's service-account issuer, its "
                          "keys and the operator's identity)")
        token = _bearer(authorization)
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        known = self._verified.get(digest)
        if known is not None:
            if known.expires + LEEWAY_SECONDS > now:
                self._verified.move_to_end(digest)
                return known
            del self._verified[digest]
        caller = self._check(token, config, now)
        self._verified[digest] = caller
        while len(self._verified) > self._cache_entries:
            self._verified.popitem(last=False)
        return caller

    def _check(self, token: str, config: ControlAuthConfig, now: float) -> Caller:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError as e:
            raise Refused(f"the bearer token is not a JWT ({e})") from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in SIGNING_ALGORITHMS:
            raise Refused(f"the token is signed with {alg!r}; the guard accepts "
                          f"{' or '.join(SIGNING_ALGORITHMS)} (a service-account issuer's signatures) only")
        if not isinstance(kid, str) or kid not in self._keys:
            why = f" (that key is unusable: {self._key_problems[kid]})" if kid in self._key_problems else ""
            raise Refused(f"the token's signing key {kid!r} is not one of the issuer's keys in guard.json's "
                          f"controlAuth{why}; the operator refreshes them from the API server's "
                          f"/openid/v1/jwks")
        key = self._keys[kid]
        if key.key_type != _KEY_TYPE[alg] or (key.algorithm_name and key.algorithm_name != alg):
            raise Refused(f"the token's algorithm {alg} does not fit its key {kid!r} "
                          f"({key.key_type}, {key.algorithm_name})")
        try:
            # The times are checked below, against this object's clock.
            claims = jwt.decode(token, key.key, algorithms=[alg], audience=config.audience, issuer=config.issuer,
                                options={"require": ["exp", "iss", "aud", "sub"], "verify_exp": False,
                                         "verify_nbf": False, "verify_iat": False})
        except jwt.InvalidAudienceError:
            raise Refused(f"the token is not for the guard: its audience must be {config.audience!r}") from None
        except jwt.InvalidIssuerError:
            raise Refused(f"the token's issuer is not this cluster's ({config.issuer!r})") from None
        except jwt.InvalidSignatureError:
            raise Refused(f"the token's signature does not verify with key {kid!r}") from None
        except jwt.MissingRequiredClaimError as e:
            raise Refused(f"the token has no {e.claim!r} claim") from None
        except jwt.InvalidTokenError as e:
            raise Refused(f"the token is invalid: {e}") from None
        expires, not_before = claims["exp"], claims.get("nbf", now)
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in (expires, not_before)):
            raise Refused("the token's exp or nbf is not a number of seconds")
        if now > expires + LEEWAY_SECONDS:
            raise Refused("the token has expired; the operator reads a fresh one from its projected "
                          "token file")
        if now + LEEWAY_SECONDS < not_before:
            raise Refused("the token is not valid yet (nbf); check the node's clock")
        subject = claims.get("sub")
        if subject not in config.subjects:
            raise Refused(f"the token's subject {subject!r} is not the operator's "
                          f"({', '.join(config.subjects)})")
        return Caller(subject, float(expires))


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise Refused("no Authorization header: the guard's control routes take the operator's "
                      "'Authorization: Bearer <token>' (a ServiceAccount token for the guard's audience)")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Refused("the Authorization header is not 'Bearer <token>'")
    return token.strip()
