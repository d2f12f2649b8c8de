"""The end of the demo's report: the slowest answered request of the surge and its trace, from the trace store's
query API. Against Jaeger v1.75.0's recorded answers (tests/unit/demo/data/, written by
tests/support/demo_traces.py) and against the built Jaeger itself (skipped where it is not built)."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from gpufleet_api import tracing as names
from gpufleet_dev.demo import slowest_trace
from gpufleet_dev.demo.load import EndpointLoad
from gpufleet_dev.devcluster import traces
from gpufleet_kit.tracing import otlp_problem
from tests.support import demo_traces
from tests.support.jaeger import running_jaeger
from tests.support.waiting import wait_for

DATA = Path(__file__).parent / "data"
QUERY = "http://127.0.0.1:16686"


def recorded(name: str) -> list[dict]:
    return json.loads((DATA / name).read_text())["data"]


def test_the_slowest_answered_request_is_named_not_the_abandoned_one():
    found = recorded("jaeger_search.json")
    assert {t["traceID"] for t in found} == set(demo_traces.TRACES)
    assert slowest_trace.slowest(found) == demo_traces.SLOW


def test_its_hops_are_every_attempt_the_guards_steps_and_vllms_span_in_order():
    (trace,) = recorded("jaeger_trace.json")
    lines = slowest_trace.render(trace, QUERY)
    assert lines[0].startswith("The slowest request of the surge (answered), from the trace store: 9.50 s")
    assert f"{QUERY}/trace/{demo_traces.SLOW}" in lines[1]
    hops = lines[3:8]
    assert [h.split()[2] for h in hops] == [names.GUARD_REQUEST_SPAN, names.GUARD_REQUEST_SPAN,
                                             names.GUARD_ADMISSION_SPAN, names.GUARD_ENGINE_SPAN,
                                             names.ENGINE_REQUEST_SPAN]
    assert "HTTP 429 (queue_full)" in hops[0] and "HTTP 200" in hops[1]
    assert "queued 3.99 s" in hops[2]
    assert names.ENGINE_SERVICE_NAME in hops[4] and "prefill 0.70 s, decode 2.90 s, 64 tokens" in hops[4]
    # Each level of the call tree one step further in: vLLM's span under the guard's exchange.
    indents = [len(h) - len(h.lstrip()) for h in (h.split(" s  ", 1)[1] for h in hops)]
    assert indents == [0, 0, 2, 2, 4]


def test_where_the_time_went_names_the_guards_queue_first():
    (trace,) = recorded("jaeger_trace.json")
    went = dict(slowest_trace.where_the_time_went(slowest_trace.hops(trace)))
    assert list(went)[0] == "the guard's queue"
    assert went["the guard's queue"] == pytest.approx(4.0, abs=0.01)
    assert went["refused 1x, then retried"] == pytest.approx(1.5, abs=0.01)
    assert (went["vLLM's queue"], went["vLLM's prefill"], went["vLLM's decode"]) == (0.2, 0.7, 2.9)
    assert sum(went.values()) == pytest.approx(9.5, abs=0.01)


def test_without_vllms_spans_the_exchange_with_vllm_is_one_part():
    (trace,) = recorded("jaeger_trace.json")
    trace = {**trace, "spans": [s for s in trace["spans"] if s["operationName"] != names.ENGINE_REQUEST_SPAN]}
    went = dict(slowest_trace.where_the_time_went(slowest_trace.hops(trace)))
    assert went["vLLM (its own spans off)"] == pytest.approx(3.9, abs=0.01)
    assert "vLLM's decode" not in went


def test_without_a_trace_store_the_report_says_how_to_get_one():
    text = " ".join(slowest_trace.no_store_lines())
    assert "--no-traces" in text and "gpufleet dev down" in text


async def test_the_report_reads_the_slowest_request_back_from_a_real_jaeger():
    if otlp_problem():
        pytest.skip(f"the OTLP exporter does not import here: {otlp_problem()}")
    base = time.time() - 60
    with running_jaeger() as ports:
        await asyncio.to_thread(demo_traces.write, traces.otlp_http_endpoint(ports), base)
        query = traces.query_url(ports)

        def every_trace() -> list[dict] | None:
            found = traces.find_traces(query, names.GUARD_SERVICE_NAME, operation=names.GUARD_REQUEST_SPAN,
                                       window=(base - 1, base + 20))
            return found if len(found) == len(demo_traces.TRACES) else None
        await wait_for(every_trace, timeout=30, what="the three demo traces in Jaeger")
        lines = await asyncio.to_thread(slowest_trace.read, query, (base - 1, base + 20))
        outside = await asyncio.to_thread(slowest_trace.read, query, (base + 30, base + 40))
    assert f"/trace/{demo_traces.SLOW}" in lines[1] and len(lines) == 9
    assert outside[0].startswith("No trace of the surge")


async def test_a_traced_load_sends_each_request_one_sampled_traceparent_on_every_attempt():
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get("traceparent")))
        if request.url.host == "10.0.0.2":
            return httpx.Response(503, text="draining")   # retried on the other replica
        return httpx.Response(200, content=b"data: [DONE]\n\n")

    async def refresh():
        return load.endpoints

    for traced in (True, False):
        seen.clear()
        load = EndpointLoad(kube=None, namespace="demo", service="chat", model="tiny", prompt_tokens=4,
                            max_tokens=2, traced=traced)
        load.endpoints = ["http://10.0.0.1:8080", "http://10.0.0.2:8080"]
        load.refresh_endpoints = refresh
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            for _ in range(2):   # each picks 10.0.0.2 first: refused as draining, then 10.0.0.1 answers
                await load.one(http)
        headers = [h for _, h in seen]
        if not traced:
            assert headers == [None] * 4
            continue
        assert [host for host, _ in seen] == ["10.0.0.2", "10.0.0.1"] * 2
        assert headers[0] == headers[1] != headers[2] == headers[3]
        assert all(re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", h or "") for h in headers)


def test_with_a_trace_store_the_demos_service_asks_for_vllms_spans():
    from gpufleet_api import parse_spec
    from gpufleet_dev.demo.run import demo_service

    traced = parse_spec(demo_service("tiny", {"traces": {"otlpHttp": "http://127.0.0.1:4318"}})["spec"])
    assert traced.observability.tracing.engine_spans == "On" and traced.observability.tracing.mode == "On"
    assert parse_spec(demo_service("tiny", {})["spec"]).observability.tracing.engine_spans == "Off"
