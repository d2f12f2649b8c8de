"""The tracing kit: head sampling honouring W3C traceparent, the tail rule that keeps refused
requests head sampling dropped, context propagation, and nothing when off."""
from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpufleet_api.tracing import KEPT, TracingConfig, http_traces_url
from gpufleet_kit.tracing import NO_TRACE, Tracing


def _tracing(ratio: float) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing.start(TracingConfig("http://unused:4318", sample_ratio=ratio), "test",
                         exporter=exporter, batch=False), exporter


def _request(tracing: Tracing, headers: dict | None = None, refuse: bool = False) -> str:
    trace = tracing.begin("hop.request", headers)
    step = trace.step("hop.step", client=True)
    trace.end_step(step)
    if refuse:
        trace.keep("refused")
    trace.end()
    return trace.trace_id


def test_head_sampling_at_ratio_one_exports_every_span_parented():
    tracing, exporter = _tracing(1.0)
    trace_id = _request(tracing)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"hop.request", "hop.step"}
    assert f"{spans['hop.step'].context.trace_id:032x}" == trace_id
    assert spans["hop.step"].parent.span_id == spans["hop.request"].context.span_id


def test_head_dropped_requests_export_nothing_unless_the_tail_rule_keeps_them():
    tracing, exporter = _tracing(0.0)
    for _ in range(20):
        _request(tracing)
    assert exporter.get_finished_spans() == ()
    kept = _request(tracing, refuse=True)
    spans = exporter.get_finished_spans()
    assert {s.name for s in spans} == {"hop.request", "hop.step"}
    assert {f"{s.context.trace_id:032x}" for s in spans} == {kept}
    root = next(s for s in spans if s.name == "hop.request")
    assert root.attributes[KEPT] == "refused"
    assert all(s.context.trace_flags.sampled for s in spans)


def test_the_ratio_samples_about_that_share():
    tracing, exporter = _tracing(0.25)
    for _ in range(2000):
        _request(tracing)
    roots = [s for s in exporter.get_finished_spans() if s.name == "hop.request"]
    assert 350 < len(roots) < 650


def test_an_incoming_traceparent_is_honoured_and_passed_on():
    tracing, exporter = _tracing(0.0)   # the client's sampled flag decides, not the ratio
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    trace = tracing.begin("hop.request", {"traceparent": parent, "tracestate": "vendor=x"})
    step = trace.step("hop.vllm", client=True)
    out: dict[str, str] = {}
    trace.inject(out)
    version, trace_id, span_id, flags = out["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "01")
    assert span_id == f"{step.get_span_context().span_id:016x}"   # vLLM's spans are the step's children
    assert out["tracestate"] == "vendor=x"
    trace.end_step(step)
    trace.end()
    root = next(s for s in exporter.get_finished_spans() if s.name == "hop.request")
    assert root.parent.span_id == 0xb7ad6b7169203331 and root.parent.is_remote


def test_an_unsampled_traceparent_goes_on_unsampled_and_the_tail_rule_still_keeps():
    tracing, exporter = _tracing(1.0)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    trace = tracing.begin("hop.request", {"traceparent": parent})
    out: dict[str, str] = {}
    trace.inject(out)
    assert out["traceparent"].endswith("-00")   # vLLM does not trace what the client did not sample
    assert trace.exemplar() is None
    trace.keep("error")
    assert trace.exemplar() == {"trace_id": "0af7651916cd43dd8448eb211c80319c"}
    trace.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["hop.request"]


def test_off_is_the_no_op_trace():
    tracing = Tracing.start(None, "test")
    assert not tracing.on
    trace = tracing.begin("hop.request", {"traceparent": "garbage"})
    assert trace is NO_TRACE and not trace.on
    out: dict[str, str] = {}
    trace.inject(out)
    trace.keep("refused")
    trace.end_step(trace.step("x"))
    trace.end()
    assert out == {} and trace.exemplar() is None


def test_off_never_imports_the_sdk():
    code = ("import sys; from gpufleet_kit.tracing import Tracing; t = Tracing.off(); "
            "t.begin('x').end(); print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("endpoint,url", [
    ("collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/v1/traces", "https://otel.example/v1/traces"),
])
def test_http_traces_url(endpoint, url):
    assert http_traces_url(endpoint) == url


def test_the_tail_rule_keeps_at_most_its_budget_a_second():
    tracing, exporter = _tracing(0.0)
    assert tracing.replayer is not None
    budget = int(tracing.replayer.per_second)
    kept = [trace for trace in (tracing.begin("hop.request") for _ in range(budget + 5))
            if (trace.keep("refused"), trace.kept)[1]]
    # A burst of refusals: the first ones within the second are kept, the rest counted and dropped.
    assert budget <= len(kept) <= budget + 1
    assert tracing.replayer.over_budget >= 4
