"""vLLM's own /metrics, served on the guard's port (``/metrics/engine``).

vLLM binds the pod's loopback, so Prometheus and the operator cannot reach it;
the guard passes its exposition through byte for byte: vLLM's names, labels
and format (the scraper's Accept and Accept-Encoding are forwarded, and
vLLM's Content-Type and Content-Encoding come back). Each scrape reads vLLM
afresh: a copy of the guard's last poll could be served after vLLM died.
"""
from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gpufleet_engine.serving.upstream import Upstream

SCRAPE_TIMEOUT_SECONDS = 10.0  # Prometheus's default scrape timeout
_FORWARDED_REQUEST = ("accept",)
_FORWARDED_RESPONSE = ("content-type", "content-encoding")


async def read(upstream: Upstream, request: web.Request,
               timeout: float = SCRAPE_TIMEOUT_SECONDS) -> web.Response:
    """vLLM's answer to GET /metrics, or 503 saying why it could not be read."""
    assert upstream.session is not None
    headers = {k: request.headers[k] for k in _FORWARDED_REQUEST if k in request.headers}
    # The upstream session does not decompress: pass the scraper's encoding through, or none.
    headers["Accept-Encoding"] = request.headers.get("Accept-Encoding", "identity")
    try:
        async with upstream.session.get(upstream.url("/metrics"), headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            out = {k: resp.headers[k] for k in _FORWARDED_RESPONSE if k in resp.headers}
            return web.Response(body=body, status=resp.status, headers=out)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return web.Response(status=503, text=f"vLLM's metrics at {upstream.url('/metrics')} are not "
                                             f"answering: {e!r}\n")
