"""Tenant fairness at one saturated guard: a quiet tenant beside a loud one sending ten times its rate.

The guard (its own process, defaults but ``maxConcurrency``) sits in front of a simulated engine (another
process, ``--engine``): continuous batching, one decode step for every running sequence at a time of
``STEP_MS + PER_SEQ_MS × batch``, a new sequence's prompt prefilled in the step it joins at
``PREFILL_MS_PER_TOKEN`` (about an 8B model on one H100; the guard does not know these figures). No
vLLM: the bench measures the guard's queue, and a simulated engine keeps the 2-core machine's CPU for the
guard and the clients. Prompts are token ids (no tokenizing), answers streamed with usage.

Open-loop Poisson arrivals, no retries (a 429 is a request lost), in one run on one guard:

1. the quiet tenant alone at ``--quiet-rate`` requests/s;
2. the quiet and the loud tenant (10× the rate, far past the guard's capacity), with the router's tenant
   headers: the fair lane (VTC) shares each queue class between them;
3. the same traffic without tenant headers: first come, first served, the guard before issue 45;
4. the floor: the same traffic with the quiet tenant's requests in the higher queue class ``interactive``
   (strict priority over the loud tenant's ``standard``): the best any queue order can give it, since a
   guard that has every slot busy can only hand the quiet tenant the next slot that frees, and its request
   then runs in a full batch. No order of the queue gets under this.

For each, the quiet tenant's TTFT p99 and goodput (answer tokens of its completed requests per second).
Targets: with fair sharing the quiet tenant's TTFT p99 within 1.5× of alone and its goodput ≥ 95% of
alone; FCFS is the baseline it beats. Where the floor itself is over 1.5× alone, the target is below what
any queue order can do on a saturated engine (a finding), and the fair lane is judged against the floor.
Then the cost of the headers and the fair lane on the guard's path:
TTFT at one client, requests with and without headers alternating (the median of paired differences,
target ≤ 0.2 ms), the guard's CPU per request, and throughput at saturation (closed loop, 4× the slots,
two tenants vs no headers, alternating rounds; target loss < 2%).

    python bench/tenant_fairness.py [--duration 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_common import WORK, Stack, percentile, table  # noqa: E402

from gpufleet_api.guard.guard_config import CLASS_HEADER  # noqa: E402
from gpufleet_api.tenants.usage import GUARD_TENANT_HEADER, GUARD_WEIGHT_HEADER  # noqa: E402
from gpufleet_engine.launch.processes import ManagedProcess, wait_until  # noqa: E402

STEP_MS, PER_SEQ_MS, PREFILL_MS_PER_TOKEN = 10.0, 0.5, 0.03
KV_BLOCKS, BLOCK = 8192, 32
SLOTS = 16
PROMPT, OUTPUT = 256, 32


# --- the simulated engine ------------------------------------------------------------------------

@dataclass(eq=False)
class _Sequence:
    prompt: int
    left: int
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)
    prefilled: bool = False


class SimEngine:
    """Continuous batching: every step, each running sequence gets one token."""

    def __init__(self) -> None:
        self.running: list[_Sequence] = []
        self.wake = asyncio.Event()

    async def steps(self) -> None:
        while True:
            if not self.running:
                self.wake.clear()
                await self.wake.wait()
            batch = list(self.running)
            prefill = sum(s.prompt for s in batch if not s.prefilled)
            await asyncio.sleep((STEP_MS + PER_SEQ_MS * len(batch) + PREFILL_MS_PER_TOKEN * prefill) / 1000)
            for s in batch:
                s.prefilled = True
                s.left -= 1
                s.tokens.put_nowait(s.left)
                if s.left <= 0:
                    self.running.remove(s)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seq = _Sequence(len(body["prompt"]), int(body.get("max_tokens") or 16))
        self.running.append(seq)
        self.wake.set()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            while (left := await seq.tokens.get()) >= 0:
                await resp.write(b'data: {"choices":[{"index":0,"text":"t"}]}\n\n')
                if left == 0:
                    break
        finally:
            if seq in self.running:
                self.running.remove(seq)
        usage = {"prompt_tokens": seq.prompt, "completion_tokens": int(body.get("max_tokens") or 16)}
        await resp.write(f'data: {{"choices":[],"usage":{json.dumps(usage)}}}\n\ndata: [DONE]\n\n'.encode())
        await resp.write_eof()
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        used = sum(-(-(s.prompt + OUTPUT) // BLOCK) for s in self.running) / KV_BLOCKS
        return web.Response(text=(
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {used}\n'
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {len(self.running)}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} 0.0\n'
            f'vllm:num_preemptions_total{{engine="0",model_name="tiny"}} 0.0\n'
            f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",num_gpu_blocks="{KV_BLOCKS}",'
            f'num_gpu_blocks_override="None"}} 1.0\n'))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                              "max_model_len": 1024}]})


def serve_engine(port: int) -> None:
    async def main() -> None:
        engine = SimEngine()
        app = web.Application()
        app.router.add_post("/v1/completions", engine.completions)
        app.router.add_get("/metrics", engine.metrics)
        app.router.add_get("/v1/models", engine.models)
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await engine.steps()
    asyncio.run(main())


# --- the load ------------------------------------------------------------------------------------

@dataclass
class Outcome:
    tenant: str
    status: int
    ttft: float | None = None
    tokens: int = 0


def body(rng: random.Random) -> bytes:
    return json.dumps({"model": "tiny", "prompt": [rng.randrange(1000, 40000) for _ in range(PROMPT)],
                       "max_tokens": OUTPUT, "stream": True, "stream_options": {"include_usage": True}}).encode()


def tenant_headers(tenant: str, fair: bool, queue_class: str | None = None) -> dict[str, str]:
    out = {"content-type": "application/json"}
    if fair:
        out.update({GUARD_TENANT_HEADER: tenant, GUARD_WEIGHT_HEADER: "1"})
    if queue_class:
        out[CLASS_HEADER] = queue_class
    return out


async def send(session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str],
               tenant: str) -> Outcome:
    sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", data=data, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return Outcome(tenant, r.status)
            first = None
            tail = b""
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                tail = (tail + chunk)[-400:]
            tokens = OUTPUT if b'"completion_tokens":' in tail else 0
            return Outcome(tenant, 200, first - sent if first else None, tokens)
    except aiohttp.ClientError:
        return Outcome(tenant, 0)


async def open_loop(url: str, rates: dict[str, float], duration: float, fair: bool, seed: int,
                    classes: dict[str, str] | None = None) -> dict:
    """Poisson arrivals per tenant for ``duration`` s; every request awaited to its end. A tenant's
    arrival times depend on its name and ``seed`` only: the quiet tenant sends the same in every run."""
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def arrivals(tenant: str, rate: float) -> None:
            rng = random.Random(f"{tenant}-{seed}")
            start = time.perf_counter()
            at = start
            headers = tenant_headers(tenant, fair, (classes or {}).get(tenant))
            while True:
                at += rng.expovariate(rate)
                if at - start >= duration:
                    return
                data = body(rng)
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(send(session, url, data, headers, tenant)))

        await asyncio.gather(*(arrivals(t, r) for t, r in rates.items()))
        outcomes = await asyncio.gather(*tasks)
    out = {}
    for tenant in rates:
        mine = [o for o in outcomes if o.tenant == tenant]
        ok = [o for o in mine if o.status == 200 and o.tokens]
        out[tenant] = {"sent": len(mine), "completed": len(ok),
                       "refused": sum(1 for o in mine if o.status == 429),
                       "ttft_p50_ms": round(1000 * percentile([o.ttft for o in ok], 0.5), 1),
                       "ttft_p99_ms": round(1000 * percentile([o.ttft for o in ok], 0.99), 1),
                       "goodput_tok_s": round(sum(o.tokens for o in ok) / duration, 1)}
    return out


async def paired_ttft(url: str, pairs: int, seed: int) -> tuple[list[float], list[float]]:
    """One client, requests with the tenant headers and without alternating (which goes first
    alternates too): TTFT of each, in ms."""
    rng = random.Random(seed)
    with_h, without = [], []
    async with aiohttp.ClientSession() as session:
        for i in range(pairs):
            order = [True, False] if i % 2 == 0 else [False, True]
            for fair in order:
                o = await send(session, url, body(rng), tenant_headers("quiet", fair), "quiet")
                if o.ttft is not None:
                    (with_h if fair else without).append(1000 * o.ttft)
    return with_h, without


async def closed_loop(url: str, clients: int, duration: float, fair: bool, seed: int) -> float:
    """``clients`` clients one request after another for ``duration`` s (half tenant a, half b when
    ``fair``): completed answer tokens per second."""
    rng = random.Random(seed)
    tokens = 0
    end = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(i: int) -> None:
            nonlocal tokens
            headers = tenant_headers("ab"[i % 2], fair)
            while time.perf_counter() < end:
                o = await send(session, url, body(rng), headers, "ab"[i % 2])
                if time.perf_counter() <= end:
                    tokens += o.tokens
        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
    return tokens / (min(time.perf_counter(), end) - start)


async def guard_cpu_per_request(stack: Stack, url: str, fair: bool, requests: int, seed: int) -> float:
    """Guard CPU (µs) per request over ``requests`` sent by 4 clients."""
    rng = random.Random(seed)
    before = stack.cpu_seconds("guard")
    async with aiohttp.ClientSession() as session:
        async def client(i: int) -> None:
            for _ in range(requests // 4):
                await send(session, url, body(rng), tenant_headers("ab"[i % 2], fair), "ab"[i % 2])
        await asyncio.gather(*(client(i) for i in range(4)))
    return 1e6 * (stack.cpu_seconds("guard") - before) / requests


def lane_microbench(n: int = 20000) -> dict:
    """µs per request of the queue work a request adds in one class: push and pop through the guard's
    multi-level queue with two tenants and its charges (a prompt, 3 answer charges), against the same
    queue with no tenant, and against a bare deque (the lane before issue 45)."""
    import collections
    import timeit

    from gpufleet_api.guard.guard_config import QueueClass
    from gpufleet_engine.admission.queues import MultiLevelQueue
    from gpufleet_engine.admission.tenant_keys import TenantKeys, tenant_name, tenant_weight

    classes = [QueueClass("interactive", 1, 2), QueueClass("standard", 2, 10), QueueClass("background", 3, 60)]

    def run(named: bool) -> None:
        queue: MultiLevelQueue = MultiLevelQueue(classes, 5, n + 64)
        keys = TenantKeys(queue.weigh, queue.forget)
        for i in range(32):   # a standing queue
            queue.push(i, "standard", 0.0, "ab"[i % 2] if named else "unknown")
        for i in range(n):
            key = keys.enter(tenant_name("ab"[i % 2] if named else None), tenant_weight("1" if named else None))
            queue.push(i, "standard", 0.0, key)
            e = queue.pop(0.0)
            queue.charge("standard", key, prompt_tokens=PROMPT)
            for _ in range(3):
                queue.charge("standard", key, answer_tokens=OUTPUT // 3)
            keys.leave(key)
            assert e is not None

    def bare() -> None:
        lane: collections.deque = collections.deque(range(32))
        for i in range(n):
            lane.append(i)
            lane.popleft()

    return {"two_tenants_us": round(1e6 * min(timeit.repeat(lambda: run(True), number=1, repeat=3)) / n, 2),
            "no_tenant_us": round(1e6 * min(timeit.repeat(lambda: run(False), number=1, repeat=3)) / n, 2),
            "bare_deque_us": round(1e6 * min(timeit.repeat(bare, number=1, repeat=3)) / n, 2)}


def median_diff_ci(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    diffs = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(1000))
    return statistics.median(diffs), boots[25], boots[974]


async def measure(duration: float, quiet_rate: float, pairs: int, rounds: int) -> dict:
    # Trusted class headers: the floor's run asks for the interactive class (a gateway's right, not a client's).
    stack = Stack(KV_BLOCKS, maxConcurrency=SLOTS, kvWatermarkPercent=5, classHeaderPolicy="Trusted")
    engine = ManagedProcess("engine", [sys.executable, __file__, "--engine", str(stack.vllm_port)], {},
                            WORK / f"engine-{stack.vllm_port}.log")
    engine.start()
    stack.procs.append(engine)
    results: dict = {"lane_us_per_request": lane_microbench()}
    try:
        wait_until(lambda: _up(stack.vllm_url + "/health"), 60, abort_if_dead=engine, what="engine")
        url = stack.start_guard()
        await open_loop(url, {"quiet": quiet_rate}, 3, True, 99)   # warm-up
        loud = {"quiet": quiet_rate, "loud": 10 * quiet_rate}
        results["alone"] = await open_loop(url, {"quiet": quiet_rate}, duration, True, 1)
        results["fair"] = await open_loop(url, loud, duration, True, 1)
        results["fcfs"] = await open_loop(url, loud, duration, False, 1)
        results["floor"] = await open_loop(url, loud, duration, True, 1,
                                           classes={"quiet": "interactive", "loud": "standard"})
        with_h, without = await paired_ttft(url, pairs, 3)
        results["paired_ttft_ms"] = {"with_headers_p50": round(statistics.median(with_h), 2),
                                     "without_p50": round(statistics.median(without), 2),
                                     "added_median_and_95ci": [round(x, 3) for x in median_diff_ci(with_h, without)]}
        cpu = {True: [], False: []}
        thr = {True: [], False: []}
        for r in range(rounds):
            for fair in ([True, False] if r % 2 == 0 else [False, True]):
                cpu[fair].append(await guard_cpu_per_request(stack, url, fair, 200, 10 + r))
                thr[fair].append(await closed_loop(url, 4 * SLOTS, duration / 2, fair, 20 + r))
        results["guard_cpu_us_per_request"] = {"with_headers": round(statistics.median(cpu[True]), 1),
                                               "without": round(statistics.median(cpu[False]), 1)}
        results["saturated_tok_s"] = {"with_headers": round(statistics.mean(thr[True]), 1),
                                      "without": round(statistics.mean(thr[False]), 1)}
    finally:
        stack.stop()
    return results


def _up(url: str) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def report(results: dict) -> bool:
    alone, fair, fcfs, floor = (results[k]["quiet"] for k in ("alone", "fair", "fcfs", "floor"))
    rows = [{"run": k, **{f"quiet_{m}": results[k]["quiet"][m] for m in results[k]["quiet"]},
             **({f"loud_{m}": results[k]["loud"][m] for m in ("sent", "completed", "refused", "ttft_p99_ms")}
                if "loud" in results[k] else {})} for k in ("alone", "fair", "fcfs", "floor")]
    for row in rows:
        for m in ("sent", "completed", "refused", "ttft_p99_ms"):
            row.setdefault(f"loud_{m}", "-")
    print(table(rows))
    ttft_fair = fair["ttft_p99_ms"] / alone["ttft_p99_ms"]
    ttft_fcfs = fcfs["ttft_p99_ms"] / alone["ttft_p99_ms"]
    ttft_floor = floor["ttft_p99_ms"] / alone["ttft_p99_ms"]
    fair_over_floor = fair["ttft_p99_ms"] / floor["ttft_p99_ms"]
    good_fair = fair["goodput_tok_s"] / alone["goodput_tok_s"]
    good_fcfs = fcfs["goodput_tok_s"] / alone["goodput_tok_s"]
    added, lo, hi = results["paired_ttft_ms"]["added_median_and_95ci"]
    sat = results["saturated_tok_s"]
    loss = 1 - sat["with_headers"] / sat["without"]
    checks = {
        f"quiet TTFT p99, fair / alone = {ttft_fair:.2f}x (FCFS {ttft_fcfs:.2f}x; the floor, strict priority, "
        f"{ttft_floor:.2f}x), target <= 1.5x"
        + (" (below the floor: no queue order reaches it)" if ttft_floor > 1.5 else ""): ttft_fair <= 1.5,
        f"quiet TTFT p99, fair / the floor = {fair_over_floor:.2f}x, target <= 1.5x": fair_over_floor <= 1.5,
        f"quiet goodput, fair / alone = {good_fair:.2f} (FCFS {good_fcfs:.2f}), target >= 0.95": good_fair >= 0.95,
        "fair beats FCFS on the quiet tenant's TTFT p99 and goodput": ttft_fair < ttft_fcfs and good_fair > good_fcfs,
        f"added TTFT at the median, headers + fair lane vs none: {added:+.3f} ms (95% CI {lo:+.3f}..{hi:+.3f}), "
        f"target <= 0.2 ms": added <= 0.2,
        f"throughput at saturation, headers vs none: {sat['with_headers']} vs {sat['without']} tok/s, "
        f"loss {100 * loss:.1f}%, target < 2%": loss < 0.02,
    }
    print(f"\nqueue work per request, in-process: {results['lane_us_per_request']}")
    print(f"guard CPU per request (4 clients): {results['guard_cpu_us_per_request']} µs")
    print(f"paired TTFT at 1 client: {results['paired_ttft_ms']}")
    for text, ok in checks.items():
        print(f"{'PASS' if ok else 'MISS'}  {text}")
    return all(checks.values())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", type=int, help=argparse.SUPPRESS)  # run the simulated engine on this port
    p.add_argument("--duration", type=float, default=20.0, help="seconds per open-loop run")
    p.add_argument("--quiet-rate", type=float, default=3.0, help="the quiet tenant's requests per second")
    p.add_argument("--pairs", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    if args.engine:
        serve_engine(args.engine)
        return 0
    results = asyncio.run(measure(args.duration, args.quiet_rate, args.pairs, args.rounds))
    ok = report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
