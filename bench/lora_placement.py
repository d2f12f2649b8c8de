"""LoRA adapters placed by traffic against round robin over the same replicas.

    .venv/bin/python bench/lora_placement.py [--json reports/lora_placement.json]   # ~10 min

Eight real PEFT LoRA adapters (tests/support/lora_adapters.py: rank 8 on q/k/v/o of the tiny model) on two
vLLM-CPU replicas behind their guards, one core each, each replica with 2 adapter slots per batch
(``maxLoras`` 2) and vLLM's CPU-side adapter cache of 4 (``maxCpuLoras`` 4). Requests pick their adapter from a
Zipf distribution (s = 1: the hottest adapter gets 37% of the traffic, the coldest 5%). One trace per round,
the same in both arms (adapters, prompts, answer lengths, arrival times; open loop, streaming, answers run to
their length with ``ignore_eos``):

- (a) round robin: every adapter loaded on both replicas (``PUT /adapters``), ``vllm-router --policy
  round_robin`` in front of the two guards: what a fleet without placement does;
- (b) gpufleet: the operator's placement (``gpufleet.adapters.placement.place``) from the per-adapter request
  rates the guards counted during a warm-up trace (``gpufleet_guard_adapter_requests_total``, the signal the
  operator reads), pushed to the guards with ``PUT /adapters`` as the operator does, and gpufleet's router
  sending each adapter's requests to the replicas that hold it.

The arms alternate order over ``--rounds`` rounds on the same engines. Counted inside vLLM (the gpufleet plugin,
``gpufleet_guard_adapter_*_total``): loads (an adapter read from disk into the CPU cache), evictions (dropped
from it) and activations (moved into a GPU slot), per minute of the arm's trace; plus TTFT p50/p99, ITL p99,
goodput (requests per second with TTFT and their own ITL p99 inside the objectives) and errors.

What this machine can and cannot show: a load here reads 35 KB of safetensors from the page cache, so it costs
little time on the tiny model; on a GPU a real adapter is tens to hundreds of MB read from disk or the network,
and a load stalls the batch that waits for it. The count of loads is the portable result; the TTFT columns say
only that placement does not make latency worse on this machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.adapters.placement import place
from gpufleet_api.guard import guard_metrics as gm
from gpufleet_api.guard.adapters import ADAPTERS_PATH
from gpufleet_engine.local.runner import LocalEngine
from gpufleet_router.policy.adapters import Adapter, Catalog
from gpufleet_router.policy.table import Route

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from pd_disaggregation import Request, Result, pct, replica, run_trace  # noqa: E402
from vllm_router_process import ROUTER, VllmRouterProcess  # noqa: E402

from tests.support.lora_adapters import make_adapters  # noqa: E402
from tests.support.router import static_router  # noqa: E402
from tests.support.token_issuer import Issuer  # noqa: E402

OPERATOR = Issuer()  # the guards' /adapters take the operator's token only

MODEL = "tiny"
BLOCK_SIZE = 32
KV_BLOCKS = 160
MAX_MODEL_LEN = 1024
ADAPTERS = 8
MAX_LORAS = 2
CPU_CACHE = 4
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()
COUNTERS = {gm.ADAPTER_LOADS + "_total": "loads", gm.ADAPTER_EVICTIONS + "_total": "evictions",
            gm.ADAPTER_ACTIVATIONS + "_total": "activations", gm.ADAPTER_REQUESTS + "_total": "requests"}
ARMS = ("a round robin, every adapter everywhere, vllm-router", "b gpufleet placement + router")


def zipf_weights(names: list[str], s: float = 1.0) -> list[float]:
    return [1.0 / (k ** s) for k in range(1, len(names) + 1)]


def trace(seed: int, names: list[str], requests: int, rate: float, words: int = 60,
          answer: int = 24) -> list[Request]:
    rng = random.Random(seed)
    weights = zipf_weights(names)
    out, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        adapter = rng.choices(names, weights)[0]
        text = f"Ticket {seed}-{i}. " + " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(Request(at, text, answer, kind=adapter, model=adapter))
    return out


async def counters(engines: list[LocalEngine]) -> dict[str, dict[str, float]]:
    """Per counter kind, per adapter: the sum over the replicas."""
    got: dict[str, dict[str, float]] = {kind: {} for kind in COUNTERS.values()}
    async with aiohttp.ClientSession() as http:
        for e in engines:
            async with http.get(f"{e.guard_url}/metrics") as r:
                text = await r.text()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    kind = COUNTERS.get(s.name)
                    if kind:
                        adapter = s.labels.get("adapter", "")
                        got[kind][adapter] = got[kind].get(adapter, 0.0) + s.value
    return got


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {kind: {a: v - before[kind].get(a, 0.0) for a, v in per.items()} for kind, per in after.items()}


async def hold(engines: list[LocalEngine], sets: list[list[str]], paths: dict[str, Path],
               timeout: float = 120) -> None:
    """Tell each replica its adapters, as the operator does, and wait until its guard reports them Loaded."""
    async with aiohttp.ClientSession() as http:
        for e, names in zip(engines, sets):
            body = {"adapters": [{"name": n, "source": {"path": str(paths[n])}} for n in names]}
            async with http.put(f"{e.guard_url}{ADAPTERS_PATH}", json=body, headers=OPERATOR.bearer()) as r:
                assert r.status in (200, 202), await r.text()
        deadline = time.monotonic() + timeout
        for e, names in zip(engines, sets):
            while True:
                async with http.get(f"{e.guard_url}{ADAPTERS_PATH}", headers=OPERATOR.bearer()) as r:
                    report = await r.json()
                states = {a["name"]: a["state"] for a in report["adapters"]}
                if all(states.get(n) == "Loaded" for n in names) and set(states) == set(names):
                    break
                failed = {n: s for n, s in states.items() if s == "Failed"}
                assert not failed, report
                assert time.monotonic() < deadline, f"adapters not loaded on {e.guard_url}: {report}"
                await asyncio.sleep(0.2)


async def start(engines: list[LocalEngine]) -> None:
    for e in engines:
        e.work_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
    async with aiohttp.ClientSession() as http:
        for e in engines:
            async with http.post(f"{e.guard_url}/v1/completions", json={
                    "model": MODEL, "prompt": "Warm up.", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()


def summary(results: list[Result], wall: float, counted: dict[str, dict[str, float]], ttft_slo: float,
            itl_slo: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    good = sum(1 for r in ok if r.ttft is not None and r.ttft <= ttft_slo
               and (not r.gaps or pct(r.gaps, 0.99) <= itl_slo))
    minutes = wall / 60
    out = {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
           "first_errors": [r.error for r in results if r.error][:3],
           "ttft_p50_ms": pct(ttfts, 0.5) * 1000, "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
           "itl_p99_ms": pct(gaps, 0.99) * 1000, "goodput_rps": good / wall if wall else 0.0, "good": good,
           "wall_s": wall}
    for kind in ("loads", "evictions", "activations"):
        total = sum(counted[kind].values())
        out[kind] = total
        out[f"{kind}_per_min"] = total / minutes if minutes else 0.0
    return out


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = {n: p for n, p in make_adapters(ADAPTERS, prefix="bench").items()}
    names = sorted(paths, key=lambda n: int(n.rsplit("-", 1)[1]))  # Zipf rank = the adapter's number
    slo = (args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
    lora = {"maxLoras": MAX_LORAS, "maxCpuLoras": CPU_CACHE, "maxLoraRank": 8, "maxAdapters": ADAPTERS}
    engines = [LocalEngine(MODEL, host="127.0.0.1", cpu_cores=str(i), work_dir=work / f"replica-{i}",
                           kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                           guard={"ttftControl": "Off", "engine": {"lora": lora},
                                  "controlAuth": OPERATOR.control_auth()}) for i in range(2)]
    replicas = [f"replica-{i}" for i in range(2)]
    runs: dict[str, list[tuple[list[Result], float, dict]]] = {arm: [] for arm in ARMS}
    placements: list[dict[str, list[str]]] = []
    try:
        await start(engines)
        route = Route("local", MODEL, MODEL, BLOCK_SIZE, 2, 2,
                      replicas=tuple(replica(r, e) for r, e in zip(replicas, engines)))
        catalog = Catalog({n: Adapter(n, "local", MODEL, MODEL, str(paths[n])) for n in names})

        # The operator's view before any traffic: every adapter counts the same.
        placed = place({n: 0.0 for n in names}, replicas, capacity=CPU_CACHE, limit=ADAPTERS)
        await hold(engines, [placed.adapters_on(r) for r in replicas], paths)
        before = await counters(engines)
        async with static_router(route, adapters=catalog) as (url, _):
            warm, _ = await run_trace(url, trace(args.seed - 1, names, args.warmup, args.rate))
        assert all(r.error is None for r in warm), [r.error for r in warm if r.error][:3]
        seen = delta(await counters(engines), before)["requests"]
        rates = {n: seen.get(n, 0.0) for n in names}
        placed = place(rates, replicas, capacity=CPU_CACHE, limit=ADAPTERS, current=placed.holders)
        placements.append(placed.holders)
        print(f"placement from the warm-up's counts {rates}: {placed.holders}", flush=True)

        for round_ in range(args.rounds):
            requests = trace(args.seed + round_, names, args.requests, args.rate)
            for arm in (ARMS if round_ % 2 == 0 else ARMS[::-1]):
                if arm == ARMS[0]:
                    await hold(engines, [names, names], paths)
                    before = await counters(engines)
                    vr = VllmRouterProcess(["--policy", "round_robin", "--worker-urls",
                                            *(e.guard_url for e in engines)], work / f"vllm-router-{round_}.log")
                    try:
                        await vr.wait_healthy()
                        results, wall = await run_trace(vr.url, requests)
                    finally:
                        vr.stop()
                else:
                    await hold(engines, [placed.adapters_on(r) for r in replicas], paths)
                    before = await counters(engines)
                    async with static_router(route, adapters=catalog) as (url, _):
                        results, wall = await run_trace(url, requests)
                counted = delta(await counters(engines), before)
                runs[arm].append((results, wall, counted))
                s = summary(results, wall, counted, *slo)
                print(f"round {round_ + 1} {arm}: loads {s['loads']:.0f} ({s['loads_per_min']:.1f}/min), evictions "
                      f"{s['evictions']:.0f}, activations {s['activations']:.0f}, TTFT p50 {s['ttft_p50_ms']:.0f} ms "
                      f"p99 {s['ttft_p99_ms']:.0f} ms, goodput {s['goodput_rps']:.2f}/s, errors {s['errors']}"
                      + (f" {s['first_errors']}" if s["errors"] else ""), flush=True)
    finally:
        await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines))
        shutil.rmtree(work, ignore_errors=True)

    report: dict = {"requests": args.requests, "rate": args.rate, "rounds": args.rounds, "warmup": args.warmup,
                    "adapters": ADAPTERS, "max_loras": MAX_LORAS, "cpu_cache": CPU_CACHE,
                    "ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms, "placement": placements[0],
                    "results": {}}
    for arm, rs in runs.items():
        results = [r for run_ in rs for r in run_[0]]
        counted: dict[str, dict[str, float]] = {}
        for _, _, c in rs:
            for kind, per in c.items():
                for a, v in per.items():
                    counted.setdefault(kind, {})[a] = counted.get(kind, {}).get(a, 0.0) + v
        for kind in ("loads", "evictions", "activations"):
            counted.setdefault(kind, {})
        report["results"][arm] = summary(results, sum(w for _, w, _ in rs), counted, *slo)
    a, b = (report["results"][arm] for arm in ARMS)
    report["ratios"] = {
        "b/a loads per minute": b["loads_per_min"] / a["loads_per_min"] if a["loads_per_min"] else float("inf"),
        "b/a evictions per minute": (b["evictions_per_min"] / a["evictions_per_min"]
                                     if a["evictions_per_min"] else float("inf")),
        "b/a activations per minute": (b["activations_per_min"] / a["activations_per_min"]
                                       if a["activations_per_min"] else float("inf")),
        "b/a ttft_p99": b["ttft_p99_ms"] / a["ttft_p99_ms"],
        "b/a goodput": b["goodput_rps"] / a["goodput_rps"] if a["goodput_rps"] else float("inf"),
    }
    report["targets"] = {
        "(b) at most a quarter of (a)'s loads": report["ratios"]["b/a loads per minute"] <= 0.25,
        "(b) TTFT p99 no worse than (a)'s (within 10%)": report["ratios"]["b/a ttft_p99"] <= 1.10,
        "no errors": a["errors"] == 0 and b["errors"] == 0,
    }
    return report


def table(report: dict) -> str:
    lines = [f"{report['rounds']} rounds of {report['requests']} streaming completions at {report['rate']}/s "
             f"(Poisson) over {report['adapters']} LoRA adapters (Zipf, s=1) on 2 replicas with "
             f"{report['max_loras']} adapter slots and a CPU cache of {report['cpu_cache']} each; goodput: "
             f"requests per second with TTFT ≤ {report['ttft_slo_ms']} ms and their own ITL p99 ≤ "
             f"{report['itl_slo_ms']} ms. Placement: {report['placement']}.", "",
             "| arm | loads/min | evictions/min | activations/min | TTFT p50 | TTFT p99 | ITL p99 | goodput | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in report["results"].items():
        lines.append(f"| {arm} | {r['loads_per_min']:.1f} ({r['loads']:.0f}) | {r['evictions_per_min']:.1f} | "
                     f"{r['activations_per_min']:.1f} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
                     f"{r['itl_p99_ms']:.1f} ms | {r['goodput_rps']:.2f}/s ({r['good']}/{r['requests']}) | "
                     f"{r['errors']} |")
    lines.append("")
    lines += [f"- {name}: {value:.2f}" for name, value in report["ratios"].items()]
    lines += [f"- target {name}: {'met' if ok else 'NOT met'}" for name, ok in report["targets"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=180,
                    help="requests whose per-adapter counts place the adapters (60 s at the default rate: the "
                         "operator's rate window)")
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ttft-slo-ms", type=int, default=1000)
    ap.add_argument("--itl-slo-ms", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if ROUTER is None:
        sys.exit("vllm-router is not installed: pip install -e '.[test]'")
    report = asyncio.run(run(args))
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
