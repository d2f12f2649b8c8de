"""The router's spans and exemplars against in-process guards (test_server.FakeGuard, test_resume_relay.FakeEngine):
one server span per request under the client's traceparent, a client span per send whose context the guard gets,
every refusal on a refused request's trace (kept by the tail rule though head sampling dropped it), both replicas of
a resumed stream, and the request-latency histogram's exemplar in OpenMetrics only."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gpufleet_api import tracing as names
from gpufleet_api.tracing import TracingConfig
from gpufleet_kit.tracing import Tracing
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.server import Router, RouterSettings
from tests.support import epp as envoy
from tests.unit.router.test_disaggregated import PD, FakePrefill
from tests.unit.router.test_resume_relay import PROMPT, WORDS, FakeEngine, Rig, text_of
from tests.unit.router.test_server import MODEL, FakeGuard, Harness, completion, wait_held

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SECRET = "a secret prompt"


def traced(ratio: float) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing.start(TracingConfig("http://unused:4318", sample_ratio=ratio), names.ROUTER_SERVICE_NAME,
                         exporter=exporter, batch=False), exporter


@contextlib.asynccontextmanager
async def traced_router(ratio: float, guards: int = 2):
    """A router with tracing at ``ratio`` in front of ``guards`` FakeGuards."""
    tracing, exporter = traced(ratio)
    fakes = [await FakeGuard(n).start() for n in "ab"[:guards]]
    h = Harness(fakes, RouterSettings(prefix_blocks=4))
    h.router = Router(h.fleet, h.http, tracing)
    h.server = TestServer(h.router.app(), host="127.0.0.1")
    await h.server.start_server()
    h.publish([h.route(*(Replica(g.name, g.address) for g in fakes))])
    await h.fleet.read_once(h.http)
    try:
        yield h, exporter
    finally:
        await h.client.close()
        await h.http.close()
        await h.server.close()
        for g in fakes:
            await g.server.close()
        tracing.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for span in exporter.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def no_text(exporter: InMemorySpanExporter) -> None:
    for span in exporter.get_finished_spans():
        assert not any(SECRET in str(v) for v in span.attributes.values()), span.name


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 4, **extra}


async def test_a_streamed_chat_is_one_trace_under_the_clients_traceparent_and_the_guard_gets_the_sends():
    async with traced_router(ratio=0.0) as (h, exporter):
        h.guards["a"].free, h.guards["b"].free = 10, 80
        await h.fleet.read_once(h.http)
        async with h.post(chat(stream=True), "/v1/chat/completions",
                          headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) as r:
            assert r.status == 200
            await r.read()
        spans = by_name(exporter)
        [root], [send] = spans[names.ROUTER_REQUEST_SPAN], spans[names.ROUTER_REPLICA_SPAN]
        assert root.kind == SpanKind.SERVER and f"{root.context.trace_id:032x}" == CLIENT_TRACE
        assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
        assert send.kind == SpanKind.CLIENT and send.parent.span_id == root.context.span_id
        assert send.context.trace_id == root.context.trace_id
        assert root.attributes[names.GEN_AI_REQUEST_MODEL] == MODEL
        assert root.attributes[names.GEN_AI_OPERATION] == "chat"
        assert root.attributes[names.STREAM] is True and root.attributes[names.HTTP_STATUS] == 200
        assert send.attributes[names.REPLICA] == "b" and send.attributes[names.PICK_REASON] == "kv_free"
        assert sorted(send.attributes[names.PICK_CANDIDATES]) == ["a", "b"]
        assert send.attributes[names.HTTP_STATUS] == 200 and send.status.status_code != StatusCode.ERROR
        assert names.KEPT not in root.attributes
        # The guard's server span will be the send's child: its traceparent names the send, sampled.
        assert h.guards["b"].headers[0]["traceparent"] == \
            f"00-{CLIENT_TRACE}-{send.context.span_id:016x}-01"
        no_text(exporter)


@pytest.mark.parametrize("objective, kept", [(1e-9, True), (3600.0, False), (0.0, False)])
async def test_a_stream_past_its_services_ttft_objective_is_kept_though_head_dropped(objective, kept):
    """The route carries spec.slo.ttftP99Milliseconds (RouteView): a stream whose first token went out later is
    kept by the router's tail rule, as the guard keeps its own; one within it, or a service without one, is not.
    (The objectives are far below and far above any TTFT, so the outcome does not depend on the machine.)"""
    async with traced_router(ratio=0.0) as (h, exporter):
        route = h.fleet.table.routes[MODEL]
        h.publish([dataclasses.replace(route, ttft_objective_seconds=objective)])
        await h.fleet.read_once(h.http)
        async with h.post(chat(stream=True), "/v1/chat/completions") as r:
            assert r.status == 200
            await r.read()
        spans = by_name(exporter)
        if not kept:
            assert names.ROUTER_REQUEST_SPAN not in spans
            return
        [root] = spans[names.ROUTER_REQUEST_SPAN]
        assert root.attributes[names.KEPT] == "slo" and root.attributes[names.TTFT_SECONDS] > objective
        no_text(exporter)


async def test_a_request_refused_everywhere_shows_each_refusal_and_is_kept_though_head_dropped():
    async with traced_router(ratio=0.0) as (h, exporter):
        for g in h.guards.values():
            g.refuse_with = (429, 2)
        async with h.post(chat(), "/v1/chat/completions") as r:
            assert r.status == 429
            await r.read()
        spans = by_name(exporter)
        [root] = spans[names.ROUTER_REQUEST_SPAN]
        sends = sorted(spans[names.ROUTER_REPLICA_SPAN], key=lambda s: s.attributes[names.ATTEMPT])
        assert root.attributes[names.KEPT] == "refused" and root.attributes[names.HTTP_STATUS] == 429
        assert [s.attributes[names.ATTEMPT] for s in sends] == [1, 2]
        assert {s.attributes[names.REPLICA] for s in sends} == {"a", "b"}
        assert sends[1].attributes[names.RETRY_REASON] == "rejected"
        for send in sends:
            assert send.parent.span_id == root.context.span_id
            assert send.status.status_code == StatusCode.ERROR
            assert send.attributes[names.HTTP_STATUS] == 429
            assert send.attributes[names.REFUSAL_REASON] == "kv_watermark"
        # Head sampling dropped it: the guards were told so (their own tail rule keeps their refusals).
        for g in h.guards.values():
            assert g.headers[0]["traceparent"].endswith("-00")
            assert g.headers[0]["traceparent"].split("-")[1] == f"{root.context.trace_id:032x}"


async def test_a_head_dropped_request_that_went_well_exports_nothing():
    async with traced_router(ratio=0.0) as (h, exporter):
        async with h.post(chat(), "/v1/chat/completions") as r:
            assert r.status == 200
            await r.read()
        assert exporter.get_finished_spans() == ()
        [guard] = [g for g in h.guards.values() if g.headers]
        assert guard.headers[0]["traceparent"].endswith("-00")


async def test_the_router_s_own_refusal_is_kept():
    async with traced_router(ratio=0.0) as (h, exporter):
        async with h.post({"model": "no-such-model", "prompt": "x"}) as r:
            assert r.status == 404
        [root] = by_name(exporter)[names.ROUTER_REQUEST_SPAN]
        assert root.attributes[names.KEPT] == "refused" and root.attributes[names.HTTP_STATUS] == 404


async def test_the_latency_histograms_name_a_sampled_trace_in_openmetrics_only():
    async with traced_router(ratio=1.0) as (h, exporter):
        async with h.post(chat(stream=True), "/v1/chat/completions") as r:
            await r.read()
        [root] = by_name(exporter)[names.ROUTER_REQUEST_SPAN]
        async with h.client.get(h.url + "/metrics",
                                headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            openmetrics = await r.text()
        async with h.client.get(h.url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            plain = await r.text()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(openmetrics):
        for sample in family.samples:
            if sample.exemplar is not None:
                found.setdefault(family.name, set()).add(sample.exemplar.labels["trace_id"])
    trace_id = f"{root.context.trace_id:032x}"
    assert found == {"gpufleet_router_request_seconds": {trace_id}, "gpufleet_router_ttft_seconds": {trace_id}}
    assert "trace_id" not in plain


@pytest.fixture
async def traced_rig():
    rigs: list[tuple[Rig, Tracing]] = []

    async def make(ratio: float, *engines: FakeEngine) -> tuple[Rig, InMemorySpanExporter]:
        tracing, exporter = traced(ratio)
        started = [await e.start() for e in engines]
        rig = Rig(started, RouterSettings(prefix_blocks=0), {}, {})
        rig.server = TestServer(Router(rig.fleet, rig.http, tracing).app(), host="127.0.0.1")
        await rig.start()
        rigs.append((rig, tracing))
        return rig, exporter

    yield make
    for rig, tracing in rigs:
        await rig.close()
        tracing.shutdown()


async def test_a_resumed_stream_shows_both_replicas_and_is_kept_though_head_dropped(traced_rig):
    rig, exporter = await traced_rig(0.0, FakeEngine("a", free=90, die_after=3), FakeEngine("b", free=10))
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True})
    assert text_of(events) == "".join(WORDS[:8])
    spans = by_name(exporter)
    [root], [first], [resumed] = (spans[names.ROUTER_REQUEST_SPAN], spans[names.ROUTER_REPLICA_SPAN],
                                  spans[names.ROUTER_RESUME_SPAN])
    assert root.attributes[names.KEPT] == "resumed"
    assert root.attributes[names.BROKEN_REPLICA] == "a" and root.attributes[names.RESUMPTION] == "resumed"
    assert root.attributes[names.RESUME_GAP_SECONDS] >= 0
    assert first.attributes[names.REPLICA] == "a" and first.status.status_code == StatusCode.ERROR
    assert resumed.attributes[names.REPLICA] == "b" and resumed.attributes[names.BROKEN_REPLICA] == "a"
    assert resumed.kind == SpanKind.CLIENT and resumed.parent.span_id == root.context.span_id
    assert resumed.status.status_code != StatusCode.ERROR
    assert first.end_time <= resumed.start_time


async def test_the_endpoint_pickers_pick_is_a_span_whose_context_the_gateway_sends_on():
    tracing, exporter = traced(ratio=0.0)
    fakes = [await FakeGuard(n).start() for n in "ab"]
    h = Harness(fakes, RouterSettings(prefix_blocks=4, epp_secure=False, hold_timeout=0.0))
    h.publish([h.route(*(Replica(g.name, g.address) for g in fakes))])
    await h.fleet.read_once(h.http)
    h.fleet.listed.set()
    try:
        async with envoy.epp(h.fleet, tracing=tracing) as (_, address), envoy.channel(address) as stub:
            stream, answers = await envoy.request(stub, chat(), "/v1/chat/completions",
                                                  headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            sent = envoy.set_headers(answers[0])
            await stream.close()
            stream, refused = await envoy.request(stub, {"model": "no-such-model", "prompt": "x"})
            await stream.close()
    finally:
        await h.client.close()
        await h.http.close()
        for g in fakes:
            await g.server.close()
        tracing.shutdown()
    picks = by_name(exporter)[names.EPP_PICK_SPAN]
    routed = next(s for s in picks if f"{s.context.trace_id:032x}" == CLIENT_TRACE)
    assert f"{routed.parent.span_id:016x}" == CLIENT_SPAN
    assert routed.attributes[names.REPLICA] in ("a", "b") and routed.attributes[names.PICK_REASON]
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{routed.context.span_id:016x}-01"
    # The picker's own refusal (head dropped) is kept.
    [kept] = [s for s in picks if s is not routed]
    assert kept.attributes[names.KEPT] == "refused" and kept.attributes[names.HTTP_STATUS] == 404
    no_text(exporter)


async def test_a_held_request_whose_prefill_fell_back_shows_the_hold_and_the_refused_prefills_and_is_kept():
    tracing, exporter = traced(ratio=0.0)
    prefill = [await FakePrefill(n).start() for n in ("p1", "p2")]
    decode = [await FakeGuard(n).start() for n in ("d1", "d2")]
    h = Harness(prefill + decode, RouterSettings(prefix_blocks=4, prefill_timeout=5.0))
    h.router = Router(h.fleet, h.http, tracing)
    h.server = TestServer(h.router.app(), host="127.0.0.1")
    await h.server.start_server()
    pd = PD(h, prefill, decode)
    try:
        for g in prefill:
            g.refuse_with = (429, 2)
        pd.publish(pd.route(serving={"d1": False, "d2": False}))
        await h.fleet.read_once(h.http)

        async def send() -> int:
            async with h.post(completion("held")) as r:
                await r.read()
                return r.status
        held = asyncio.create_task(send())
        await wait_held(h, 1)
        pd.publish(pd.route())
        assert await asyncio.wait_for(held, 10) == 200
    finally:
        await h.client.close()
        await h.http.close()
        await h.server.close()
        for g in prefill + decode:
            await g.server.close()
        tracing.shutdown()
    spans = by_name(exporter)
    [root], [hold], [step] = (spans[names.ROUTER_REQUEST_SPAN], spans[names.ROUTER_HOLD_SPAN],
                              spans[names.ROUTER_PREFILL_SPAN])
    assert root.attributes[names.KEPT] == "fallback"
    assert hold.attributes[names.HOLD_SECONDS] > 0 and hold.status.status_code != StatusCode.ERROR
    assert step.attributes[names.FALLBACK_REASON] == "refused" and step.status.status_code == StatusCode.ERROR
    sends = spans[names.ROUTER_REPLICA_SPAN]
    prefills = [s for s in sends if s.attributes[names.ROLE] == "prefill"]
    assert len(prefills) == 2 and all(s.attributes[names.REFUSAL_REASON] == "kv_watermark" for s in prefills)
    [decoded] = [s for s in sends if s.attributes[names.ROLE] == "decode"]
    assert decoded.attributes[names.HTTP_STATUS] == 200
    assert hold.end_time <= step.start_time <= decoded.start_time
    assert all(s.parent.span_id == root.context.span_id for s in (hold, step, *sends))


def test_the_router_flags_make_its_tracing_and_none_without_an_endpoint():
    from gpufleet_router.cli import tracing_of
    assert tracing_of("", "http/protobuf", 10) is None
    config = tracing_of(" http://jaeger:4318 ", "grpc", 50)
    assert config == TracingConfig("http://jaeger:4318", protocol="grpc", sample_ratio=0.05)
