"""A new replica starts from what its service learned (issue 28): one guard's ``GET /demand``,
written as ``demand.json`` beside another's guard.json, makes that one reserve the learned
lengths from its first request instead of the whole budget."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gpufleet_api.guard import demand_prior, guard_config
from gpufleet_engine.serving.server import GuardServer
from tests.support.token_issuer import Issuer
from tests.unit.engine.test_guard_demand_proxy import teach
from tests.unit.engine.test_guard_proxy import until

OPERATOR = Issuer()  # the operator's tokens for GET /demand
BODY = {"model": "m", "prompt": "x " * 40, "max_tokens": 900, "stream": True}
KEY = ("/v1/completions", "standard")


@pytest.fixture
async def from_files(fake_vllm, tokenizer, tmp_path):
    """Start a guard from a guard.json in a directory of its own (its mounted ConfigMap)."""
    started: list[GuardServer] = []

    async def start(name: str, demand: dict | None = None) -> GuardServer:
        folder = tmp_path / name
        folder.mkdir()
        path = folder / "guard.json"
        path.write_text(json.dumps({
            "servedModelName": "m", "tokenizer": "unused", "engineUrl": fake_vllm.url, "listenHost": "127.0.0.1",
            "listenPort": 0, "metricsPollSeconds": 0.05, "maxContextTokens": 1000, "kvWatermarkPercent": 15,
            "controlAuth": OPERATOR.control_auth()}))
        if demand is not None:
            (folder / demand_prior.FILE_NAME).write_text(json.dumps(demand))
        server = GuardServer(guard_config.load(path), tokenizer=tokenizer, config_path=str(path),
                             reload_seconds=0.02)
        await server.start()
        started.append(server)
        await server.wait_ready(5)
        return server

    yield start
    for s in started:
        await s.stop()


async def reserved_for_one(s: aiohttp.ClientSession, guard: GuardServer, fake_vllm) -> int:
    """Blocks the guard reserves for one request of BODY while vLLM holds it."""
    fake_vllm.hold = asyncio.Event()
    pending = asyncio.create_task(s.post(guard.url + "/v1/completions", json=BODY))
    await until(lambda: fake_vllm.running == 1, "the request at vLLM")
    blocks = guard.guard.admission.ledger.reserved_blocks
    fake_vllm.hold.set()
    (await pending).release()
    fake_vllm.hold = None
    return blocks


async def learned_document(s: aiohttp.ClientSession, from_files, fake_vllm) -> dict:
    """A guard taught 20 five-token answers, and its GET /demand."""
    fake_vllm.answer_tokens = 5
    warm = await from_files("warm")
    await teach(s, warm, 20, BODY)
    async with s.get(warm.url + demand_prior.DEMAND_PATH, headers=OPERATOR.bearer()) as r:
        return await r.json()


async def test_a_new_guard_reserves_what_the_service_learned_from_its_first_request(from_files, fake_vllm):
    async with aiohttp.ClientSession() as s:
        document = await learned_document(s, from_files, fake_vllm)
        (learned,) = demand_prior.parse(document).keys
        assert learned.key == KEY and learned.samples == 20

        cold = await from_files("cold")
        assert await reserved_for_one(s, cold, fake_vllm) == 30        # the prior: 40 + 900 tokens
        seeded = await from_files("seeded", demand=document)
        assert await reserved_for_one(s, seeded, fake_vllm) == 2       # 40 + 6 tokens, as the warm one


async def test_a_prior_written_after_the_start_seeds_what_is_not_learned_yet(from_files, fake_vllm, tmp_path):
    async with aiohttp.ClientSession() as s:
        document = await learned_document(s, from_files, fake_vllm)
        late = await from_files("late")
        assert not late.guard.admission.predictor.learned(KEY)
        (tmp_path / "late" / demand_prior.FILE_NAME).write_text(json.dumps(document))
        await until(lambda: late.guard.admission.predictor.learned(KEY), "the late prior seeded")
        assert await reserved_for_one(s, late, fake_vllm) == 2


async def test_an_invalid_prior_never_stops_a_guard(from_files, fake_vllm, caplog):
    guard = await from_files("bad", demand={"version": 1, "keys": [{"route": "/v1/completions"}]})
    assert not guard.guard.admission.predictor.learned(KEY)
    assert "keys[0].class" in caplog.text and "full-budget prior" in caplog.text
