"""The trace store of the local cluster, standalone: the built Jaeger takes a span the tracing kit
exports over OTLP/HTTP and serves it back from its query API (skipped where Jaeger is not built)."""
from __future__ import annotations

import asyncio

import pytest

from gpufleet_api.tracing import TracingConfig
from gpufleet_dev.devcluster import traces
from gpufleet_kit.tracing import Tracing, otlp_problem
from tests.support.jaeger import running_jaeger
from tests.support.waiting import wait_for


async def test_a_span_from_the_kit_is_read_back_from_jaegers_query_api():
    if otlp_problem():
        pytest.skip(f"the OTLP exporter does not import here: {otlp_problem()}")
    with running_jaeger() as ports:
        tracing = Tracing.start(TracingConfig(traces.otlp_http_endpoint(ports), sample_ratio=1.0), "kit-test",
                                batch=False)
        trace = tracing.begin("hop.request", attributes={"gen_ai.request.model": "m"})
        trace.end_step(trace.step("hop.step"))
        trace.end()
        await asyncio.to_thread(tracing.shutdown)
        def both_spans() -> dict | None:   # the two spans may reach the store in separate batches
            found = traces.trace(ports, trace.trace_id)
            return found if found and len(found["spans"]) == 2 else None
        found = await wait_for(both_spans, timeout=30, what=f"trace {trace.trace_id}'s two spans in Jaeger")
    names = {s["operationName"] for s in found["spans"]}
    assert names == {"hop.request", "hop.step"}
    services = {p["serviceName"] for p in found["processes"].values()}
    assert services == {"kit-test"}
