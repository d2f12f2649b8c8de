"""The check of a control route's caller (serving/operator_tokens.py): only a token signed by the
issuer's key, for the guard's audience, from the issuer, naming the operator, unexpired, passes.
Every key is made here; each refusal is a token an attacker could really send."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import pytest
from cryptography.hazmat.primitives import serialization

from gpufleet_api import typed
from gpufleet_api.guard.control_auth import ControlAuthConfig
from gpufleet_engine.serving.operator_tokens import OperatorTokens, Refused
from tests.support.token_issuer import OPERATOR, Issuer


def config(issuer: Issuer, **changes) -> ControlAuthConfig:
    return typed.convert(ControlAuthConfig, {**issuer.control_auth(), **changes})


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return Issuer()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged(header: dict, claims: dict, sign=lambda signing_input: b"") -> str:
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(sign(signing_input.encode()))}"


def claims(issuer: Issuer) -> dict:
    return {"iss": issuer.issuer, "aud": "gpufleet-guard", "sub": OPERATOR, "exp": int(time.time()) + 600}


@pytest.mark.parametrize("alg", ["RS256", "ES256"])
def test_the_operators_token_is_accepted(alg):
    issuer = Issuer(alg=alg)
    caller = OperatorTokens(config(issuer)).verify(f"Bearer {issuer.token()}")
    assert caller.subject == OPERATOR


def test_a_token_with_the_guard_among_its_audiences_is_accepted(issuer):
    assert OperatorTokens(config(issuer)).verify(f"Bearer {issuer.token(aud=['other', 'gpufleet-guard'])}")


@pytest.mark.parametrize("token_args, why", [
    ({"aud": "https://kubernetes.default.svc"}, "audience must be 'gpufleet-guard'"),  # the pod's API token
    ({"iss": "https://other-cluster.example"}, "issuer is not this cluster's"),
    ({"sub": "system:serviceaccount:tenant:default"}, "subject 'system:serviceaccount:tenant:default' is not"),
    ({"lifetime": -120}, "expired"),
    ({"not_before": time.time() + 600}, "not valid yet"),
])
def test_a_token_with_a_wrong_claim_is_refused(issuer, token_args, why):
    with pytest.raises(Refused, match=why):
        OperatorTokens(config(issuer)).verify(f"Bearer {issuer.token(**token_args)}")


def test_a_token_signed_by_another_key_with_the_same_kid_is_refused(issuer):
    impostor = Issuer(kid=issuer.kid)
    with pytest.raises(Refused, match="signature does not verify"):
        OperatorTokens(config(issuer)).verify(f"Bearer {impostor.token()}")


def test_a_token_signed_by_a_key_the_guard_does_not_know_is_refused(issuer):
    with pytest.raises(Refused, match="signing key 'elsewhere' is not one of the issuer's keys"):
        OperatorTokens(config(issuer)).verify(f"Bearer {Issuer(kid='elsewhere').token()}")


def test_an_unsigned_token_is_refused(issuer):
    token = forged({"alg": "none", "kid": issuer.kid, "typ": "JWT"}, claims(issuer))
    with pytest.raises(Refused, match="signed with 'none'"):
        OperatorTokens(config(issuer)).verify(f"Bearer {token}")


def test_an_hmac_token_keyed_with_the_public_key_is_refused(issuer):
    # The classic confusion: the verifier's public key (public knowledge) used as an HS256 secret.
    public = issuer.key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)
    for secret in (public, json.dumps(issuer.jwk()).encode()):
        token = forged({"alg": "HS256", "kid": issuer.kid, "typ": "JWT"}, claims(issuer),
                       lambda data, secret=secret: hmac.new(secret, data, hashlib.sha256).digest())
        with pytest.raises(Refused, match="signed with 'HS256'"):
            OperatorTokens(config(issuer)).verify(f"Bearer {token}")


def test_an_ec_signature_claimed_for_an_rsa_key_is_refused(issuer):
    token = forged({"alg": "ES256", "kid": issuer.kid}, claims(issuer), lambda data: b"x" * 64)
    with pytest.raises(Refused, match="does not fit its key"):
        OperatorTokens(config(issuer)).verify(f"Bearer {token}")


def test_a_token_without_an_expiry_is_refused(issuer):
    token = forged({"alg": "RS256", "kid": issuer.kid}, {**claims(issuer), "exp": None})
    with pytest.raises(Refused):
        OperatorTokens(config(issuer)).verify(f"Bearer {token}")
    import jwt
    unexpiring = jwt.encode({k: v for k, v in claims(issuer).items() if k != "exp"}, issuer.key,
                            algorithm="RS256", headers={"kid": issuer.kid})
    with pytest.raises(Refused, match="no 'exp' claim"):
        OperatorTokens(config(issuer)).verify(f"Bearer {unexpiring}")


@pytest.mark.parametrize("header, why", [
    (None, "no Authorization header"),
    ("", "no Authorization header"),
    ("Basic b3BlcmF0b3I6cGFzcw==", "not 'Bearer <token>'"),
    ("Bearer ", "not 'Bearer <token>'"),
    ("Bearer not.a.jwt", "not a JWT"),
])
def test_a_missing_or_malformed_header_is_refused(issuer, header, why):
    with pytest.raises(Refused, match=why):
        OperatorTokens(config(issuer)).verify(header)


def test_a_guard_without_control_auth_accepts_nobody(issuer):
    with pytest.raises(Refused, match="guard.json has no controlAuth"):
        OperatorTokens(None).verify(f"Bearer {issuer.token()}")


def test_a_verified_token_is_remembered_until_it_expires(issuer):
    now = [time.time()]
    tokens = OperatorTokens(config(issuer), clock=lambda: now[0])
    token = issuer.token(lifetime=60)
    first = tokens.verify(f"Bearer {token}")
    assert tokens.verify(f"Bearer {token}") is first  # from the cache: no second signature check
    now[0] += 60 + 31  # past exp and the leeway
    with pytest.raises(Refused, match="expired"):
        tokens.verify(f"Bearer {token}")


def test_new_control_auth_forgets_every_verified_token(issuer):
    tokens = OperatorTokens(config(issuer))
    token = issuer.token()
    tokens.verify(f"Bearer {token}")
    rotated = Issuer(kid="rotated")  # the old key left the set: its tokens no longer pass
    tokens.configure(config(rotated))
    with pytest.raises(Refused, match="not one of the issuer's keys"):
        tokens.verify(f"Bearer {token}")
    tokens.configure(config(issuer, subjects=["system:serviceaccount:gpufleet-system:someone-else"]))
    with pytest.raises(Refused, match="subject"):
        tokens.verify(f"Bearer {token}")


def test_the_cache_is_bounded(issuer):
    tokens = OperatorTokens(config(issuer), cache_entries=4)
    for i in range(10):
        tokens.verify(f"Bearer {issuer.token(jti=str(i))}")
    assert len(tokens._verified) == 4


def test_an_unusable_key_beside_a_good_one_leaves_the_good_one_working(issuer):
    broken = {"kty": "RSA", "kid": "broken", "n": "AA", "e": "AQAB"}
    doc = issuer.control_auth()
    tokens = OperatorTokens(typed.convert(ControlAuthConfig, {**doc, "keys": [broken, *doc["keys"]]}))
    assert tokens.verify(f"Bearer {issuer.token()}").subject == OPERATOR
