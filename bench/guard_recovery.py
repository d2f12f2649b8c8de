"""Recovery: a surge that engages the TTFT control, a lull, then a burst that fits the pool.

What a new user met right after the demo (issue 28): a replica that had been
through an overload refused nearly all of a later burst with ``ttft_limit``
while its KV pool sat empty. vLLM's benchmark client does not retry a 429, so
every refusal is a failed request.

One vLLM (64 KV blocks, the tiny model) and two guards in front of it:

1. the baseline: a fresh guard takes the burst;
2. the subject: another guard first takes a surge of streaming clients that
   honour Retry-After (more than the pool holds: the watermark and the TTFT
   control both refuse), then nothing for ``--lull`` seconds, then the same
   burst.

The burst comes from vLLM's own benchmark client (``vllm bench serve``:
openai-chat, ``--burst`` random prompts of 128 tokens with 64-token answers,
max concurrency 8, request rate inf), which does not retry: a 429 is a failed
request. 8 such requests fit the pool together. Target: the subject serves
≥ 99% of the burst, and the baseline does too. Exit code 0 when both hold.

    python bench/guard_recovery.py [--surge 60] [--lull 30] [--burst 80] [--objective 0.08] [--engine-cores 1]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_common import Stack, closed_loop, metrics_text, refusals, table, vllm_bench_serve  # noqa: E402

from gpufleet_api.guard.guard_metrics import KV_FREE_BLOCKS, KV_TOTAL_BLOCKS  # noqa: E402

KV_BLOCKS = 64
SURGE_CLIENTS, SURGE_PROMPT, SURGE_OUTPUT = 12, 256, 128   # 12 × 12 blocks: twice the pool
BURST_CONCURRENCY, BURST_PROMPT, BURST_OUTPUT = 8, 128, 64  # 8 × 6 blocks: fits the pool


async def burst(url: str, requests: int, seed: int) -> dict:
    """vLLM's benchmark client: ``requests`` chat requests at ``BURST_CONCURRENCY``, none retried."""
    result = await vllm_bench_serve(url, prompts=requests, concurrency=BURST_CONCURRENCY,
                                    input_len=BURST_PROMPT, output_len=BURST_OUTPUT, seed=seed)
    return {k: result.get(k) for k in ("completed", "failed", "request_throughput", "output_throughput",
                                       "median_ttft_ms", "p99_ttft_ms")}


async def pool_free(url: str) -> None:
    """Until the guard's last read of vLLM shows its pool empty (the warm-up went to vLLM directly,
    past the guard, so only a fresh read tells the guard its blocks are free again)."""
    while True:
        free = total = None
        for line in (await metrics_text(url)).splitlines():
            if line.startswith(KV_FREE_BLOCKS):
                free = float(line.rsplit(" ", 1)[1])
            elif line.startswith(KV_TOTAL_BLOCKS):
                total = float(line.rsplit(" ", 1)[1])
        if free is not None and free == total:
            return
        await asyncio.sleep(0.1)  # the guard reads vLLM every 0.5 s


async def measure(surge: float, lull: float, requests: int, engine_cores: str | None,
                  objective: float) -> dict:
    runs: dict = {}
    # The tiny model answers in tens of ms; an objective near its surge TTFT engages the control.
    slo = {"ttftP99Seconds": objective, "itlP99Seconds": 0.1, "requestP99Seconds": 60.0}
    stack = Stack(KV_BLOCKS, engine_cores=engine_cores, slo=slo)
    try:
        stack.start_vllm()
        fresh = stack.start_guard("fresh")
        subject = stack.start_guard()
        await closed_loop("warm-up", stack.vllm_url, stack.vllm_url, 4, requests=8, seed=99)
        await pool_free(fresh)
        runs["baseline"] = await burst(fresh, requests, seed=1)
        fresh_refusals = await refusals(fresh)
        runs["surge"] = await closed_loop("subject: surge", subject, stack.vllm_url, SURGE_CLIENTS,
                                          duration=surge, prompt_tokens=SURGE_PROMPT,
                                          output_tokens=SURGE_OUTPUT, seed=2)
        during = await refusals(subject)
        await asyncio.sleep(lull)  # the condition under test: no traffic at all
        runs["after"] = await burst(subject, requests, seed=1)
        after = await refusals(subject)
        runs["refusals"] = {"fresh": fresh_refusals, "surge": during,
                            "burst": {k: v - during.get(k, 0.0) for k, v in after.items()}}
        return runs
    finally:
        stack.stop()


def verdict(runs: dict, requests: int) -> list[tuple[str, str, bool]]:
    base, after = runs["baseline"], runs["after"]
    surge_ttft = runs["refusals"]["surge"].get("ttft_limit", 0.0)
    return [
        ("the surge engaged the TTFT control", f"{surge_ttft:.0f} ttft_limit refusals", surge_ttft > 0),
        ("baseline: a fresh guard serves ≥ 99% of the burst", f"{base['completed']}/{requests}",
         base["completed"] >= 0.99 * requests),
        ("after the surge and the lull: ≥ 99% of the burst served",
         f"{after['completed']}/{requests} ({100 * after['completed'] / requests:.1f}%; fresh guard "
         f"{100 * base['completed'] / requests:.1f}%)", after["completed"] >= 0.99 * requests),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--surge", type=float, default=60.0, help="seconds of surge")
    parser.add_argument("--lull", type=float, default=30.0, help="seconds with no traffic after it")
    parser.add_argument("--burst", type=int, default=80, help="requests in the burst")
    parser.add_argument("--engine-cores", default="1",
                        help="bind vLLM to these cores, the guards and the clients to the rest ('' shares all)")
    parser.add_argument("--objective", type=float, default=0.08,
                        help="slo.ttftP99Seconds of both guards (default 0.08: the surge engages the control)")
    parser.add_argument("--json", type=Path, help="write the raw summaries here")
    args = parser.parse_args()
    runs = asyncio.run(measure(args.surge, args.lull, args.burst, args.engine_cores or None, args.objective))
    print(table([runs["surge"].summary()]))
    print(table([{"burst (vllm bench serve)": k, **runs[k]} for k in ("baseline", "after")]))
    print("\nrefusals by reason:", json.dumps(runs["refusals"]))
    checks = verdict(runs, args.burst)
    for name, value, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"surge": runs["surge"].summary(), "baseline": runs["baseline"],
                                         "after": runs["after"], "refusals": runs["refusals"], "checks": [
            {"target": n, "measured": v, "pass": ok} for n, v, ok in checks]}, indent=2))
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
