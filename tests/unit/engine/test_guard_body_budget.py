"""The guard's budget of request-body bytes held at once (guard.json ``bodyBudgetBytes``,
gpufleet_kit.body_budget), through its HTTP path in front of the scripted vLLM: 100 concurrent 8 MiB
bodies get 503s with Retry-After (``body_budget``, counted in gpufleet_guard_rejections_total), the
ones that fit are served, and the budget comes back to zero however a request ends. vLLM's other
routes (passed through) count in the same budget."""
from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from gpufleet_api.guard.guard_config import DEFAULT_BODY_BUDGET_BYTES
from gpufleet_api.guard.guard_metrics import Reason
from tests.support.body_burst import MIB, Burst, completion_body, pieces
from tests.support.waiting import wait_for
from tests.unit.engine.test_guard_proxy import metrics, sample

BODY = 8 * MIB
BUDGET = 64 * MIB
CLIENTS = 100
CONTEXT = 131072     # a context whose body limit (1 MiB + 64 bytes a token: 9 MiB) admits 8 MiB bodies


def assert_refused_for_the_budget(answer) -> None:
    assert answer.status == 503 and answer.retry_after is not None and int(answer.retry_after) >= 1
    assert answer.error["code"] == Reason.BODY_BUDGET and answer.error["type"] == "service_unavailable"
    assert f"budget of {BUDGET} bytes" in answer.error["message"] and "bodyBudgetBytes" in answer.error["message"]


async def test_100_concurrent_8_mib_bodies_get_503s_and_the_ones_that_fit_are_served(guard_factory, fake_vllm):
    guard = await guard_factory(maxContextTokens=CONTEXT, bodyBudgetBytes=BUDGET, retryAfterSeconds=2)
    budget = guard.guard.body_budget
    fake_vllm.hold = asyncio.Event()   # the admitted bodies stay held until every other answer is back
    fit = BUDGET // BODY
    async with Burst(guard.url + "/v1/completions", completion_body(BODY, "m"), CLIENTS) as burst:
        await wait_for(lambda: len(burst.answers) == CLIENTS - fit and fake_vllm.running == fit, timeout=120,
                       what="every body past the budget refused and the ones that fit at vLLM",
                       describe=lambda: (burst.statuses(), fake_vllm.running, budget.held))
        assert budget.held == fit * BODY
        fake_vllm.hold.set()
        answers = await burst.done()
    refused = [a for a in answers if a.status != 200]
    assert len(refused) == CLIENTS - fit and sum(a.status == 200 for a in answers) == fit
    for answer in refused:
        assert_refused_for_the_budget(answer)
        assert answer.retry_after == "2"   # retryAfterSeconds
    assert budget.held == 0 and budget.peak <= BUDGET
    async with aiohttp.ClientSession() as s:
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "standard", "reason": "body_budget"}) \
        == CLIENTS - fit


async def test_chunked_bodies_never_pass_the_budget(guard_factory, fake_vllm):
    guard = await guard_factory(maxContextTokens=CONTEXT, bodyBudgetBytes=BUDGET)
    budget = guard.guard.body_budget
    async with Burst(guard.url + "/v1/completions", completion_body(BODY, "m"), 20, declare=False) as burst:
        answers = await burst.done()
    assert any(a.status == 200 for a in answers)
    for answer in answers:
        if answer.status != 200:
            assert_refused_for_the_budget(answer)
    assert budget.peak <= BUDGET and budget.held == 0


async def test_the_budget_comes_back_to_zero_after_a_client_gone_mid_body_a_413_and_a_failure(
        guard_factory, fake_vllm, monkeypatch):
    guard = await guard_factory(maxContextTokens=CONTEXT, bodyBudgetBytes=BUDGET)
    budget = guard.guard.body_budget
    body = completion_body(BODY, "m")
    async with aiohttp.ClientSession() as s:
        for declare in (True, False):   # the client goes away after 2 MiB
            headers = {"Content-Length": str(len(body))} if declare else {}
            with pytest.raises((aiohttp.ClientError, ConnectionAbortedError)):
                async with s.post(guard.url + "/v1/completions", data=pieces(body, stop_after=2 * MIB),
                                  headers=headers) as r:
                    await r.read()
            await wait_for(lambda: budget.peak > 0 and budget.held == 0, timeout=10,
                           what="the body cut off counted, then given back", describe=lambda: budget.held)
            budget.peak = 0
        too_big = completion_body(guard.guard.body_limit() + 1, "m")
        async with s.post(guard.url + "/v1/completions", data=too_big) as r:
            assert r.status == 413
        assert budget.held == 0

        async def broken(*args):
            raise RuntimeError("a bug past the read")
        monkeypatch.setattr(guard.guard, "_prepare", broken)
        async with s.post(guard.url + "/v1/completions", json={"model": "m", "prompt": "x " * 10000}) as r:
            assert r.status == 500
        assert budget.held == 0 and budget.peak > 0
    assert fake_vllm.seen_bodies == []


async def test_vllms_other_routes_count_in_the_same_budget(guard_factory, fake_vllm):
    guard = await guard_factory(bodyBudgetBytes=1000)
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/tokenize", json={"model": "m", "prompt": "x" * 2000}) as r:
            assert r.status == 413   # over the whole budget: it could never fit
            assert "bodyBudgetBytes" in (await r.json())["error"]["message"]
        guard.guard.body_budget.held = 600   # another request's body held now
        try:
            async with s.post(guard.url + "/tokenize", json={"model": "m", "prompt": "x" * 500}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == Reason.BODY_BUDGET
        finally:
            guard.guard.body_budget.held = 0


async def test_the_budget_is_a_live_setting_with_a_default(guard_factory):
    guard = await guard_factory()
    assert guard.guard.body_budget.limit == DEFAULT_BODY_BUDGET_BYTES
    guard.guard.configure(msgspec.structs.replace(guard.guard.config, body_budget_bytes=BUDGET))
    assert guard.guard.body_budget.limit == BUDGET
