"""Overhead of tracing in the router: two routers in front of one stand-in guard (router_overhead.py's upstream: 32
events 2 ms apart), one with tracing off and one with tracing on at the default sampling (1% head sampling plus the
tail rule; docs/tracing.md), exporting over OTLP/HTTP to a sink in this process that answers 200 (the trace store's
cost is not the router's). No request is refused or resumed, so the tail rule keeps none: the cost measured is the
hooks on every request and the export of the sampled ones.

- TTFT: one client, the two routers in step (each round sends one request to each, the order alternated), the
  paired difference of time to first byte, its median;
- throughput at saturation: ``--concurrency`` clients on one router at a time for ``--round-seconds``, rounds
  alternating the routers, completed requests per second; the traced router's median over the untraced one's;
  and the router process's CPU per request in those rounds (its user + system time from /proc), the steadier
  figure on a shared machine: a router at saturation is CPU-bound, so its throughput goes as 1 / CPU a request.

Targets (issue 47): at most 0.2 ms added to the median TTFT and under 2% of the throughput (by the requests a second,
or by the CPU a request where the machine's other load swamps the rate). Exit code 0 when both hold.

    python bench/router_tracing_overhead.py [--rounds 6] [--step-rounds 400] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_tracing_overhead import Sink  # noqa: E402
from router_overhead import free_port, one, start  # noqa: E402

HERE = Path(__file__).resolve().parent
PATHS = ("router", "traced")


async def in_step(urls: dict[str, str], rounds: int) -> list[float]:
    """Per round, the traced router's time to first byte less the untraced one's, in ms."""
    diffs = []
    async with aiohttp.ClientSession() as http:
        for _ in range(5):
            for url in urls.values():
                await one(http, url)
        for r in range(rounds):
            got = {}
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                got[path] = (await one(http, urls[path]))[0]
            diffs.append((got["traced"] - got["router"]) * 1e3)
    return diffs


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


async def saturated(url: str, concurrency: int, seconds: float, pid: int) -> tuple[float, float]:
    """(completed requests a second, the router's CPU ms a request) with ``concurrency`` clients for ``seconds``."""
    done = 0
    cpu = cpu_seconds(pid)
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await one(http, url)
                done += 1
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - started), 1e3 * (cpu_seconds(pid) - cpu) / max(1, done)


async def run(args, sink: Sink) -> dict:
    ports = {"upstream": free_port(), "router": free_port(), "traced": free_port()}
    upstream = f"127.0.0.1:{ports['upstream']}"
    here = str(HERE / "router_overhead.py")
    procs = [start([here, "--serve-upstream", str(ports["upstream"])], ports["upstream"]),
             start([here, "--serve-router", str(ports["router"]), "--upstream", upstream], ports["router"]),
             start([here, "--serve-router", str(ports["traced"]), "--upstream", upstream,
                    "--otlp-endpoint", sink.endpoint], ports["traced"])]
    urls = {p: f"http://127.0.0.1:{ports[p]}" for p in PATHS}
    try:
        await asyncio.sleep(1.5)  # the routers' first guard reading
        diffs = await in_step(urls, args.step_rounds)
        rates: dict[str, list[float]] = {p: [] for p in PATHS}
        cpu: dict[str, list[float]] = {p: [] for p in PATHS}
        pids = {"router": procs[1].pid, "traced": procs[2].pid}
        for r in range(args.rounds):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                rate, per_request = await saturated(urls[path], args.concurrency, args.round_seconds, pids[path])
                rates[path].append(rate)
                cpu[path].append(per_request)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    ratios = [t / u for t, u in zip(rates["traced"], rates["router"])]
    cpu_ratios = [t / u for t, u in zip(cpu["traced"], cpu["router"])]
    return {"cpu_ms_per_request": {p: statistics.median(v) for p, v in cpu.items()},
            "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
            "ttft_added_p50_ms": statistics.median(diffs), "ttft_rounds": len(diffs),
            "throughput_rps": {p: statistics.median(v) for p, v in rates.items()},
            "throughput_ratio_median": statistics.median(ratios), "throughput_ratios": ratios,
            "otlp_exports": sink.requests, "otlp_bytes": sink.bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-rounds", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    sink = Sink()
    result = asyncio.run(run(args, sink))
    cost = 1 - result["throughput_ratio_median"]
    print(f"TTFT added by tracing, median of {result['ttft_rounds']} paired rounds: "
          f"{result['ttft_added_p50_ms']:+.3f} ms (target <= 0.2 ms)")
    print(f"throughput at {args.concurrency} clients: untraced {result['throughput_rps']['router']:.0f}/s, traced "
          f"{result['throughput_rps']['traced']:.0f}/s; cost {100 * cost:+.2f}% (median of paired rounds; "
          f"target < 2%)")
    cpu_cost = result["cpu_ratio_median"] - 1
    print(f"router CPU a request at saturation: untraced {result['cpu_ms_per_request']['router']:.3f} ms, traced "
          f"{result['cpu_ms_per_request']['traced']:.3f} ms; {100 * cpu_cost:+.2f}% (median of paired rounds)")
    print(f"OTLP exports: {result['otlp_exports']} ({result['otlp_bytes']} bytes)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["ttft_added_p50_ms"] <= 0.2 and min(cost, cpu_cost) < 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())
