"""Overload: 128 streaming clients against a 64-block KV pool, with and without the guard.

Every figure is compared with a baseline measured in the same run, guarded
and unguarded runs alternating on one vLLM:

1. vLLM alone: concurrency 1 (the TTFT reference), 8 and 128 (saturated
   throughput; at 128 also the overload without shedding: preemptions, queueing),
   and 6, the most requests the 64-block pool holds at full budget;
2. the guard in front of the same vLLM: concurrency 1 and 128;
3. vLLM's own shedding, ``--max-num-queued-reqs`` (503), at 128, on a fresh vLLM.

Targets (docs/benchmarks.md, section Guard): at 128 clients the guard's
admitted TTFT p99 ≤ 5× the concurrency-1 p99, preemptions ≤ 1% of admitted
requests, goodput ≥ 90% of the unguarded saturated throughput, no 5xx, every
429 with Retry-After, and better TTFT p99 and preemptions than vLLM's own
shedding. Exit code 0 when every target holds.

vLLM runs on its own core (``--engine-cores 1``, the default, as in the
other guard benchmarks; ``--engine-cores ''`` shares every core), as the
engine and guard containers of a pod have CPU of their own.

    python bench/guard_overload.py [--duration 40] [--engine-cores 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_common import Stack, closed_loop, table  # noqa: E402

KV_BLOCKS = 64
PROMPT, OUTPUT, BLOCK = 256, 64, 32
# The most requests the pool holds at their full budget (vLLM keeps one block
# back): what any admission that never causes a preemption can run at once.
FITS = (KV_BLOCKS - 1) // -(-(PROMPT + OUTPUT) // BLOCK)


async def measure(duration: float, queued_limit: int, watermark: int, engine_cores: str | None) -> dict:
    runs = {}
    stack = Stack(KV_BLOCKS, engine_cores=engine_cores, kvWatermarkPercent=watermark)
    try:
        stack.start_vllm()
        stack.start_guard()  # idle (a metrics read per 0.5 s) while vLLM runs alone
        # Warm-up: first requests pay one-off costs (allocations, caches).
        await closed_loop("warm-up", stack.guard_url, stack.vllm_url, 4, requests=8, seed=99)
        # Guarded and unguarded runs alternate so drift on a shared machine hits both.
        runs["vllm_c1"] = await closed_loop("vLLM, 1 client", stack.vllm_url, stack.vllm_url, 1,
                                            requests=40, seed=1)
        runs["guard_c1"] = await closed_loop("guard, 1 client", stack.guard_url, stack.vllm_url, 1,
                                             requests=40, seed=4)
        # As long as the overload runs: the saturated throughput is the goodput reference.
        runs["vllm_c8"] = await closed_loop("vLLM, 8 clients", stack.vllm_url, stack.vllm_url, 8,
                                            duration=duration, seed=2)
        runs["vllm_fits"] = await closed_loop(f"vLLM, {FITS} clients (all fit at full budget)", stack.vllm_url,
                                              stack.vllm_url, FITS, duration=duration, seed=7)
        runs["guard_c128"] = await closed_loop("guard, 128 clients", stack.guard_url, stack.vllm_url, 128,
                                               duration=duration, seed=5)
        runs["vllm_c128"] = await closed_loop("vLLM, 128 clients", stack.vllm_url, stack.vllm_url, 128,
                                              duration=duration, seed=3)
    finally:
        stack.stop()
    shedding = Stack(KV_BLOCKS, engine_extra_args=["--max-num-queued-reqs", str(queued_limit)],
                     engine_cores=engine_cores)
    try:
        shedding.start_vllm()
        await closed_loop("warm-up", shedding.vllm_url, shedding.vllm_url, 4, requests=8, seed=98)
        runs["vllm_queued_c128"] = await closed_loop(
            f"vLLM --max-num-queued-reqs {queued_limit}, 128 clients", shedding.vllm_url, shedding.vllm_url,
            128, duration=duration, seed=6)
    finally:
        shedding.stop()
    return runs


def verdict(runs: dict) -> list[tuple[str, str, bool]]:
    c1 = runs["vllm_c1"].ttft(0.99)
    g = runs["guard_c128"]
    v = runs["vllm_queued_c128"]
    # vLLM alone saturates from 8 clients on; the better of its 8- and 128-client runs is the reference.
    saturated = max(runs["vllm_c8"].goodput, runs["vllm_c128"].goodput)
    admitted = len(g.ok)
    shed = g.count(lambda a: a.status == 429)
    return [
        ("admitted TTFT p99 ≤ 5× concurrency-1 p99 (vLLM alone)",
         f"{1000 * g.ttft(0.99):.0f} ms vs {1000 * c1:.0f} ms = {g.ttft(0.99) / c1:.2f}×", g.ttft(0.99) <= 5 * c1),
        ("preemptions ≤ 1% of admitted requests",
         f"{g.preemptions:.0f} / {admitted} = {100 * g.preemptions / max(1, admitted):.1f}%",
         g.preemptions <= 0.01 * admitted),
        ("goodput ≥ 90% of unguarded saturated throughput (best of 8 and 128 clients)",
         f"{g.goodput:.0f} vs {saturated:.0f} tok/s = {100 * g.goodput / saturated:.0f}%",
         g.goodput >= 0.9 * saturated),
        # The 90% target above cannot be met by any admission that also keeps
        # preemptions at zero when vLLM's saturated figure comes from running
        # more requests than the pool holds (it recomputes the preempted ones);
        # this is the same ratio against what fits (docs/benchmarks.md).
        (f"goodput ≥ 90% of vLLM alone at {FITS} clients (the most that fit without preemption)",
         f"{g.goodput:.0f} vs {runs['vllm_fits'].goodput:.0f} tok/s = "
         f"{100 * g.goodput / runs['vllm_fits'].goodput:.0f}%", g.goodput >= 0.9 * runs["vllm_fits"].goodput),
        ("no 5xx", f"{g.count(lambda a: a.status >= 500)}", g.count(lambda a: a.status >= 500) == 0),
        ("every 429 carries Retry-After", f"{g.count(lambda a: a.status == 429 and a.retry_after)}/{shed}",
         g.count(lambda a: a.status == 429 and not a.retry_after) == 0),
        ("beats --max-num-queued-reqs on admitted TTFT p99",
         f"{1000 * g.ttft(0.99):.0f} vs {1000 * v.ttft(0.99):.0f} ms", g.ttft(0.99) < v.ttft(0.99)),
        ("beats --max-num-queued-reqs on preemptions",
         f"{g.preemptions:.0f} vs {v.preemptions:.0f}", g.preemptions < v.preemptions or
         (g.preemptions == 0 and v.preemptions == 0)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per overload run")
    parser.add_argument("--queued-limit", type=int, default=8,
                        help="--max-num-queued-reqs for vLLM's own shedding (default: 8, the saturating load)")
    parser.add_argument("--watermark", type=int, default=5,
                        help="the guard's kvWatermarkPercent (default 5, the product default)")
    parser.add_argument("--engine-cores", default="1",
                        help="bind vLLM to these cores and the guard and the load generator to the rest, as the "
                             "engine and guard containers of a pod would be ('' shares every core)")
    parser.add_argument("--json", type=Path, help="write the raw summaries here")
    args = parser.parse_args()
    runs = asyncio.run(measure(args.duration, args.queued_limit, args.watermark, args.engine_cores or None))
    rows = [r.summary() for r in runs.values()]
    print(table(rows))
    print()
    checks = verdict(runs)
    for name, value, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "checks": [
            {"target": n, "measured": v, "pass": ok} for n, v, ok in checks]}, indent=2))
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
