"""What tenants cost on the router's path: the same router with and without a tenancy, in the same run.

One upstream stands in for a fast guard (its /metrics ledger; completions streamed as 8 server-sent events
with vLLM's continuous usage, no gaps), and two routers in front of it, each a process of its own (as is
the client):

- ``plain``: the router of a namespace without tenants;
- ``tenants``: the same router whose namespace declares one tenant (identity Keys, 10 key records in its
  Secret, every one hashed per request; all three limits declared, high enough never to refuse): the key
  checked, the limiter charged at admission and settled from the stream's usage at its end, the usage
  counted, the tenant's headers set.

Rounds alternate the paths so background load hits both alike. Reported: time to first byte p50 at one
stream at a time (the tenancy's added TTFT; target <= 0.2 ms) and throughput at 16 streams at once (its
loss; target < 2%), as ratios.

    python bench/router_tenancy_overhead.py [--rounds 5] [--requests 300] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_overhead as overhead  # noqa: E402
from router_overhead import METRICS, free_port, pct, start  # noqa: E402

EVENTS = 8
PROMPT = "fleet " * 200
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": EVENTS, "stream": True}
RECORDS = 10
KEY_SEED = 7   # the client's key: the last of the tenant's records


def event(n: int, text: str | None) -> bytes:
    chunk: dict = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "tiny",
                   "choices": [] if text is None else [{"index": 0, "text": text, "finish_reason": None}],
                   "usage": {"prompt_tokens": 200, "completion_tokens": n, "total_tokens": 200 + n}}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def serve_upstream(port: int) -> None:
    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(EVENTS):
            await resp.write(event(i + 1, " token"))
        await resp.write(event(EVENTS, None) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def client_key() -> str:
    from gpufleet_api.tenants import keys
    return keys.new_key(bytes([KEY_SEED]) * keys.KEY_BYTES)


def serve_router(port: int, upstream: str, tenants: bool) -> None:
    """router_overhead.py's router, with the bench tenancy or without."""
    overhead.serve_router(port, upstream, tenancy_objects() if tenants else None)


def tenancy_objects() -> tuple[list[dict], list[dict]]:
    """One tenant, identity Keys, its Secret holding RECORDS key records (the client's the last one)."""
    from gpufleet_api import API_VERSION
    from gpufleet_api.tenants import keys, usage
    presented = [keys.new_key(bytes([100 + i]) * keys.KEY_BYTES) for i in range(RECORDS - 1)] + [client_key()]
    records = "\n".join(keys.record(k, bytes([i + 1]) * keys.SALT_BYTES) for i, k in enumerate(presented))
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": "bench-keys", "namespace": "bench", "labels": {usage.KEYS_SECRET_LABEL: "true"}},
              "data": {"keys": base64.b64encode(records.encode()).decode()}}
    declaration = {"apiVersion": API_VERSION, "kind": usage.TENANTS_KIND,
                   "metadata": {"name": usage.TENANTS_NAME, "namespace": "bench"},
                   "spec": {"identity": "Keys", "tenants": [{
                       "name": "bench", "weight": 2, "keys": {"name": "bench-keys", "key": "keys"},
                       "limits": {"requestsPerSecond": 1_000_000, "tokensPerMinute": 1_000_000_000,
                                  "concurrentRequests": 1_000_000}}]}}
    return [declaration], [secret]


async def one(http: aiohttp.ClientSession, url: str, headers: dict) -> float:
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", json=BODY, headers=headers) as r:
        assert r.status == 200, r.status
        first = None
        async for _chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - started
    return first or 0.0


async def measure(url: str, requests: int, concurrency: int, headers: dict) -> tuple[list[float], float]:
    """(each request's time to first byte, requests per second over the batch)."""
    out: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(3):  # warm the connection pools
            await one(http, url, headers)
        remaining = iter(range(requests))

        async def worker() -> None:
            for _ in remaining:
                out.append(await one(http, url, headers))
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out, requests / (time.perf_counter() - started)


