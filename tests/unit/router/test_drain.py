"""A router told to stop (SIGTERM in a pod) drains: unready but still serving for
the grace, with every answer closing its connection so clients move to another
router; a stream in progress runs to its end; then the listener closes. With two
routers, a client that moves to the other loses no request."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gpufleet_api import API_VERSION, KIND
from gpufleet_router.server import RouterSettings, serve
from tests.support.waiting import wait_for
from tests.unit.router.test_server import FakeGuard


class FakeKube:
    """The two listings the router makes, answered from memory."""

    def __init__(self, guard_ip: str):
        self.isvc = {"metadata": {"name": "tiny", "namespace": "ml"},
                     "spec": {"model": {"name": "tiny"}, "engine": {"kvCache": {"blockSize": 16}}}}
        self.pod = {"metadata": {"name": "tiny-0", "namespace": "ml", "labels": {"gpufleet.dev/service": "tiny"}},
                    "status": {"podIP": guard_ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    async def list(self, api_version, kind, namespace=None, *, label_selector=None):
        return [self.isvc] if (api_version, kind) == (API_VERSION, KIND) else [self.pod]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def readyz(http: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with http.get(url + "/readyz") as r:
            return r.status
    except aiohttp.ClientConnectionError:
        return None


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        await wait_for(lambda: _is(readyz(http, url), 200), timeout=30, interval=0.02, what=f"{url} ready")


async def _is(value, wanted) -> bool:
    return (await value) == wanted


@pytest.fixture
async def guard():
    g = await FakeGuard("a").start()
    yield g
    g.release.set()
    await g.server.close()


async def test_a_stopped_router_drains_and_its_twin_takes_the_rest(guard):
    # The grace is the product's timer: the test makes two requests inside it (a readiness probe and
    # one completion), which a loaded machine can stretch past half a second.
    settings = RouterSettings(guard_port=guard.server.port, discovery="list", discovery_interval=0.1, drain_grace=2.0,
                              drain_timeout=5.0)
    stops = [asyncio.Event(), asyncio.Event()]
    ports = [free_port(), free_port()]
    routers = [asyncio.create_task(serve(FakeKube("127.0.0.1"), settings, "127.0.0.1", port, stop))
               for port, stop in zip(ports, stops)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for url in urls:
        await wait_ready(url)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as http:
        guard.release.clear()
        streaming = await http.post(urls[0] + "/v1/completions", json=body)
        await streaming.content.readuntil(b"\n\n")          # started: its first chunk is out

        stops[0].set()                                       # SIGTERM to router 0
        # the Service stops sending it new clients
        await wait_for(lambda: _is(readyz(http, urls[0]), 503), timeout=30, interval=0.02,
                       what="router 0 unready once told to stop")
        guard.release.set()
        async with http.post(urls[0] + "/v1/completions", json={**body, "stream": False}) as r:
            assert r.status == 200                           # still served within the grace...
            assert r.headers["Connection"] == "close"        # ...and the client told to reconnect
            await r.read()
        assert (await streaming.read()).endswith(b"data: [DONE]\n\n")   # the stream in progress finished

        await asyncio.wait_for(routers[0], 10)               # grace over: router 0 is gone
        statuses = []
        for url in (urls[0], urls[1]):                       # a client retrying a refused connect elsewhere
            try:
                async with http.post(url + "/v1/completions", json={**body, "stream": False}) as r:
                    statuses.append(r.status)
                    await r.read()
                    break
            except aiohttp.ClientConnectionError:
                statuses.append("refused")
        assert statuses == ["refused", 200]
    stops[1].set()
    await asyncio.wait_for(routers[1], 10)
