"""A stand-in for a cluster's service-account issuer: a key pair made in the test, its key set as
``/openid/v1/jwks`` lists it, and tokens signed with it, for the guard's control routes."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gpufleet_api.guard.control_auth import GUARD_AUDIENCE, service_account_subject

ISSUER = "https://kubernetes.default.svc.cluster.local"
OPERATOR = service_account_subject("gpufleet-system", "gpufleet-operator")


@dataclass
class Issuer:
    kid: str = "test-key"
    alg: str = "RS256"
    issuer: str = ISSUER
    key: Any = field(default=None)

    def __post_init__(self) -> None:
        if self.key is None:
            self.key = (rsa.generate_private_key(public_exponent=65537, key_size=2048) if self.alg == "RS256"
                        else ec.generate_private_key(ec.SECP256R1()))

    def jwk(self) -> dict:
        """The public key as the API server's ``/openid/v1/jwks`` lists it."""
        algorithm = jwt.algorithms.RSAAlgorithm if self.alg == "RS256" else jwt.algorithms.ECAlgorithm
        return {**json.loads(algorithm.to_jwk(self.key.public_key())), "kid": self.kid, "alg": self.alg,
                "use": "sig"}

    def control_auth(self, subjects: tuple[str, ...] = (OPERATOR,)) -> dict:
        """guard.json's ``controlAuth`` for this issuer."""
        return {"issuer": self.issuer, "subjects": list(subjects), "keys": [self.jwk()]}

    def token(self, *, sub: str = OPERATOR, aud: str | list[str] = GUARD_AUDIENCE, iss: str | None = None,
              lifetime: float = 3600, not_before: float | None = None, **claims: Any) -> str:
        now = time.time()
        payload = {"iss": iss or self.issuer, "aud": aud, "sub": sub, "iat": int(now),
                   "exp": int(now + lifetime), **claims}
        if not_before is not None:
            payload["nbf"] = int(not_before)
        return jwt.encode(payload, self.key, algorithm=self.alg, headers={"kid": self.kid})

    def bearer(self, **kwargs: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(**kwargs)}"}


# One issuer for a whole test session: the engine tier's session engine trusts its key, and the test
# modules sign with it. Kept here, not in a conftest: pytest imports tests/engine/conftest.py as
# "conftest", and a test's `from tests.engine.conftest import ...` is a second copy of that module,
# with a second random key every token of it is refused by.
SESSION = Issuer()
