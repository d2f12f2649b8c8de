"""The guard's control routes accept the operator's token only, whatever the caller's address
(docs/security.md, "The guard's control routes"): each test tries to cross the boundary the way
a caller in the cluster could, from a real socket, and checks that nothing changed.

Callers come from 127.0.0.6, where Istio's inbound sidecar connects from, and from 127.0.0.1
(Linkerd's sidecar, a port-forward): on Linux the whole 127/8 is the loopback."""
from __future__ import annotations

import json
import stat

import aiohttp
import pytest

from gpufleet_api.guard import guard_config
from tests.support.token_issuer import Issuer
from tests.support.waiting import wait_for
from tests.unit.engine.conftest import FakeVllm, serving

SIDECAR = "127.0.0.6"
LORA_ENGINE = {"model": "m", "lora": {"maxLoras": 2, "maxLoraRank": 8, "maxAdapters": 2}}
ADAPTERS = {"adapters": [{"name": "tenant-a", "source": {"uri": "https://example.com/attacker.tar.gz"}}]}


class AdminFakeVllm(FakeVllm):
    """The fake vLLM with one admin route, counting the calls that reach it."""
    admin_calls: int = 0

    def app(self):
        app = super().app()
        app.router.add_post("/reset_prefix_cache", self._reset)
        return app

    async def _reset(self, request):
        from aiohttp import web
        self.admin_calls += 1
        return web.json_response({"reset": True})


@pytest.fixture
async def fake_vllm():
    async with serving(AdminFakeVllm()) as fake:
        yield fake


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return Issuer()


async def call(method: str, url: str, source: str = "127.0.0.1", **kwargs) -> tuple[int, dict]:
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector) as s, s.request(method, url, **kwargs) as r:
        body = await r.read()
        return r.status, json.loads(body) if body else {}


async def test_an_unauthenticated_put_adapters_is_a_401_and_the_book_is_unchanged(guard_factory, issuer):
    guard = await guard_factory(engine=LORA_ENGINE, controlAuth=issuer.control_auth())
    for source in (SIDECAR, "127.0.0.1"):
        for headers in ({}, {"Authorization": "Bearer forged"},
                        issuer.bearer(aud="https://kubernetes.default.svc"),  # a pod's own API token
                        issuer.bearer(sub="system:serviceaccount:tenant:default"),
                        Issuer(kid=issuer.kid).bearer()):  # another key under the operator's kid
            status, answer = await call("PUT", guard.url + "/adapters", source, json=ADAPTERS, headers=headers)
            assert status == 401, (source, headers)
            assert answer["error"]["code"] == "unauthenticated"
            assert "accepts the gpufleet operator only" in answer["error"]["message"]
    assert guard.adapters is not None and guard.adapters.book.entries == {}
    # The operator's token: taken.
    status, answer = await call("PUT", guard.url + "/adapters", SIDECAR, json=ADAPTERS, headers=issuer.bearer())
    assert status == 202 and [a["name"] for a in answer["adapters"]] == ["tenant-a"]
    assert set(guard.adapters.book.entries) == {"tenant-a"}


@pytest.mark.parametrize("path", ["/adapters", "/audit", "/demand"])
async def test_the_revealing_routes_answer_the_operator_only(guard_factory, issuer, path):
    guard = await guard_factory(controlAuth=issuer.control_auth())
    status, answer = await call("GET", guard.url + path, SIDECAR)
    assert status == 401 and "no Authorization header" in answer["error"]["message"]
    assert (await call("GET", guard.url + path, SIDECAR, headers=issuer.bearer()))[0] == 200


async def test_a_guard_without_control_auth_refuses_every_caller(guard_factory, issuer):
    guard = await guard_factory(engine=LORA_ENGINE)
    status, answer = await call("PUT", guard.url + "/adapters", json=ADAPTERS, headers=issuer.bearer())
    assert status == 401 and "guard.json has no controlAuth" in answer["error"]["message"]


