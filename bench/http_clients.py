"""aiohttp against httpx in the two HTTP client roles that run all the time:

- ``stream``: the guard's upstream client. What the guard sends vLLM: a POST
  with a ~1.5 KB JSON body, answered by 64 server-sent events of ~200 bytes
  (one per decoded token, 5 ms apart), read chunk by chunk as the guard
  forwards them.
- ``scrape``: the operator's replica reader. A GET of a 40 KB Prometheus text
  page (vLLM's /metrics is of that size), read whole.

The server is a separate process, so the CPU time this process spends is the
client's own. The two clients alternate in rounds, so background load hits
both alike. Baseline: aiohttp; reports CPU per request and latency (time to
first byte for streams, whole response for scrapes) at 1 and 32 concurrent
requests, and the ratios httpx / aiohttp.

    python bench/http_clients.py [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_common import table  # noqa: E402

EVENTS, EVENT_GAP_S = 64, 0.005
BODY = json.dumps({"model": "tiny", "prompt": "fleet " * 250, "max_tokens": EVENTS, "stream": True})
EVENT = b"data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "tiny",
                                "choices": [{"index": 0, "text": " token", "logprobs": None,
                                             "finish_reason": None, "stop_reason": None}]}).encode() + b"\n\n"
METRICS = "".join(f'vllm:request_prompt_tokens_bucket{{engine="0",model_name="tiny",le="{i}"}} {i * 7}.0\n'
                  for i in range(560)).encode()  # ~40 KB
# role → (requests at 1 client, requests at 32 clients)
ROLES = {"stream": (20, 320), "scrape": (200, 3200)}


def serve(port: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(EVENTS):
            await asyncio.sleep(EVENT_GAP_S)
            await resp.write(EVENT)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def via_aiohttp(base: str, role: str, concurrency: int, requests: int) -> tuple[float, list[float]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False) as s:
        async def stream() -> float:
            t0, first = time.perf_counter(), None
            async with s.post(base + "/v1/completions", data=BODY,
                              headers={"Content-Type": "application/json"}) as r:
                async for _chunk in r.content.iter_any():
                    first = first or time.perf_counter() - t0
            return first

        async def scrape() -> float:
            t0 = time.perf_counter()
            async with s.get(base + "/metrics") as r:
                await r.text()
            return time.perf_counter() - t0
        return await _closed_loop(stream if role == "stream" else scrape, concurrency, requests)


async def via_httpx(base: str, role: str, concurrency: int, requests: int) -> tuple[float, list[float]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as c:
        async def stream() -> float:
            t0, first = time.perf_counter(), None
            async with c.stream("POST", base + "/v1/completions", content=BODY,
                                headers={"Content-Type": "application/json"}) as r:
                async for _chunk in r.aiter_raw():
                    first = first or time.perf_counter() - t0
            return first

        async def scrape() -> float:
            t0 = time.perf_counter()
            (await c.get(base + "/metrics")).text  # noqa: B018  (decoding is part of the read)
            return time.perf_counter() - t0
        return await _closed_loop(stream if role == "stream" else scrape, concurrency, requests)


async def _closed_loop(one, concurrency: int, requests: int) -> tuple[float, list[float]]:
    await asyncio.gather(*(one() for _ in range(concurrency)))  # connect and warm up, not measured
    left = requests
    latencies: list[float] = []

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            latencies.append(await one())

    cpu0 = time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return (time.process_time() - cpu0) / requests, latencies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    base = f"http://127.0.0.1:{port}"
    cpu: dict[tuple, list[float]] = {}
    latency: dict[tuple, list[float]] = {}
    try:
        wait_listening(port)
        for _ in range(args.rounds):
            for role, counts in ROLES.items():
                for concurrency, requests in zip((1, 32), counts, strict=True):
                    for name, fn in (("aiohttp", via_aiohttp), ("httpx", via_httpx)):
                        per_request, latencies = asyncio.run(fn(base, role, concurrency, requests))
                        cpu.setdefault((role, concurrency, name), []).append(per_request)
                        latency.setdefault((role, concurrency, name), []).extend(latencies)
    finally:
        server.terminate()
        server.wait()

    rows = [{"role": role, "clients": concurrency, "client": name, "requests": len(latency[key]),
             "cpu_ms_per_request": round(statistics.median(cpu[key]) * 1e3, 3),
             "latency_p50_ms": round(statistics.median(latency[key]) * 1e3, 2)}
            for key in cpu for role, concurrency, name in [key]]
    print(table(rows))
    print()
    for role in ROLES:
        for concurrency in (1, 32):
            a, h = (next(r for r in rows if (r["role"], r["clients"], r["client"]) == (role, concurrency, name))
                    for name in ("aiohttp", "httpx"))
            print(f"INFO  {role}, {concurrency} client(s): httpx / aiohttp CPU per request "
                  f"{h['cpu_ms_per_request'] / a['cpu_ms_per_request']:.2f}× "
                  f"({h['cpu_ms_per_request']} vs {a['cpu_ms_per_request']} ms), "
                  f"latency p50 {h['latency_p50_ms']} vs {a['latency_p50_ms']} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
