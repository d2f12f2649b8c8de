"""vLLM's API on the guard's port (vllm_endpoints.py) and the cost of each admitted route (route_costs.py)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from gpufleet_engine.admission import route_costs
from gpufleet_engine.admission.context import ContextTooLong, InvalidRequest, Limits
from tests.support.waiting import wait_for
from tests.unit.engine.conftest import FakeVllm, WordTokenizer, serving


class ApiFakeVllm(FakeVllm):
    """The fake vLLM with the routes these tests pass through; each answers what it was sent."""
    healthy: bool = True

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/responses", self._generate)
        for method, path in (("POST", "/tokenize"), ("GET", "/v1/responses/{id}"), ("POST", "/reset_prefix_cache")):
            app.router.add_route(method, path, self._echo)
        return app

    async def _health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    async def _echo(self, request):
        return web.json_response({"path": request.path_qs, "body": (await request.read()).decode(),
                                  "auth": request.headers.get("authorization")}, status=201)


@pytest.fixture
async def fake_vllm():
    async with serving(ApiFakeVllm()) as fake:
        yield fake


async def call(method: str, url: str, **kwargs) -> tuple[int, dict | bytes, aiohttp.typedefs.LooseHeaders]:
    async with aiohttp.ClientSession() as s, s.request(method, url, **kwargs) as r:
        body = await r.read()
        try:
            return r.status, json.loads(body), r.headers
        except ValueError:
            return r.status, body, r.headers


async def test_health_and_ping_fold_in_the_guards_state(guard_factory, fake_vllm):
    guard = await guard_factory()
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        assert (await call(method, guard.url + path))[:2] == (200, b"")
    fake_vllm.healthy = False  # vLLM's own verdict is passed on
    assert (await call("GET", guard.url + "/health"))[0] == 503
    fake_vllm.healthy = True
    guard.guard.drain.begin()  # draining: unhealthy while vLLM is fine, so routers stop sending
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        assert (await call(method, guard.url + path))[0] == 503


async def test_an_engine_that_stops_answering_makes_the_guard_unhealthy(guard_factory, fake_vllm):
    guard = await guard_factory()
    fake_vllm.metrics_up = False
    await wait_for(lambda: not guard.guard.engine_up, timeout=5, interval=0.01, what="the engine marked down")
    assert (await call("GET", guard.url + "/health"))[0] == 503
    status, body, _ = await call("GET", guard.url + "/v1/models")
    assert status == 503 and body["error"]["code"] == "engine_down"


async def test_load_counts_the_requests_the_guard_holds_running_and_queued(guard_factory, fake_vllm):
    guard = await guard_factory(maxConcurrency=1)
    fake_vllm.hold = asyncio.Event()
    body = {"model": "m", "prompt": "a b", "max_tokens": 2}
    requests = [asyncio.create_task(call("POST", guard.url + "/v1/completions", json=body)) for _ in range(3)]
    admission = guard.guard.admission
    await wait_for(lambda: admission.scheduler.running == 1 and admission.queue.depth("standard") == 2,
                   timeout=5, interval=0.005, what="one running, two queued")
    assert (await call("GET", guard.url + "/load"))[:2] == (200, {"server_load": 3})
    fake_vllm.hold.set()
    assert [r[0] for r in await asyncio.gather(*requests)] == [200, 200, 200]
    assert (await call("GET", guard.url + "/load"))[1] == {"server_load": 0}


async def test_token_utilities_and_stored_responses_pass_through_unchanged(guard_factory):
    guard = await guard_factory()
    status, body, _ = await call("POST", guard.url + "/tokenize", data=b'{"prompt": "x"}',
                                 headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    assert status == 201 and body == {"path": "/tokenize", "body": '{"prompt": "x"}', "auth": "Bearer k"}
    status, body, _ = await call("GET", guard.url + "/v1/responses/resp_1?stream=false")
    assert status == 201 and body["path"] == "/v1/responses/resp_1?stream=false"


# vLLM's admin routes take the operator's token: tests/unit/engine/test_control_routes_auth.py.


async def test_unknown_paths_and_methods_are_answered_as_vllm_answers_them(guard_factory):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s, s.get(guard.url + "/v1/nothing") as r:
        assert (r.status, await r.read()) == (404, b'{"detail":"Not Found"}')  # FastAPI's, as vLLM sends it
    status, body, headers = await call("GET", guard.url + "/v1/chat/completions")
    assert (status, body, headers["Allow"]) == (405, {"detail": "Method Not Allowed"}, "POST")
    status, body, _ = await call("POST", guard.url + "/v1/audio/transcriptions", data=b"x")
    assert status == 404 and "audio input" in body["detail"]


async def test_responses_are_admitted_accounted_and_forwarded_to_vllms_route(guard_factory, fake_vllm):
    guard = await guard_factory()
    body = {"model": "m", "input": "a b c", "instructions": "be brief", "max_output_tokens": 3}
    status, answer, _ = await call("POST", guard.url + "/v1/responses", json=body)
    assert status == 200 and fake_vllm.seen_bodies == [body]
    status, metrics, _ = await call("GET", guard.url + "/metrics")
    # Counted as a chat: chat's default class (interactive).
    assert 'gpufleet_guard_requests_total{class="interactive",outcome="ok"} 1.0' in metrics.decode()
    too_long = {**body, "input": "w " * 990}
    status, answer, _ = await call("POST", guard.url + "/v1/responses", json=too_long)
    assert status == 400 and "maximum context is 1000 tokens" in answer["error"]["message"]
    assert len(fake_vllm.seen_bodies) == 1  # refused before vLLM


# --- route_costs: pure ---------------------------------------------------

LIMITS = Limits(max_context_tokens=100, truncate_left=False, max_model_len=100, default_max_tokens=None)
T = WordTokenizer()  # one token a word; a chat message adds 3, the reply prompt 2


def cost(path: str, body: dict, limits: Limits = LIMITS):
    prepared = route_costs.prepare(path, body, T, limits)
    assert prepared.body is body and not prepared.changed  # never rewritten
    return prepared.prompt_tokens, prepared.budgets, prepared.stream


def test_responses_and_messages_count_as_chats():
    assert cost("/v1/responses", {"input": "a b c", "instructions": "x y", "max_output_tokens": 7}) == (
        [(3 + 2) + (3 + 3) + 2], [7], False)
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a b"}]},
                       {"type": "function_call_output", "call_id": "c1", "output": "d"}], "stream": True}
    prompt = 3 + len("a b c1 d".split()) + 2  # the two user turns merged into one message
    assert cost("/v1/responses", items) == ([prompt], [100 - prompt], True)
    anthropic = {"system": [{"type": "text", "text": "s t"}], "max_tokens": 5,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}]}
    assert cost("/v1/messages", anthropic) == ([(3 + 2) + (3 + 3) + 2], [5], False)
    default = Limits(100, False, 100, default_max_tokens=10)
    assert cost("/v1/messages", {"messages": [{"role": "user", "content": "a"}]}, default)[1] == [10]


def test_prefill_routes_count_every_input_and_each_scoring_pair():
    assert cost("/pooling", {"input": ["a b", "c"]}) == ([2, 1], [0, 0], False)
    assert cost("/classify", {"input": "a b c"})[0] == [3]
    assert cost("/v2/embed", {"texts": ["a", "b c"]})[0] == [1, 2]
    assert cost("/score", {"text_1": "q r", "text_2": ["a", "b c d"]})[0] == [3, 5]
    assert cost("/v1/rerank", {"query": "q", "documents": [{"text": "a b"}, "c"]})[0] == [3, 2]
    assert cost("/score", {"queries": ["a", "b b"], "documents": ["c", "d"]})[0] == [2, 3]
    assert cost("/pooling", {"messages": [{"role": "user", "content": "a b"}]})[0] == [3 + 2 + 2]


def test_token_generation_sagemaker_and_the_conservative_fallback():
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
    assert cost("/inference/v1/generate", body) == ([3], [4], False)
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    assert route_costs.prepare("/invocations", chat, T, LIMITS).prompt_tokens == [3 + 1 + 2]
    assert route_costs.prepare("/invocations", {"prompt": "a b", "max_tokens": 2}, T, LIMITS).budgets == [2]
    # A route with no model of its own: every text as prompt, the rest of the context as output.
    assert cost("/v1/systemone", {"model": "m", "prompt": "a b", "options": ["c"]}) == ([3], [97], False)


def test_what_cannot_be_admitted_is_refused_with_the_field_named():
    with pytest.raises(ContextTooLong):
        route_costs.prepare("/v1/responses", {"input": "w " * 90, "max_output_tokens": 20}, T, LIMITS)
    with pytest.raises(ContextTooLong):
        route_costs.prepare("/rerank", {"query": "q", "documents": ["w " * 100]}, T, LIMITS)
    for path, body, param in (("/v1/responses", {"input": []}, "input"),
                              ("/v1/messages", {"messages": [], "max_tokens": 1}, "messages"),
                              ("/v1/messages", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
                               "max_tokens"),
                              ("/inference/v1/generate", {"token_ids": "abc"}, "token_ids"),
                              ("/score", {"query": "q"}, "documents"),
                              ("/v1/responses", {"input": "a", "stream": "yes"}, "stream")):
        with pytest.raises(InvalidRequest) as e:
            route_costs.prepare(path, body, T, LIMITS)
        assert e.value.param == param, (path, body)
