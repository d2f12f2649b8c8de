"""The guard's CPU a request with tracing on (default sampling, OTLP/HTTP to a sink) and off, in front
of a scripted vLLM, all in one process: what tracing costs the guard, without vLLM's noise.

On a shared 2-core machine the throughput of guard_tracing_overhead.py moves by tens of percent from
round to round with what else runs; CPU is what tracing takes from vLLM on a shared host, and it is
measurable here. Two guards (off, on) before one scripted upstream (64 streamed events a request),
8 clients; rounds alternate off and on, and the process's CPU a round (guard, upstream and client:
all but the guard's tracing the same in both) gives the difference per request, median over rounds.

    python bench/guard_tracing_cpu.py [--rounds 10] [--requests 400]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
for part in ("api", "kit", "engine_image"):
    sys.path.insert(0, str(ROOT / part))

from gpufleet_api.guard import guard_config  # noqa: E402
from gpufleet_api.tracing import DEFAULT_SAMPLE_RATIO  # noqa: E402
from gpufleet_engine.serving.server import GuardServer  # noqa: E402

EVENTS = 64
METRICS = """\
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="4096",num_gpu_blocks_override="None"} 1.0
"""


class Words:
    """One token a word: the guard's tokenizer interface, at no cost worth measuring."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join("w" for _ in ids)

    def chat_ids(self, messages, template_kwargs) -> list[int]:
        return [0] * 4 + [i for m in messages for i in self.encode(m["content"])]


async def upstream() -> tuple[web.AppRunner, str, dict]:
    seen = {"otlp": 0}
    event = b'data: {"choices":[{"index":0,"text":"t"}]}\n\n'

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(EVENTS):
            await resp.write(event)
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def otlp(request: web.Request) -> web.Response:
        await request.read()
        seen["otlp"] += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", lambda r: web.Response(text=METRICS))
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m", "max_model_len": 4096}]}))
    app.router.add_post("/v1/traces", otlp)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", seen


async def guard(url: str, tracing: dict | None) -> GuardServer:
    raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": url, "listenHost": "127.0.0.1",
           "listenPort": 0, "maxContextTokens": 4096, "ttftControl": "Off", "metricsPollSeconds": 0.5,
           **({"tracing": tracing} if tracing else {})}
    server = GuardServer(guard_config.parse(raw), tokenizer=Words())
    await server.start()
    await server.wait_ready(30)
    return server


async def round_cpu(session: aiohttp.ClientSession, url: str, requests: int, clients: int) -> float:
    """Process CPU seconds a request over ``requests`` streamed completions by ``clients`` clients."""
    body = json.dumps({"model": "m", "prompt": "a b c d e f g h", "max_tokens": EVENTS, "stream": True})
    left = requests

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:
                assert r.status == 200, r.status
                await r.read()

    start = time.process_time()
    await asyncio.gather(*(client() for _ in range(clients)))
    return (time.process_time() - start) / requests


async def main_async(args) -> int:
    runner, url, seen = await upstream()
    off = await guard(url, None)
    on = await guard(url, {"endpoint": url, "sampleRatio": args.sample_ratio})
    costs: dict[str, list[float]] = {"off": [], "on": []}
    try:
        async with aiohttp.ClientSession() as session:
            for server in (off, on):
                await round_cpu(session, server.url, 100, args.clients)   # warm-up
            for r in range(args.rounds):
                for name, server in ((("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))):
                    costs[name].append(await round_cpu(session, server.url, args.requests, args.clients))
    finally:
        for server in (off, on):
            await server.stop()
        await runner.cleanup()
    pairs = [1e6 * (a - b) for a, b in zip(costs["on"], costs["off"])]
    print(f"process CPU a request, median of {args.rounds} rounds of {args.requests}: "
          f"off {1e6 * statistics.median(costs['off']):.0f} µs, on {1e6 * statistics.median(costs['on']):.0f} µs")
    print(f"tracing on (sampleRatio {args.sample_ratio}) costs {statistics.median(pairs):+.1f} µs a request "
          f"(paired rounds from {min(pairs):+.1f} to {max(pairs):+.1f}); {seen['otlp']} OTLP exports")
    if args.json:
        args.json.write_text(json.dumps({"off_us": costs["off"], "on_us": costs["on"], "added_us": pairs}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample-ratio", type=float, default=DEFAULT_SAMPLE_RATIO)
    parser.add_argument("--json", type=Path)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
