"""The operator's identity towards the guards: the bearer token it sends on their control routes,
and the ``controlAuth`` (issuer, subject, the cluster's signing keys) it writes into every
guard.json so the guards can check that token offline (gpufleet_api.guard.control_auth).

The token is a projected ServiceAccount token with the guard's audience (the chart mounts it;
``gpufleet dev`` writes one from the TokenRequest API); the kubelet replaces the file before it
expires, so it is read again whenever the file changes. The keys come from the API server's
``/openid/v1/jwks`` and are read again every ``REFRESH_SECONDS``: a rotated key reaches the
guards through guard.json, a live field, without a restart.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable, Protocol

from gpufleet_api.guard.control_auth import ControlAuthConfig

from ..manifests.control_auth import IdentityError, build_control_auth

log = logging.getLogger(__name__)

JWKS_PATH = "/openid/v1/jwks"
# What the API server's key set route produces: it answers 406 to a request that accepts only application/json.
JWKS_ACCEPT = "application/jwk-set+json, application/json"
REFRESH_SECONDS = 300.0


class JwksSource(Protocol):
    async def request(self, method: str, path: str, *, accept: str = ...) -> dict: ...


class GuardIdentity:
    def __init__(self, token_file: str | Path, api: JwksSource,
                 on_change: Callable[[ControlAuthConfig], None] = lambda config: None,
                 refresh_seconds: float = REFRESH_SECONDS):
        self.token_file = Path(token_file)
        self.api = api
        self.on_change = on_change
        self.refresh_seconds = refresh_seconds
        self.control_auth: ControlAuthConfig | None = None
        self.problem: str | None = None
        self._token: str | None = None
        self._stamp: tuple[float, int] | None = None

    def token(self) -> str | None:
        """The token in the file now (re-read when the file changed); None when it cannot be read."""
        try:
            stat = self.token_file.stat()
            stamp = (stat.st_mtime, stat.st_ino)
            if stamp != self._stamp:
                self._token, self._stamp = self.token_file.read_text().strip() or None, stamp
        except OSError as e:
            self._note(f"cannot read the guard token {self.token_file}: {e}")
            return None
        return self._token

    def authorization(self) -> dict[str, str]:
        """The header of a call to a guard's control route (none when there is no token: the guard says 401)."""
        token = self.token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def refresh(self) -> ControlAuthConfig | None:
        """Read the keys and the token again; ``on_change`` with the new ``controlAuth`` when it differs."""
        token = self.token()
        if token is None:
            return self.control_auth
        try:
            config = build_control_auth(token, await self.api.request("GET", JWKS_PATH, accept=JWKS_ACCEPT))
        except IdentityError as e:
            self._note(str(e))
            return self.control_auth
        except Exception as e:  # the API server's answer: the next refresh asks again
            self._note(f"cannot read the cluster's signing keys ({JWKS_PATH}): {type(e).__name__}: {e}")
            return self.control_auth
        self.problem = None
        if config != self.control_auth:
            log.info("guards accept %s from issuer %s (keys %s)", ", ".join(config.subjects), config.issuer,
                     ", ".join(k.kid for k in config.keys))
            self.control_auth = config
            self.on_change(config)
        return config

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh()

    def _note(self, problem: str) -> None:
        if problem != self.problem:
            log.warning("%s; the guards keep the identity they have (%s)", problem,
                        "none: they refuse the operator's control calls" if self.control_auth is None
                        else "the last one read")
        self.problem = problem