def gate_cost_us(n: int = 20000) -> float:
    """The tenancy's own work per request in this process, in microseconds: the key checked against every
    record, the limits charged and settled, the guard's headers built (the loaded machine's noise left out)."""
    from gpufleet_router.policy import tenancy
    built = tenancy.build(*tenancy_objects(), {}, time.monotonic())
    t = built.namespaces["bench"]
    assert isinstance(t, tenancy.Tenancy)
    client = {"Authorization": f"Bearer {client_key()}", "Content-Type": "application/json", "Accept": "*/*"}
    started = time.perf_counter()
    for _ in range(n):
        who = t.identify(client)
        ticket = t.limiter.admit(who.tenant, 250, time.monotonic())   # type: ignore[union-attr]
        headers = {k: v for k, v in client.items() if k.lower() not in t.dropped_headers}
        headers["x-gpufleet-tenant"], headers["x-gpufleet-tenant-weight"] = "bench", t.weights["bench"]
        t.limiter.finish(ticket, 208, time.monotonic())   # type: ignore[arg-type]
    return (time.perf_counter() - started) / n * 1e6


async def run(rounds: int, requests: int) -> dict:
    gate_cost = gate_cost_us()   # before the other processes start
    ports = {"upstream": free_port(), "plain": free_port(), "tenants": free_port()}
    upstream = f"127.0.0.1:{ports['upstream']}"
    procs = [start([__file__, "--serve-upstream", str(ports["upstream"])], ports["upstream"]),
             start([__file__, "--serve-router", str(ports["plain"]), "--upstream", upstream], ports["plain"]),
             start([__file__, "--serve-router", str(ports["tenants"]), "--upstream", upstream, "--tenants"],
                   ports["tenants"])]
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("plain", "tenants")}
    headers = {"Authorization": f"Bearer {client_key()}"}
    try:
        await asyncio.sleep(1.5)  # the routers' first guard reading
        ttfb: dict[str, list[float]] = {k: [] for k in urls}
        rps: dict[str, list[float]] = {k: [] for k in urls}
        for i in range(rounds):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for name in order:
                ttfb[name] += (await measure(urls[name], requests, 1, headers))[0]
            for name in order:
                rps[name].append((await measure(urls[name], requests, 16, headers))[1])
        row: dict = {name: {"ttfb_p50_ms": pct(ttfb[name], 0.5) * 1e3, "ttfb_p99_ms": pct(ttfb[name], 0.99) * 1e3,
                            "throughput_rps": sorted(rps[name])[len(rps[name]) // 2]} for name in urls}
        row["added_ttfb_p50_ms"] = row["tenants"]["ttfb_p50_ms"] - row["plain"]["ttfb_p50_ms"]
        row["ttfb_p50_ratio"] = row["tenants"]["ttfb_p50_ms"] / row["plain"]["ttfb_p50_ms"]
        row["throughput_ratio"] = row["tenants"]["throughput_rps"] / row["plain"]["throughput_rps"]
        row["throughput_loss_percent"] = (1 - row["throughput_ratio"]) * 100
        row["gate_cost_us"] = gate_cost
        return row
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--serve-upstream", type=int)
    ap.add_argument("--serve-router", type=int)
    ap.add_argument("--upstream")
    ap.add_argument("--tenants", action="store_true")
    a = ap.parse_args()
    if a.serve_upstream:
        return serve_upstream(a.serve_upstream)
    if a.serve_router:
        return serve_router(a.serve_router, a.upstream, a.tenants)
    row = asyncio.run(run(a.rounds, a.requests))
    for name in ("plain", "tenants"):
        r = row[name]
        print(f"{name:8s} TTFB p50 {r['ttfb_p50_ms']:.3f} p99 {r['ttfb_p99_ms']:.3f} ms (1 stream); "
              f"{r['throughput_rps']:.0f} requests/s (16 streams, the median round)")
    print(f"added TTFB p50: {row['added_ttfb_p50_ms']:.3f} ms (target <= 0.2), ratio {row['ttfb_p50_ratio']:.3f}")
    print(f"throughput tenants/plain: {row['throughput_ratio']:.3f}, loss {row['throughput_loss_percent']:.1f}% "
          f"(target < 2%)")
    print(f"the tenancy's own work per request, in process: {row['gate_cost_us']:.1f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
