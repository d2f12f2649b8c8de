"""Traces on a real engine: a streamed chat through the guard to the session's vLLM is one trace
(the guard's request, admission and exchange spans, parented under the client's traceparent, and
vLLM's own request span under the exchange), a refused request's trace shows the refusal and its
reason though head sampling dropped it, and the exemplar on the guard's TTFT histogram names a trace
the store has. Read back from the tier's Jaeger (v1.75.0, conftest's trace_store) where it is built,
else from an in-memory exporter: vLLM, another process, exports only to Jaeger, so its span is
checked only there.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import aiohttp
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gpufleet_api import tracing as names
from gpufleet_api.guard import guard_config
from gpufleet_dev.devcluster import traces
from gpufleet_engine.serving.server import GuardServer
from gpufleet_kit.tracing import Tracing
from tests.engine.conftest import BLOCK_SIZE, MAX_MODEL_LEN
from tests.support.waiting import wait_for

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


class Store:
    """Where the guard's spans are read back: Jaeger's query API, or the in-memory exporter."""

    def __init__(self, ports: traces.JaegerPorts | None, memory: InMemorySpanExporter | None):
        self.ports, self.memory = ports, memory

    def spans(self, trace_id: str) -> list[dict[str, Any]]:
        """The trace's spans as {name, span_id, parent_id, attributes}."""
        if self.memory is not None:
            return [{"name": s.name, "span_id": f"{s.context.span_id:016x}",
                     "parent_id": f"{s.parent.span_id:016x}" if s.parent else "", "attributes": dict(s.attributes)}
                    for s in self.memory.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
        assert self.ports is not None
        found = traces.trace(self.ports, trace_id) or {"spans": []}
        return [{"name": s["operationName"], "span_id": s["spanID"],
                 "parent_id": next((r["spanID"] for r in s.get("references", []) if r["refType"] == "CHILD_OF"), ""),
                 "attributes": {t["key"]: t["value"] for t in s.get("tags", [])}} for s in found["spans"]]

    @property
    def engine_spans(self) -> bool:
        """vLLM's spans are here: the session's vLLM exports to the tier's Jaeger (conftest's engine)."""
        return self.ports is not None


@contextlib.contextmanager
def store(ports: traces.JaegerPorts | None) -> Iterator[tuple[Store, Tracing | None, str]]:
    """A store (the tier's Jaeger ``ports``, else in memory), the tracing to pass a guard (None: from
    guard.json) and the endpoint for guard.json."""
    if ports is not None:
        yield Store(ports, None), None, traces.otlp_http_endpoint(ports)
        return
    memory = InMemorySpanExporter()
    tracing = Tracing.start(guard_config.TracingConfig("http://unused:4318", sample_ratio=0.0), "gpufleet-guard",
                            exporter=memory, batch=False)
    yield Store(None, memory), tracing, "http://unused:4318"


def traced_guard_json(vllm_url: str, endpoint: str) -> dict:
    """guard.json of an in-process guard "chat" before the session's vLLM, exporting to ``endpoint`` with
    head sampling off (only a sampled parent or the tail rule keeps a trace)."""
    return {"servedModelName": "tiny", "tokenizer": "unused", "engineUrl": vllm_url,
            "listenHost": "127.0.0.1", "listenPort": 0, "maxContextTokens": MAX_MODEL_LEN,
            "blockSize": BLOCK_SIZE, "ttftControl": "Off", "service": "chat",
            "tracing": {"endpoint": endpoint, "sampleRatio": 0.0}}


def engine_span(spans: dict[str, dict], exchange: dict) -> dict:
    """vLLM's request span, checked to be the guard's exchange's child (the traceparent the guard sends)."""
    span = spans[names.ENGINE_REQUEST_SPAN]
    assert span["parent_id"] == exchange["span_id"], "vLLM's span is not under the guard's exchange with it"
    return span


async def test_a_streamed_chat_and_a_refusal_are_traces_the_store_has(engine, tokenizer, trace_store):
    with store(trace_store) as (found, tracing, endpoint):
        # Head sampling keeps nothing: the chat is traced for its client's sampled traceparent,
        # the refusal by the tail rule alone.
        raw = traced_guard_json(engine.vllm_url, endpoint)
        guard = GuardServer(guard_config.parse(raw), tokenizer=tokenizer, tracing=tracing)
        await guard.start()
        try:
            await guard.wait_ready(30)
            async with aiohttp.ClientSession() as s:
                async with s.post(guard.url + "/v1/chat/completions", headers={"traceparent": CLIENT_PARENT},
                                  json={"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}],
                                        "max_tokens": 8, "stream": True,
                                        "stream_options": {"include_usage": True}}) as r:
                    assert r.status == 200
                    await r.read()
                async with s.post(guard.url + "/v1/chat/completions", headers={"x-gpufleet-class": "no-such"},
                                  json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}) as r:
                    assert r.status == 400
                async with s.get(guard.url + "/metrics", headers={"Accept": "application/openmetrics-text"}) as r:
                    openmetrics = await r.text()
        finally:
            await guard.stop()   # the spans still batched go out

        expected = 4 if found.engine_spans else 3   # the guard's three, and vLLM's

        def chat_spans() -> list[dict] | None:
            spans = found.spans(CLIENT_TRACE)
            return spans if len(spans) >= expected else None
        spans = {s["name"]: s for s in await wait_for(chat_spans, timeout=30, what=f"the chat's {expected} spans")}
        root = spans[names.GUARD_REQUEST_SPAN]
        assert root["parent_id"] == "00f067aa0ba902b7"        # under the client's span
        for step in (names.GUARD_ADMISSION_SPAN, names.GUARD_ENGINE_SPAN):
            assert spans[step]["parent_id"] == root["span_id"]
        a = root["attributes"]
        assert a[names.GEN_AI_OPERATION] == "chat" and a[names.GEN_AI_REQUEST_MODEL] == "tiny"
        assert a[names.GEN_AI_INPUT_TOKENS] > 0 and 0 < a[names.GEN_AI_OUTPUT_TOKENS] <= 8
        assert a[names.TTFT_SECONDS] > 0 and a[names.HTTP_STATUS] == 200
        if found.engine_spans:
            vllm = engine_span(spans, spans[names.GUARD_ENGINE_SPAN])["attributes"]
            assert vllm[names.ENGINE_COMPLETION_TOKENS] == a[names.GEN_AI_OUTPUT_TOKENS]
            assert vllm[names.ENGINE_TIME_TO_FIRST_TOKEN] <= a[names.TTFT_SECONDS]
        assert len(spans) == expected

        exemplars = {sample.exemplar.labels["trace_id"] for family in text_string_to_metric_families(openmetrics)
                     if family.name == "gpufleet_guard_ttft_seconds" for sample in family.samples if sample.exemplar}
        assert exemplars == {CLIENT_TRACE}   # the slow bucket's exemplar opens a trace the store has

        trace_ids = set()
        if found.memory is not None:
            trace_ids = {f"{s.context.trace_id:032x}" for s in found.memory.get_finished_spans()} - {CLIENT_TRACE}
        else:
            def refused_trace() -> set[str] | None:
                assert found.ports is not None
                ids = {t["traceID"] for t in traces.search(found.ports, names.GUARD_SERVICE_NAME,
                                                             tags={names.KEPT: "refused"})}
                return ids or None
            trace_ids = await wait_for(refused_trace, timeout=30, what="the refusal's trace in Jaeger")
        (refused,) = trace_ids
        (span,) = found.spans(refused)
        assert span["attributes"][names.KEPT] == "refused"
        assert span["attributes"][names.REFUSAL_REASON] == "invalid_request"
