"""A new replica's first minute under real traffic: what it refuses while it has room.

A replica added by a scale-out meets its first traffic when the service is
busiest. A guard that has not seen 16 answers of a route reserves each
request's whole budget (for chat without max_tokens: the rest of the
context), so it refuses much of what a warm replica admits. With issue 28 it
starts from what the service's other replicas learned (``demand.json``,
which the operator writes from their ``GET /demand``).

One vLLM (the tiny model, 512 KV blocks of 32, 2048-token context, on its own
core as in the other guard benchmarks) and, in front of it in turn, three
guards with the same settings, each measured for its first ``--duration``
seconds under ``--clients`` closed-loop clients of guard_realistic's trace
(answers end early at lengths the guard cannot know; clients honour
Retry-After):

1. **cold**: a new guard with no prior (a service's first replica; what
   every new replica did before);
2. **seeded**: a new guard started with demand.json from the warm guard's
   ``GET /demand`` (a replica added by a scale-out);
3. **warm**: the guard that learned, measured again (the baseline).

The warm guard learns first from ``--learn`` seconds of the same traffic
(another seed). Target: the seeded guard refuses ≤ 1% of its attempts, and
no more than 1 point above the warm guard. Exit code 0 when it holds.

    python bench/guard_scaleout.py [--duration 60] [--clients 32] [--learn 30] [--engine-cores 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the operator's tokens

from guard_common import Run, Stack, refusals, table  # noqa: E402
from guard_realistic import KV_BLOCKS, MAX_MODEL_LEN, closed_loop  # noqa: E402

from gpufleet_api.guard import demand_prior  # noqa: E402
from tests.support.token_issuer import Issuer  # noqa: E402

OPERATOR = Issuer()  # GET /demand takes the operator's token only


def refused(run: Run) -> float:
    """Share of attempts refused (429 or 503)."""
    return run.count(lambda a: a.status in (429, 503)) / max(1, len(run.attempts))


async def demand_of(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + demand_prior.DEMAND_PATH, headers=OPERATOR.bearer()) as r:
            return await r.json()


async def measure(duration: float, clients: int, learn: float, engine_cores: str | None) -> tuple[dict, dict]:
    stack = Stack(KV_BLOCKS, max_model_len=MAX_MODEL_LEN, engine_cores=engine_cores)
    runs: dict[str, Run] = {}
    try:
        stack.start_vllm()
        await closed_loop("warm-up", stack.vllm_url, stack.vllm_url, 8, requests=16, seed=99)
        c1 = await closed_loop("vLLM, 1 client", stack.vllm_url, stack.vllm_url, 1, requests=40, seed=1)
        # The objective guard_realistic gives its guards: 5× the 1-client TTFT p99.
        slo = {"ttftP99Seconds": math.ceil(5 * c1.ttft(0.99) * 100) / 100}
        warm = stack.start_guard("warm", slo=slo, controlAuth=OPERATOR.control_auth())
        await closed_loop("warm guard: learning", warm, stack.vllm_url, clients, duration=learn, seed=50)
        document = await demand_of(warm)
        cold = stack.start_guard("cold", slo=slo)
        reasons: dict[str, dict] = {}
        runs["cold"] = await closed_loop("cold guard: first minute", cold, stack.vllm_url, clients,
                                         duration=duration, seed=7)
        reasons["cold"] = await refusals(cold)
        seeded = stack.start_guard("seeded", slo=slo, files={demand_prior.FILE_NAME: json.dumps(document)})
        runs["seeded"] = await closed_loop("seeded guard: first minute", seeded, stack.vllm_url, clients,
                                           duration=duration, seed=7)
        reasons["seeded"] = await refusals(seeded)
        before = await refusals(warm)
        runs["warm"] = await closed_loop("warm guard (baseline)", warm, stack.vllm_url, clients,
                                         duration=duration, seed=7)
        reasons["warm"] = {k: v - before.get(k, 0.0) for k, v in (await refusals(warm)).items()}
        return runs, {"objective_s": slo["ttftP99Seconds"], "refusals": reasons, "prior": [
            {"route": k["route"], "class": k["class"], "samples": k["samples"],
             "mean": round(sum(k["lengths"]) / len(k["lengths"]), 1)} for k in document["keys"]]}
    finally:
        stack.stop()


def verdict(runs: dict[str, Run]) -> list[tuple[str, str, bool]]:
    cold, seeded, warm = (refused(runs[k]) for k in ("cold", "seeded", "warm"))
    return [("the seeded new replica refuses ≤ 1% of its attempts",
             f"{100 * seeded:.2f}% (cold {100 * cold:.2f}%, warm {100 * warm:.2f}%)", seeded <= 0.01),
            ("... and at most 1 point more than the warm replica",
             f"{100 * (seeded - warm):+.2f} points", seeded - warm <= 0.01)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per guard")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--learn", type=float, default=30.0, help="seconds the warm guard learns first")
    parser.add_argument("--engine-cores", default="1",
                        help="bind vLLM to these cores, the guards and the clients to the rest ('' shares all)")
    parser.add_argument("--json", type=Path, help="write the raw summaries here")
    args = parser.parse_args()
    runs, info = asyncio.run(measure(args.duration, args.clients, args.learn, args.engine_cores or None))
    rows = [{**r.summary(), "refused_%": round(100 * refused(r), 2)} for r in runs.values()]
    print(table(rows))
    print("\nTTFT objective:", info["objective_s"], "s; prior handed over:", json.dumps(info["prior"]))
    print("refusals by reason:", json.dumps(info["refusals"]))
    checks = verdict(runs)
    for name, value, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, **info, "checks": [
            {"target": n, "measured": v, "pass": ok} for n, v, ok in checks]}, indent=2))
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
