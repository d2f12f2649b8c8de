"""The client against a local API stand-in that accepts only some tokens: an
expiring exec token is replaced before it lapses, a refused one is replaced
once, and kopf's own client is handed the same credentials."""
from __future__ import annotations

import asyncio
import types

import kopf
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet.wiring import handlers
from gpufleet_kit.kube import config as kc
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import ApiError
from tests.support.kubeconfigs import exec_plugin, exec_user, plugin_runs, write_kubeconfig

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"}}


class Apiserver:
    """Answers discovery, one pod and a watch, except to refused tokens."""

    def __init__(self):
        self.refused: set[str] = set()
        self.refuse_all = False
        self.seen: list[str] = []
        app = web.Application(middlewares=[self.authenticate])
        app.router.add_get("/api/v1", self.discovery)
        app.router.add_get("/api/v1/namespaces/default/pods/p", self.pod)
        app.router.add_get("/api/v1/namespaces/default/pods", self.pods)
        self.server = TestServer(app)

    @web.middleware
    async def authenticate(self, request, handler):
        auth = request.headers.get("Authorization", "")
        self.seen.append(auth)
        if self.refuse_all or auth.removeprefix("Bearer ") in self.refused:
            return web.json_response({"kind": "Status", "status": "Failure", "reason": "Unauthorized",
                                      "message": "Unauthorized", "code": 401}, status=401)
        return await handler(request)

    async def discovery(self, _request):
        return web.json_response({"resources": [{"name": "pods", "kind": "Pod", "namespaced": True}]})

    async def pod(self, _request):
        return web.json_response(POD)

    async def pods(self, request):
        if request.query.get("watch") != "true":
            return web.json_response({"items": [POD]})
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'{"type": "ADDED", "object": {"metadata": {"name": "p"}}}\n')
        return resp


@pytest.fixture
async def apiserver():
    api = Apiserver()
    await api.server.start_server()
    yield api
    await api.server.close()


def client_for(apiserver, tmp_path, **plugin) -> KubeClient:
    path = write_kubeconfig(tmp_path / "config", server=str(apiserver.server.make_url("")).rstrip("/"),
                            user=exec_user(exec_plugin(tmp_path, **plugin)))
    return KubeClient(KubeConfig.from_file(path))


async def test_expiring_token_is_replaced_before_the_request(apiserver, tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "MIN_RELOAD_SECONDS", 0.0)
    apiserver.refused = {"token-1"}
    async with client_for(apiserver, tmp_path, expires_in=5) as kube:  # inside the margin: stale at once
        assert (await kube.get("v1", "Pod", "p", "default"))["metadata"]["name"] == "p"
    assert apiserver.seen[0] == "Bearer token-2"


async def test_refused_token_is_reloaded_and_the_request_retried(apiserver, tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "MIN_RELOAD_SECONDS", 0.0)
    apiserver.refused = {"token-1"}  # revoked
    async with client_for(apiserver, tmp_path, expires_in=None) as kube:
        await kube.get("v1", "Pod", "p", "default")
    assert apiserver.seen == ["Bearer token-1", "Bearer token-2", "Bearer token-2"]


async def test_concurrent_refusals_run_the_plugin_once(apiserver, tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "MIN_RELOAD_SECONDS", 0.0)
    async with client_for(apiserver, tmp_path, expires_in=None) as kube:
        await kube.resource("v1", "Pod")
        apiserver.refused = {"token-1"}
        await asyncio.gather(*(kube.get("v1", "Pod", "p", "default") for _ in range(8)))
    assert plugin_runs(tmp_path) == 2


async def test_freshly_loaded_credentials_that_are_refused_fail_with_401(apiserver, tmp_path):
    apiserver.refuse_all = True
    async with client_for(apiserver, tmp_path) as kube:
        with pytest.raises(ApiError) as e:
            await kube.get("v1", "Pod", "p", "default")
    assert e.value.status == 401
    assert plugin_runs(tmp_path) == 1  # no plugin storm for credentials that cannot be right


async def test_watch_retries_with_reloaded_credentials(apiserver, tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "MIN_RELOAD_SECONDS", 0.0)
    async with client_for(apiserver, tmp_path, expires_in=None) as kube:
        await kube.resource("v1", "Pod")
        apiserver.refused = {"token-1"}
        events = [e async for e in kube.watch("v1", "Pod", "default", timeout_seconds=1)]
    assert events == [{"type": "ADDED", "object": {"metadata": {"name": "p"}}}]
    assert apiserver.seen[-2:] == ["Bearer token-1", "Bearer token-2"]


async def test_kopf_login_hands_over_the_clients_credentials_and_reloads_on_relogin(apiserver, tmp_path):
    async with client_for(apiserver, tmp_path) as kube:
        memo = kopf.Memo(runtime=types.SimpleNamespace(kube=kube))
        first = await handlers.login(memo=memo)
        creds = kube.config.current
        assert (first.server, first.scheme, first.token) == (creds.server, "Bearer", "token-1")
        assert first.expiration == creds.renew_at  # kopf logs in again before the token lapses
        assert first.as_http_headers() == {"Authorization": "Bearer token-1"}

        # kopf logs in again only after a 401 or at expiration: a new token, and the client uses it too.
        second = await handlers.login(memo=memo)
        assert second.token == "token-2" and kube.config.current.token == "token-2"

        # When the operator's own client already replaced kopf's generation, no extra plugin run.
        memo.login_generation -= 1
        third = await handlers.login(memo=memo)
        assert third.token == "token-2" and plugin_runs(tmp_path) == 2
