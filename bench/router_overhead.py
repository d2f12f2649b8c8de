"""The router's added latency against a bare pass-through proxy's, in the same run.

Three paths to one upstream that stands in for a guard (its /metrics ledger,
and completions streamed as 32 server-sent events 2 ms apart), each a
separate process so none shares an event loop with the client:

- ``direct``: the client to the upstream;
- ``proxy``: through bench/guard_passthrough_proxy.py (aiohttp, nothing else);
- ``router``: through the router (gpufleet_router.server: body parsed, model
  looked up, replica chosen, guard readings every second), with a fixed route
  table instead of an API server.

Rounds alternate the paths so background load hits all alike. Reported: p50
and p99 time to first byte and to the last byte at 1 and 16 concurrent
streams, the latency each adds over direct, and router-added / proxy-added.

    python bench/router_overhead.py [--rounds 3] [--requests 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

HERE = Path(__file__).resolve().parent
EVENTS, GAP_S = 32, 0.002
EVENT = b"data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "model": "tiny",
                                "choices": [{"index": 0, "text": " token"}]}).encode() + b"\n\n"
BODY = {"model": "tiny", "prompt": "fleet " * 200, "max_tokens": EVENTS, "stream": True}
METRICS = ("gpufleet_guard_kv_free_blocks 900\ngpufleet_guard_kv_reserved_blocks 0\n"
           "gpufleet_guard_kv_total_blocks 1000\ngpufleet_guard_kv_watermark_blocks 50\ngpufleet_guard_ready 1\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_upstream(port: int) -> None:
    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(EVENTS):
            await resp.write(EVENT)
            await asyncio.sleep(GAP_S)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_router(port: int, upstream: str, tenancy: tuple[list[dict], list[dict]] | None = None,
                 otlp_endpoint: str = "", sample_ratio: float | None = None) -> None:
    """The router on ``port`` with a fixed route to ``upstream``; ``tenancy``: InferenceTenants and key
    Secrets for its namespace ("bench"; bench/router_tenancy_overhead.py); ``otlp_endpoint``: its spans go
    there, at ``sample_ratio`` (default: the default sampling; bench/router_tracing_overhead.py)."""
    from gpufleet_api.tracing import DEFAULT_SAMPLE_RATIO, ROUTER_SERVICE_NAME, TracingConfig
    from gpufleet_kit.tracing import Tracing
    from gpufleet_router.metrics import RouterMetrics
    from gpufleet_router.policy.replicas import Replica
    from gpufleet_router.policy.table import Route, Table
    from gpufleet_router.server import Fleet, Router, RouterSettings, client_session

    async def main() -> None:
        settings = RouterSettings()
        fleet = Fleet(settings, RouterMetrics())
        http = client_session(settings)
        fleet.update(Table({"tiny": Route("bench", "tiny", "tiny", 16, 1, 1, (Replica("upstream-0", upstream),))}))
        if tenancy is not None:
            fleet.update_tenants(*tenancy)
        fleet.listed.set()
        reads = asyncio.create_task(fleet.read(http))
        tracing = Tracing.start(TracingConfig(otlp_endpoint, sample_ratio=DEFAULT_SAMPLE_RATIO if sample_ratio is None
                                              else sample_ratio), ROUTER_SERVICE_NAME) if otlp_endpoint else None
        runner = web.AppRunner(Router(fleet, http, tracing).app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await asyncio.Event().wait()
        finally:
            reads.cancel()
    asyncio.run(main())


def start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{args} did not listen on {port}")


async def one(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200, r.status
        first = None
        async for _chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


async def measure(url: str, requests: int, concurrency: int) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(3):  # warm the connection pools
            await one(http, url)
        remaining = iter(range(requests))

        async def worker() -> None:
            for _ in remaining:
                out.append(await one(http, url))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(rounds: int, requests: int) -> dict:
    ports = {"upstream": free_port(), "proxy": free_port(), "router": free_port()}
    upstream = f"127.0.0.1:{ports['upstream']}"
    procs = [start([__file__, "--serve-upstream", str(ports["upstream"])], ports["upstream"]),
             start([str(HERE / "guard_passthrough_proxy.py"), "--listen-port", str(ports["proxy"]),
                    "--upstream", f"http://{upstream}"], ports["proxy"]),
             start([__file__, "--serve-router", str(ports["router"]), "--upstream", upstream], ports["router"])]
    urls = {"direct": f"http://{upstream}", "proxy": f"http://127.0.0.1:{ports['proxy']}",
            "router": f"http://127.0.0.1:{ports['router']}"}
    try:
        await asyncio.sleep(1.5)  # the router's first guard reading
        results: dict = {}
        for concurrency in (1, 16):
            samples: dict[str, list[tuple[float, float]]] = {k: [] for k in urls}
            for _ in range(rounds):
                for name, url in urls.items():
                    samples[name] += await measure(url, requests, concurrency)
            row = {}
            for name, got in samples.items():
                ttfb, total = [x[0] for x in got], [x[1] for x in got]
                row[name] = {"ttfb_p50_ms": pct(ttfb, 0.5) * 1e3, "ttfb_p99_ms": pct(ttfb, 0.99) * 1e3,
                             "total_p50_ms": pct(total, 0.5) * 1e3, "total_p99_ms": pct(total, 0.99) * 1e3}
            for name in ("proxy", "router"):
                row[name]["added_ttfb_p50_ms"] = row[name]["ttfb_p50_ms"] - row["direct"]["ttfb_p50_ms"]
                row[name]["added_total_p50_ms"] = row[name]["total_p50_ms"] - row["direct"]["total_p50_ms"]
            row["router_over_proxy_added_ttfb_p50"] = (row["router"]["added_ttfb_p50_ms"]
                                                       / max(1e-9, row["proxy"]["added_ttfb_p50_ms"]))
            results[f"concurrency_{concurrency}"] = row
        return results
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--serve-upstream", type=int)
    ap.add_argument("--serve-router", type=int)
    ap.add_argument("--upstream")
    ap.add_argument("--otlp-endpoint", default="", help="with --serve-router: its spans go there")
    ap.add_argument("--sample-ratio", type=float, help="with --otlp-endpoint: head sampling (default: the default)")
    a = ap.parse_args()
    if a.serve_upstream:
        return serve_upstream(a.serve_upstream)
    if a.serve_router:
        return serve_router(a.serve_router, a.upstream, otlp_endpoint=a.otlp_endpoint, sample_ratio=a.sample_ratio)
    results = asyncio.run(run(a.rounds, a.requests))
    for key, row in results.items():
        print(f"{key}:")
        for name in ("direct", "proxy", "router"):
            r = row[name]
            added = (f"  added TTFB p50 {r['added_ttfb_p50_ms']:.2f} ms, total p50 {r['added_total_p50_ms']:.2f} ms"
                     if name != "direct" else "")
            print(f"  {name:7s} TTFB p50 {r['ttfb_p50_ms']:.2f} p99 {r['ttfb_p99_ms']:.2f} ms; "
                  f"total p50 {r['total_p50_ms']:.2f} p99 {r['total_p99_ms']:.2f} ms{added}")
        print(f"  router-added / proxy-added TTFB p50: {row['router_over_proxy_added_ttfb_p50']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