async def test_drain_on_the_guards_port_is_refused_from_the_sidecars_address_and_with_a_token(guard_factory,
                                                                                             issuer):
    guard = await guard_factory(controlAuth=issuer.control_auth())
    for source, headers in ((SIDECAR, {}), ("127.0.0.1", {}), (SIDECAR, issuer.bearer())):
        status, answer = await call("POST", guard.url + "/drain", source, headers=headers)
        assert status == 403 and "admin socket" in answer["error"]["message"]
    assert not guard.guard.drain.draining
    assert (await call("GET", guard.url + "/drain", SIDECAR))[1]["draining"] is False


async def test_the_preStop_hooks_drain_goes_through_the_admin_socket(guard_factory, tmp_path):
    socket = tmp_path / "guard.sock"
    guard = await guard_factory(adminSocket=str(socket))
    assert stat.S_IMODE(socket.stat().st_mode) == 0o600
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket))) as s:
        async with s.post("http://guard/drain") as r:
            assert r.status == 200 and (await r.json())["draining"] is True
    assert guard.guard.drain.draining


async def test_vllms_admin_routes_take_the_operators_token_not_an_address(guard_factory, fake_vllm, issuer):
    guard = await guard_factory(controlAuth=issuer.control_auth())
    for source in (SIDECAR, "127.0.0.1"):
        status, answer = await call("POST", guard.url + "/reset_prefix_cache", source)
        assert status == 401 and answer["error"]["type"] == "Unauthorized"  # vLLM's error shape
    assert fake_vllm.admin_calls == 0
    status, answer = await call("POST", guard.url + "/reset_prefix_cache", SIDECAR, headers=issuer.bearer())
    assert (status, answer) == (200, {"reset": True}) and fake_vllm.admin_calls == 1


async def test_vllms_admin_routes_are_open_on_the_admin_socket(guard_factory, fake_vllm, tmp_path):
    socket = tmp_path / "guard.sock"
    await guard_factory(adminSocket=str(socket))
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket))) as s:
        async with s.post("http://guard/reset_prefix_cache") as r:
            assert r.status == 200
    assert fake_vllm.admin_calls == 1


async def test_inference_routes_need_no_token(guard_factory, issuer):
    guard = await guard_factory(controlAuth=issuer.control_auth())
    status, _ = await call("POST", guard.url + "/v1/completions", SIDECAR,
                           json={"model": "m", "prompt": "a b", "max_tokens": 2})
    assert status == 200


async def test_a_rotated_key_reaches_a_running_guard_through_guard_json(tmp_path, fake_vllm, tokenizer, issuer):
    from gpufleet_engine.serving.server import GuardServer

    raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake_vllm.url, "listenHost": "127.0.0.1",
           "listenPort": 0, "metricsPollSeconds": 0.05, "maxContextTokens": 1000,
           "controlAuth": issuer.control_auth()}
    path = tmp_path / "guard.json"
    path.write_text(json.dumps(raw))
    server = GuardServer(guard_config.parse(raw), tokenizer=tokenizer, config_path=str(path), reload_seconds=3600)
    await server.start()
    try:
        await server.wait_ready(5)
        assert (await call("GET", server.url + "/audit", headers=issuer.bearer()))[0] == 200
        rotated = Issuer(kid="rotated")
        path.write_text(json.dumps({**raw, "controlAuth": rotated.control_auth()}))
        assert server.watcher is not None and server.watcher.check() is not None
        await wait_for(lambda: server.tokens.config is not None and server.tokens.config.keys[0].kid == "rotated",
                       timeout=1, interval=0.01, what="the new keys applied")
        assert (await call("GET", server.url + "/audit", headers=issuer.bearer()))[0] == 401
        assert (await call("GET", server.url + "/audit", headers=rotated.bearer()))[0] == 200
    finally:
        await server.stop()
