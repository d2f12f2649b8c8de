"""The guard's spans and exemplars in front of a scripted vLLM (conftest.FakeVllm): the server span
with the admission step and the exchange with vLLM, the client's traceparent honoured and passed
to vLLM, refusals kept by the tail rule, exemplars in OpenMetrics."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gpufleet_api import tracing as names
from gpufleet_api.guard import guard_config
from gpufleet_engine.serving.server import GuardServer
from gpufleet_kit.tracing import Tracing
from tests.unit.engine.conftest import FakeVllm, serving

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


@dataclass
class TracedVllm(FakeVllm):
    """The fake vLLM, keeping the traceparent of each generation it is sent."""
    traceparents: list[str | None] = field(default_factory=list)

    async def _generate(self, request):
        self.traceparents.append(request.headers.get("traceparent"))
        return await super()._generate(request)


@contextlib.asynccontextmanager
async def traced_guard(tokenizer, ratio: float, **overrides: Any):
    exporter = InMemorySpanExporter()
    tracing = Tracing.start(guard_config.TracingConfig("http://unused:4318", sample_ratio=ratio), "gpufleet-guard",
                            exporter=exporter, batch=False)
    async with serving(TracedVllm()) as fake:
        raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake.url, "listenHost": "127.0.0.1",
               "listenPort": 0, "metricsPollSeconds": 0.05, "maxContextTokens": 1000, "kvWatermarkPercent": 15,
               "service": "chat", **overrides}
        server = GuardServer(guard_config.parse(raw), tokenizer=tokenizer, tracing=tracing)
        await server.start()
        try:
            await server.wait_ready(5)
            yield server, fake, exporter
        finally:
            await server.stop()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {s.name: s for s in exporter.get_finished_spans()}


async def test_a_streamed_request_is_one_trace_under_the_clients_traceparent(tokenizer):
    async with traced_guard(tokenizer, ratio=0.0) as (guard, fake, exporter):
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/chat/completions",
                              json={"model": "m", "messages": [{"role": "user", "content": "a secret prompt"}],
                                    "max_tokens": 4, "stream": True},
                              headers={"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01",
                                       "x-gpufleet-tenant": "team-a"}) as r:
                assert r.status == 200
                await r.read()
    spans = _by_name(exporter)
    assert set(spans) == {names.GUARD_REQUEST_SPAN, names.GUARD_ADMISSION_SPAN, names.GUARD_ENGINE_SPAN}
    root, admission, engine = (spans[n] for n in (names.GUARD_REQUEST_SPAN, names.GUARD_ADMISSION_SPAN,
                                                  names.GUARD_ENGINE_SPAN))
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {CLIENT_TRACE}
    assert root.parent.span_id == 0xb7ad6b7169203331
    assert admission.parent.span_id == engine.parent.span_id == root.context.span_id
    a = root.attributes
    assert a[names.GEN_AI_OPERATION] == "chat" and a[names.GEN_AI_REQUEST_MODEL] == "m"
    assert a[names.CLASS] == "interactive" and a[names.HTTP_STATUS] == 200
    assert a[names.GEN_AI_INPUT_TOKENS] > 0 and a[names.RESERVED_BLOCKS] >= 1
    assert a[names.TTFT_SECONDS] > 0 and names.QUEUE_WAIT_SECONDS in admission.attributes
    assert a[names.TENANT] == "team-a"
    # vLLM is sent the exchange's span as parent: its own spans join this trace under it.
    assert fake.traceparents == [f"00-{CLIENT_TRACE}-{engine.context.span_id:016x}-01"]
    assert not any("secret" in str(v) for s in spans.values() for v in s.attributes.values())


async def test_a_refusal_is_kept_with_its_reason_though_head_sampling_dropped_it(tokenizer):
    async with traced_guard(tokenizer, ratio=0.0) as (guard, fake, exporter):
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 200    # served, head-dropped: nothing exported
            assert exporter.get_finished_spans() == ()
            async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                              headers={"x-gpufleet-class": "no-such-class"}) as r:
                assert r.status == 400
    root = _by_name(exporter)[names.GUARD_REQUEST_SPAN]
    assert root.attributes[names.KEPT] == "refused"
    assert root.attributes[names.REFUSAL_REASON] == root.attributes[names.ERROR_TYPE] == "invalid_request"
    assert root.attributes[names.HTTP_STATUS] == 400


async def test_an_unsampled_request_goes_to_vllm_unsampled(tokenizer):
    async with traced_guard(tokenizer, ratio=0.0) as (guard, fake, exporter):
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 200
    (sent,) = fake.traceparents
    assert sent is not None and sent.endswith("-00")


async def test_latency_histograms_carry_the_trace_id_in_openmetrics_only(tokenizer):
    async with traced_guard(tokenizer, ratio=1.0) as (guard, fake, exporter):
        fake.token_delay = 0.005  # tokens apart, so the stream has gaps for the ITL histogram
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 6, "stream": True}) as r:
                await r.read()
            async with s.get(guard.url + "/metrics",
                             headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as r:
                assert r.headers["content-type"].startswith("application/openmetrics-text")
                openmetrics = await r.text()
            async with s.get(guard.url + "/metrics") as r:
                assert r.headers["content-type"].startswith("text/plain")
                assert "trace_id" not in await r.text()
    trace_id = f"{_by_name(exporter)[names.GUARD_REQUEST_SPAN].context.trace_id:032x}"
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(openmetrics):
        for sample in family.samples:
            if sample.exemplar is not None:
                found.setdefault(family.name, set()).add(sample.exemplar.labels["trace_id"])
    for name in ("gpufleet_guard_ttft_seconds", "gpufleet_guard_itl_seconds", "gpufleet_guard_request_seconds"):
        assert found.get(name) == {trace_id}, name


async def test_tracing_off_sends_the_clients_traceparent_unchanged(tokenizer):
    parent = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
    async with serving(TracedVllm()) as fake:
        raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake.url, "listenHost": "127.0.0.1",
               "listenPort": 0, "metricsPollSeconds": 0.05, "maxContextTokens": 1000}
        guard = GuardServer(guard_config.parse(raw), tokenizer=tokenizer)
        await guard.start()
        try:
            await guard.wait_ready(5)
            assert not guard.tracing.on
            async with aiohttp.ClientSession() as s:
                async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                  headers={"traceparent": parent}) as r:
                    assert r.status == 200
        finally:
            await guard.stop()
    assert fake.traceparents == [parent]


async def test_a_failed_request_is_kept_as_an_error(tokenizer):
    async with traced_guard(tokenizer, ratio=0.0) as (guard, fake, exporter):
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions", json={"model": "fail-500", "prompt": "x"}) as r:
                assert r.status == 500
    spans = _by_name(exporter)
    assert spans[names.GUARD_REQUEST_SPAN].attributes[names.KEPT] == "error"
    assert spans[names.GUARD_REQUEST_SPAN].attributes[names.OUTCOME] == "error"
    assert not spans[names.GUARD_ENGINE_SPAN].status.is_ok   # the exchange with vLLM says it failed


async def test_a_first_token_past_the_objective_is_kept_and_its_exemplar_names_it(tokenizer):
    async with traced_guard(tokenizer, ratio=0.0, slo={"ttftP99Seconds": 0.001}) as (guard, fake, exporter):
        fake.token_delay = 0.01   # the first token comes after 10 ms: past the 1 ms objective
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
                await r.read()
            async with s.get(guard.url + "/metrics", headers={"Accept": "application/openmetrics-text"}) as r:
                openmetrics = await r.text()
    root = _by_name(exporter)[names.GUARD_REQUEST_SPAN]
    assert root.attributes[names.KEPT] == "slo"
    ttft = [sample.exemplar.labels["trace_id"] for family in text_string_to_metric_families(openmetrics)
            if family.name == "gpufleet_guard_ttft_seconds" for sample in family.samples if sample.exemplar]
    assert ttft == [f"{root.context.trace_id:032x}"]


def test_a_stream_is_kept_for_its_gaps_only_when_a_tenth_of_them_were_late():
    from gpufleet_engine.serving.spans import slow_stream
    assert not slow_stream(64, 1) and not slow_stream(64, 6)   # a p99 objective allows some late gaps
    assert slow_stream(64, 7) and slow_stream(3, 1)
