"""KubeClient's LIST and WATCH on the wire, against a local API stand-in: the list's
resourceVersion comes back with its items; a watch asks from a version with bookmarks,
reads events of any size line by line, and counts itself as a watch; a 410 answer is an
ApiError carrying the server's Status."""
from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet.wiring.runtime import TRANSIENT_RETRY_SECONDS, retry_delay
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import ApiError, KubeError, Unreachable
from tests.support.kubeconfigs import write_kubeconfig

BIG = "x" * (1 << 20)   # an event past aiohttp's default line limit (512 KiB); etcd keeps objects to 1.5 MiB


class Apiserver:
    def __init__(self):
        self.queries: list[dict] = []
        self.gone = False
        app = web.Application()
        app.router.add_get("/api/v1", self.discovery)
        app.router.add_get("/api/v1/namespaces/ml/pods", self.pods)
        self.server = TestServer(app)

    @staticmethod
    async def discovery(_request):
        return web.json_response({"resources": [{"name": "pods", "kind": "Pod", "namespaced": True}]})

    async def pods(self, request):
        self.queries.append(dict(request.query))
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "41"},
                                      "items": [{"metadata": {"name": "a", "resourceVersion": "40"}}]})
        if self.gone:
            return web.json_response({"kind": "Status", "status": "Failure", "reason": "Expired",
                                      "message": "too old resource version: 41 (90)", "code": 410}, status=410)
        resp = web.StreamResponse()
        await resp.prepare(request)
        events = [{"type": "MODIFIED", "object": {"metadata": {"name": "a", "resourceVersion": "42"},
                                                  "data": BIG}},
                  {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "50"}}}]
        for e in events:   # one event a line, as the API server sends them, in pieces
            line = json.dumps(e).encode() + b"\n"
            for i in range(0, len(line), 60000):
                await resp.write(line[i:i + 60000])
        return resp


@pytest.fixture
async def apiserver():
    api = Apiserver()
    await api.server.start_server()
    yield api
    await api.server.close()


def client(apiserver, tmp_path, counted: list) -> KubeClient:
    path = write_kubeconfig(tmp_path / "config", server=str(apiserver.server.make_url("")).rstrip("/"),
                            user={"token": "t"})
    return KubeClient(KubeConfig.from_file(path), on_request=lambda *r: counted.append(r))


async def test_a_list_returns_its_resource_version_and_a_watch_resumes_from_it(apiserver, tmp_path):
    counted: list = []
    async with client(apiserver, tmp_path, counted) as kube:
        items, version = await kube.list_versioned("v1", "Pod", "ml", label_selector="app=engine")
        assert [i["metadata"]["name"] for i in items] == ["a"] and version == "41"
        assert items[0]["kind"] == "Pod"
        events = [e async for e in kube.watch("v1", "Pod", "ml", timeout_seconds=30, label_selector="app=engine",
                                              resource_version=version, allow_bookmarks=True)]
    assert [e["type"] for e in events] == ["MODIFIED", "BOOKMARK"] and events[0]["object"]["data"] == BIG
    assert apiserver.queries[-1] == {"watch": "true", "timeoutSeconds": "30", "labelSelector": "app=engine",
                                     "resourceVersion": "41", "allowWatchBookmarks": "true"}
    assert [r for r in counted if r[1] == "pods"] == [("list", "pods", 200), ("watch", "pods", 200)]


async def test_a_watch_from_a_version_the_server_no_longer_keeps_is_410(apiserver, tmp_path):
    apiserver.gone = True
    counted: list = []
    async with client(apiserver, tmp_path, counted) as kube:
        with pytest.raises(ApiError) as e:
            _ = [e async for e in kube.watch("v1", "Pod", "ml", resource_version="41")]
    assert e.value.status == 410 and e.value.reason == "Expired" and "too old" in e.value.message
    assert counted[-1] == ("watch", "pods", 410)


async def test_no_answer_is_the_kits_unreachable_error_with_the_transports_as_its_cause(apiserver, tmp_path):
    # The kit's boundary: a caller branches on KubeError's classes, never on aiohttp's; a connection that
    # fails is transient (the operator asks again in seconds, not after the backoff for a refused request).
    counted: list = []
    kube = client(apiserver, tmp_path, counted)
    await apiserver.server.close()    # nothing listens on its port any more
    async with kube:
        with pytest.raises(Unreachable) as e:
            await kube.get("v1", "Pod", "a", "ml")
        assert isinstance(e.value.__cause__, aiohttp.ClientConnectionError)
        assert e.value.transient and isinstance(e.value, KubeError)
        assert str(e.value).startswith("GET /api/v1") and "Cannot connect" in str(e.value)   # discovery first
        with pytest.raises(Unreachable):
            _ = [ev async for ev in kube.watch("v1", "Pod", "ml", resource_version="41")]
    assert counted and all(status == 0 for *_, status in counted)   # counted as unanswered
    assert retry_delay(e.value, 3) == TRANSIENT_RETRY_SECONDS


async def test_a_watch_the_server_breaks_off_is_unreachable_after_the_events_it_sent(tmp_path):
    async def broken(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(json.dumps({"type": "ADDED", "object": {"metadata": {"name": "a"}}}).encode() + b"\n")
        await resp.write(b'{"type": "MODI')
        assert request.transport is not None
        request.transport.abort()
        return resp
    app = web.Application()
    app.router.add_get("/api/v1", Apiserver.discovery)
    app.router.add_get("/api/v1/namespaces/ml/pods", broken)
    server = TestServer(app)
    await server.start_server()
    try:
        path = write_kubeconfig(tmp_path / "config", server=str(server.make_url("")).rstrip("/"), user={"token": "t"})
        seen = []
        async with KubeClient(KubeConfig.from_file(path)) as kube:
            with pytest.raises(Unreachable) as e:
                async for ev in kube.watch("v1", "Pod", "ml", resource_version="1"):
                    seen.append(ev["object"]["metadata"]["name"])
        assert seen == ["a"] and isinstance(e.value.__cause__, aiohttp.ClientError)
    finally:
        await server.close()
