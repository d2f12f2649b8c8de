"""Baseline for the guard benchmarks: a plain aiohttp pass-through proxy, nothing else.

python bench/guard_passthrough_proxy.py --listen-port 9000 --upstream http://127.0.0.1:8000
"""
import argparse

import aiohttp
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection"}


def build(upstream: str) -> web.Application:
    app = web.Application(client_max_size=64 << 20)

    async def start(app):
        app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def stop(app):
        await app["s"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with app["s"].request(request.method, upstream + request.path_qs, headers=headers,
                                    data=await request.read()) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP | {"content-encoding"}})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    a = p.parse_args()
    web.run_app(build(a.upstream.rstrip("/")), host="127.0.0.1", port=a.listen_port, access_log=None,
                handler_cancellation=True, print=None)
