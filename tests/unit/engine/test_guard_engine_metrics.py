"""vLLM's own metrics on the guard's port (/metrics/engine): vLLM listens on the
pod's loopback, so this is where Prometheus and the operator read them."""
from __future__ import annotations

import gzip

import aiohttp
import pytest
from aiohttp import web

from gpufleet_api.guard import guard_config
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH
from gpufleet_engine.serving.server import GuardServer
from tests.unit.engine.conftest import METRICS_TEMPLATE

EXPOSITION = METRICS_TEMPLATE.format(usage=0.25, running=2, block_size=32, blocks=64).encode()
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class ScrapedVllm:
    """Answers /metrics as prometheus_client does: OpenMetrics when asked, gzip when accepted."""

    def __init__(self):
        self.status = 200
        self.seen_headers: list[dict] = []

    async def metrics(self, request: web.Request) -> web.Response:
        self.seen_headers.append(dict(request.headers))
        if self.status != 200:
            return web.Response(status=self.status, text="engine failed")
        openmetrics = "application/openmetrics-text" in request.headers.get("Accept", "")
        headers = {"Content-Type": OPENMETRICS if openmetrics else "text/plain; version=0.0.4; charset=utf-8"}
        body = EXPOSITION
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        return web.Response(body=body, headers=headers)


@pytest.fixture
async def scraped_guard(tokenizer):
    vllm = ScrapedVllm()
    app = web.Application()
    app.router.add_get("/metrics", vllm.metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    raw = {"servedModelName": "m", "tokenizer": "unused", "listenHost": "127.0.0.1", "listenPort": 0,
           "maxContextTokens": 1000, "engineUrl": f"http://127.0.0.1:{runner.addresses[0][1]}"}
    guard = GuardServer(guard_config.parse(raw), tokenizer=tokenizer)
    await guard.start()
    yield vllm, guard
    await guard.stop()
    await runner.cleanup()


async def test_vllms_metrics_come_through_byte_for_byte_with_vllms_content_type(scraped_guard):
    _vllm, guard = scraped_guard
    async with aiohttp.ClientSession() as s:
        async with s.get(guard.url + ENGINE_METRICS_PATH) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert await r.read() == EXPOSITION


async def test_the_scrapers_format_and_compression_reach_vllm_and_come_back(scraped_guard):
    vllm, guard = scraped_guard
    headers = {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"}
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.get(guard.url + ENGINE_METRICS_PATH, headers=headers) as r:
            assert r.headers["Content-Type"] == OPENMETRICS
            assert r.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(await r.read()) == EXPOSITION
    assert vllm.seen_headers[-1]["Accept-Encoding"] == "gzip"


async def test_an_unencoded_scrape_asks_vllm_for_no_encoding(scraped_guard):
    vllm, guard = scraped_guard
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.get(guard.url + ENGINE_METRICS_PATH, skip_auto_headers=["Accept-Encoding"]) as r:
            assert "Content-Encoding" not in r.headers and await r.read() == EXPOSITION
    assert [h.get("Accept-Encoding") for h in vllm.seen_headers if "Accept-Encoding" in h][-1] == "identity"


async def test_a_vllm_error_status_is_passed_on(scraped_guard):
    vllm, guard = scraped_guard
    vllm.status = 500
    async with aiohttp.ClientSession() as s:
        async with s.get(guard.url + ENGINE_METRICS_PATH) as r:
            assert r.status == 500


async def test_vllm_not_answering_is_a_503_that_says_where_it_looked(tokenizer):
    raw = {"servedModelName": "m", "tokenizer": "unused", "listenHost": "127.0.0.1", "listenPort": 0,
           "maxContextTokens": 1000, "engineUrl": "http://127.0.0.1:9"}  # the discard port: nothing listens
    guard = GuardServer(guard_config.parse(raw), tokenizer=tokenizer)
    await guard.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(guard.url + ENGINE_METRICS_PATH) as r:
                assert r.status == 503
                assert "http://127.0.0.1:9/metrics" in await r.text()
    finally:
        await guard.stop()
