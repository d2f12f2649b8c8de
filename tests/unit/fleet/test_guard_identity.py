"""The operator's identity towards the guards (fleet/guard_identity.py, manifests/control_auth.py):
its own token and the cluster's keys make guard.json's controlAuth, and a real guard configured
from that document takes the operator's control calls and refuses them without the token."""
from __future__ import annotations

import json
import os

import pytest

from gpufleet.fleet.guard_identity import JWKS_PATH, GuardIdentity
from gpufleet.fleet.scrape import ReplicaReader
from gpufleet.manifests.control_auth import IdentityError, build_control_auth
from gpufleet_api import typed
from gpufleet_api.guard import guard_config
from gpufleet_api.guard.adapters import AdapterSet
from gpufleet_api.guard.control_auth import ControlAuthConfig
from gpufleet_engine.serving.server import GuardServer
from tests.support.token_issuer import OPERATOR, Issuer
from tests.unit.engine.conftest import FakeVllm, WordTokenizer, serving


class Api:
    """The API server's /openid/v1/jwks."""

    def __init__(self, *issuers: Issuer):
        self.jwks: dict = {"keys": [i.jwk() for i in issuers]}
        self.failing: Exception | None = None
        self.asked: list[str] = []

    async def request(self, method: str, path: str, *, accept: str = "application/json") -> dict:
        assert "application/jwk-set+json" in accept  # the route's own type: plain JSON gets a 406
        self.asked.append(path)
        if self.failing is not None:
            raise self.failing
        return self.jwks


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return Issuer()


def test_the_operators_token_and_the_key_set_make_control_auth(issuer):
    ec = Issuer(kid="ec", alg="ES256")
    jwks = {"keys": [issuer.jwk(), ec.jwk(), {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
                     {**Issuer(kid="enc").jwk(), "use": "enc"}]}
    config = build_control_auth(issuer.token(), jwks)
    assert config.issuer == issuer.issuer and config.subjects == (OPERATOR,)
    assert [k.kid for k in config.keys] == [issuer.kid, "ec"]  # signing keys the guards can use, only
    # What the operator writes is what the guard reads.
    assert guard_config.parse({"servedModelName": "m", "tokenizer": "t",
                               "controlAuth": typed.to_builtins(config)}).control_auth == config


@pytest.mark.parametrize("token, jwks, why", [
    ("not-a-token", {"keys": []}, "not a JWT"),
    (None, {"keys": []}, "audience is 'https://kubernetes.default.svc'"),
    ("ok", {}, "no 'keys' list"),
    ("ok", {"keys": [{"kty": "oct", "kid": "x", "k": "c2VjcmV0"}]}, "no RSA or EC signing key"),
])
def test_a_token_or_key_set_that_cannot_identify_the_operator_says_why(issuer, token, jwks, why):
    token = {None: issuer.token(aud="https://kubernetes.default.svc"), "ok": issuer.token()}.get(token, token)
    with pytest.raises(IdentityError, match=why):
        build_control_auth(token, jwks)


async def test_refresh_publishes_new_keys_once_and_keeps_the_last_on_failure(tmp_path, issuer):
    token_file = tmp_path / "token"
    token_file.write_text(issuer.token())
    seen: list[ControlAuthConfig] = []
    api = Api(issuer)
    identity = GuardIdentity(token_file, api, seen.append)
    first = await identity.refresh()
    await identity.refresh()
    assert api.asked == [JWKS_PATH, JWKS_PATH] and seen == [first]  # unchanged: no second publication
    api.failing = ConnectionError("API server down")
    assert await identity.refresh() == first and "API server down" in (identity.problem or "")
    api.failing = None
    rotated = Issuer(kid="rotated")
    api.jwks["keys"].append(rotated.jwk())
    assert (await identity.refresh()) == seen[-1] and [k.kid for k in seen[-1].keys] == [issuer.kid, "rotated"]


def test_a_rotated_token_file_is_read_again(tmp_path, issuer):
    token_file = tmp_path / "token"
    token_file.write_text(issuer.token(jti="old"))
    identity = GuardIdentity(token_file, Api(issuer))
    old = identity.authorization()
    # The kubelet swaps the projected file for a new one before the old token expires.
    replacement = tmp_path / "token.new"
    replacement.write_text(issuer.token(jti="new"))
    os.replace(replacement, token_file)
    assert identity.authorization() != old and identity.authorization()["Authorization"].startswith("Bearer ")
    token_file.unlink()
    assert identity.authorization() == {} and "cannot read the guard token" in (identity.problem or "")


async def test_the_operators_calls_reach_a_guard_configured_from_its_identity(tmp_path, issuer):
    token_file = tmp_path / "token"
    token_file.write_text(issuer.token())
    identity = GuardIdentity(token_file, Api(issuer))
    control_auth = await identity.refresh()
    assert control_auth is not None
    async with serving(FakeVllm()) as fake:
        raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake.url, "listenHost": "127.0.0.1",
               "listenPort": 0, "metricsPollSeconds": 0.05, "maxContextTokens": 1000,
               "engine": {"model": "m", "lora": {"maxAdapters": 2}}, "controlAuth": typed.to_builtins(control_auth)}
        guard = GuardServer(guard_config.parse(raw), tokenizer=WordTokenizer())
        await guard.start()
        try:
            wanted = typed.convert(AdapterSet, {"adapters": [{"name": "a", "source": {"path": "/a"}}]})
            operator = ReplicaReader(guard_port=guard.port, authorization=identity.authorization)
            anonymous = ReplicaReader(guard_port=guard.port)
            try:
                assert await operator.put_adapters("p", "127.0.0.1", wanted) is None
                report, why = await operator.adapters("p", "127.0.0.1")
                assert why is None and report is not None and [a.name for a in report.adapters] == ["a"]
                assert (await operator.audit("p", "127.0.0.1"))[1] is None
                refused = await anonymous.put_adapters("p", "127.0.0.1", AdapterSet())
                assert refused is not None and "answered 401" in refused and "no Authorization header" in refused
                assert (await anonymous.audit("p", "127.0.0.1"))[0] is None
            finally:
                await operator.close()
                await anonymous.close()
            assert guard.adapters is not None and set(guard.adapters.book.entries) == {"a"}
        finally:
            await guard.stop()


async def test_the_key_set_is_read_through_the_kube_client_from_a_route_that_produces_jwk_set_json(tmp_path, issuer):
    """The API server's key set route produces application/jwk-set+json only; go-restful answers a
    request that accepts plain JSON alone with 406, as this stand-in does."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gpufleet_kit.kube.client import KubeClient
    from gpufleet_kit.kube.config import KubeConfig
    from tests.support.kubeconfigs import write_kubeconfig

    async def jwks(request):
        if "application/jwk-set+json" not in request.headers.get("Accept", ""):
            return web.Response(status=406, text="406: Not Acceptable")
        return web.Response(text=json.dumps({"keys": [issuer.jwk()]}), content_type="application/jwk-set+json")
    app = web.Application()
    app.router.add_get(JWKS_PATH, jwks)
    server = TestServer(app)
    await server.start_server()
    try:
        path = write_kubeconfig(tmp_path / "config", server=str(server.make_url("")).rstrip("/"),
                                user={"token": "admin"})
        token_file = tmp_path / "token"
        token_file.write_text(issuer.token())
        async with KubeClient(KubeConfig.from_file(path)) as kube:
            config = await GuardIdentity(token_file, kube).refresh()
        assert config is not None and [k.kid for k in config.keys] == [issuer.kid]
    finally:
        await server.close()
