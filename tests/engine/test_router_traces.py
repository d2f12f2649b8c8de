"""One trace across the router and the guard on a real engine: a streamed chat sent to gpufleet's router in front of
a guard over the session's vLLM is the router's request and its send, the guard's request as the send's child, and
the guard's admission and exchange with vLLM, all under the client's traceparent. Read back from a real Jaeger
(conftest's trace_store) where it is built, with vLLM's own request span under the guard's exchange, else from an
in-memory exporter the router's and the guard's spans go to (test_guard_traces.store), without vLLM's."""
from __future__ import annotations

import aiohttp

from gpufleet_api import tracing as names
from gpufleet_api.guard import guard_config
from gpufleet_api.tracing import TracingConfig
from gpufleet_engine.serving.server import GuardServer
from gpufleet_kit.tracing import Tracing
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route
from gpufleet_router.settings import RouterSettings
from tests.engine.conftest import BLOCK_SIZE
from tests.engine.test_guard_traces import engine_span, store, traced_guard_json
from tests.support.router import static_router
from tests.support.waiting import wait_for

CLIENT_TRACE = "5cf92f3577b34da6a3ce929d0e0e4737"
CLIENT_SPAN = "10f067aa0ba902b8"


async def test_a_streamed_chat_through_the_router_the_guard_and_vllm_is_one_trace(engine, tokenizer, trace_store):
    with store(trace_store) as (found, guard_tracing, endpoint):
        raw = traced_guard_json(engine.vllm_url, endpoint)
        guard = GuardServer(guard_config.parse(raw), tokenizer=tokenizer, tracing=guard_tracing)
        config = TracingConfig(endpoint, sample_ratio=0.0)
        router_tracing = Tracing.start(config, names.ROUTER_SERVICE_NAME, exporter=found.memory, batch=False) \
            if found.memory is not None else Tracing.start(config, names.ROUTER_SERVICE_NAME)
        await guard.start()
        try:
            await guard.wait_ready(30)
            address = guard.url.removeprefix("http://")
            route = Route("ml", "chat", "tiny", BLOCK_SIZE, 1, 1, (Replica("chat-0", address),))
            async with static_router(route, settings=RouterSettings(prefix_blocks=0), tracing=router_tracing) \
                    as (url, _), aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions",
                                  headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                                  json={"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}],
                                        "max_tokens": 8, "stream": True}) as r:
                    assert r.status == 200
                    body = await r.read()
                    assert body.endswith(b"data: [DONE]\n\n")
        finally:
            await guard.stop()
            router_tracing.shutdown()   # the spans still batched go out

        expected = 6 if found.engine_spans else 5   # the router's two, the guard's three, and vLLM's

        def chat_spans() -> list[dict] | None:
            spans = found.spans(CLIENT_TRACE)
            return spans if len(spans) >= expected else None
        spans = {s["name"]: s for s in await wait_for(chat_spans, timeout=30, what=f"the chat's {expected} spans")}
    assert len(spans) == expected
    root, send = spans[names.ROUTER_REQUEST_SPAN], spans[names.ROUTER_REPLICA_SPAN]
    assert root["parent_id"] == CLIENT_SPAN and send["parent_id"] == root["span_id"]
    assert spans[names.GUARD_REQUEST_SPAN]["parent_id"] == send["span_id"]
    for step in (names.GUARD_ADMISSION_SPAN, names.GUARD_ENGINE_SPAN):
        assert spans[step]["parent_id"] == spans[names.GUARD_REQUEST_SPAN]["span_id"]
    assert send["attributes"][names.REPLICA] == "chat-0" and root["attributes"][names.GEN_AI_REQUEST_MODEL] == "tiny"
    if found.engine_spans:
        engine_span(spans, spans[names.GUARD_ENGINE_SPAN])
