"""Prefix affinity against round robin with more than two replicas (issue 14's benchmark).

    .venv/bin/python bench/router_prefix_affinity.py [--replicas 4] [--json reports/router_prefix_affinity.json]

``--replicas`` replicas of the tiny model (vLLM-CPU + guard each, 128 KV blocks of 32 tokens, prefix
caching on). A trace of streaming chat requests whose system prompts come from a dozen long ones
(``--prompts`` of ``--words`` words, about 20 blocks each): together twice what one replica's pool caches,
half of what the fleet's pools hold. Round robin (the client sends the i-th request to the i-th replica in
turn, as a ClusterIP Service balancing connections would) sends every prompt to every replica, whose pools
evict each other's prompts; the router sends each prompt to one replica. ``--clients`` closed-loop clients;
each policy with a prompt set of its own per round, odd rounds in reverse order.

Prefix-cache hit rate from vLLM's own counters (through each guard's /metrics/engine), TTFT p50/p95,
and the ratios against the same run's round robin. Two replicas cap the hit-rate ratio at 2x (each
replica caches at most its pool; round robin already hits a pool's share); R replicas cap it at Rx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_vs_vllm_router import run_trace  # noqa: E402

from gpufleet_engine.local.runner import LocalEngine  # noqa: E402
from gpufleet_router.metrics import RouterMetrics  # noqa: E402
from gpufleet_router.policy.replicas import Replica  # noqa: E402
from gpufleet_router.policy.table import Route, Table  # noqa: E402
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
KV_BLOCKS = 128
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"Policy {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def trace(seed: int, offset: int, prompts: int, requests: int, words: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(system_prompt(offset + rng.randrange(prompts), words), f"Question {i}?") for i in range(requests)]


def summary(runs: list[dict]) -> dict:
    ttfts = sorted(t for r in runs for t in r["ttfts"])
    queries, hits = (sum(r[k] for r in runs) for k in ("queries", "hits"))

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000 if ttfts else float("nan")
    return {"hit_rate": hits / queries if queries else 0.0, "ttft_p50_ms": pct(0.5), "ttft_p95_ms": pct(0.95),
            "wall_s": sum(r["wall_s"] for r in runs), "ok": len(ttfts),
            "errors": sum(len(r["errors"]) for r in runs), "first_error": [e for r in runs for e in r["errors"]][:1],
            "hit_rate_by_round": [r["hits"] / r["queries"] if r["queries"] else 0.0 for r in runs]}


class InProcessRouter:
    """gpufleet's router in this process, the replicas given as its table (as tests/engine does)."""

    def __init__(self, guards: list[str]):
        self.settings = RouterSettings()
        self.fleet = Fleet(self.settings, RouterMetrics())
        self.guards = guards

    async def __aenter__(self) -> "InProcessRouter":
        self.http = client_session(self.settings)
        self.fleet.update(Table({MODEL: Route("local", MODEL, MODEL, BLOCK_SIZE, 1, len(self.guards), tuple(
            Replica(f"replica-{i}", g.removeprefix("http://")) for i, g in enumerate(self.guards)))}))
        self.reads = asyncio.create_task(self.fleet.read(self.http))
        self.server = TestServer(Router(self.fleet, self.http).app(), host="127.0.0.1")
        await self.server.start_server()
        await asyncio.sleep(2 * self.settings.reading_interval)  # its first readings of the guards
        self.url = f"http://127.0.0.1:{self.server.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.reads.cancel()
        await self.server.close()
        await self.http.close()

    def picks(self) -> dict[str, float]:
        return {s.labels["reason"]: s.value for f in self.fleet.metrics.registry.collect() for s in f.samples
                if s.name == "gpufleet_router_picks_total"}


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="router-affinity-"))
    cores = max(1, args.cores)
    engines = [LocalEngine(MODEL, host="127.0.0.1", kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE,
                           max_model_len=1024, cpu_cores=str(i % cores), work_dir=work / f"replica-{i}")
               for i in range(args.replicas)]
    for e in engines:
        e.work_dir.mkdir(parents=True, exist_ok=True)
    policies = ["round robin", "gpufleet router"]
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    picks: dict[str, float] = {}
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
        guards = [e.guard_url for e in engines]
        for round_ in range(args.rounds):
            for policy in (policies if round_ % 2 == 0 else policies[::-1]):
                # A prompt set of its own per run: no policy starts on another's cached prefixes.
                requests = trace(args.seed + round_, 1000 * round_ + 100 * (policies.index(policy) + 1),
                                 args.prompts, args.requests, args.words)
                if policy == "round robin":
                    done = await run_trace(guards, requests, guards, args.clients)
                else:
                    async with InProcessRouter(guards) as router:
                        done = await run_trace([router.url], requests, guards, args.clients)
                        for reason, n in router.picks().items():
                            picks[reason] = picks.get(reason, 0) + n
                runs[policy].append(done)
                print(f"round {round_ + 1} {policy}: hit rate {done['hits'] / max(1, done['queries']):.3f}, "
                      f"wall {done['wall_s']:.1f} s, errors {len(done['errors'])}", flush=True)
    finally:
        await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines))
    results = {p: summary(r) for p, r in runs.items()}
    return {"replicas": args.replicas, "prompts": args.prompts, "words": args.words, "requests": args.requests,
            "clients": args.clients, "rounds": args.rounds, "results": results, "router_picks": picks}


def table(report: dict) -> str:
    base = report["results"]["round robin"]
    lines = [f"{report['replicas']} replicas, {report['rounds']} rounds of {report['requests']} streaming chat "
             f"requests from {report['clients']} closed-loop clients, system prompts drawn from "
             f"{report['prompts']} of {report['words']} words; router picks {report['router_picks']}.", "",
             "| policy | prefix-cache hit rate (vLLM) | by round | TTFT p50 | TTFT p95 | wall | errors |",
             "|---|---|---|---|---|---|---|"]
    for policy, r in report["results"].items():
        rounds = " ".join(f"{x:.3f}".lstrip("0") for x in r["hit_rate_by_round"])
        lines.append(f"| {policy} | {r['hit_rate']:.1%} | {rounds} | {r['ttft_p50_ms']:.0f} ms | "
                     f"{r['ttft_p95_ms']:.0f} ms | {r['wall_s']:.1f} s | {r['errors']} |")
    routed = report["results"]["gpufleet router"]
    lines += ["", f"router / round robin: hit rate {routed['hit_rate'] / max(base['hit_rate'], 1e-9):.2f}x, "
                  f"TTFT p50 {routed['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--cores", type=int, default=2, help="replica i's vLLM is bound to core i mod this")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--words", type=int, default=600, help="words per system prompt (600: about 20 KV blocks)")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    report = asyncio.run(run(args))
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
