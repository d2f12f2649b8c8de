"""The CPU a request's spans cost at one hop, by sampling design (docs/tracing.md, "Sampling").

One request's hooks as the guard calls them (the server span from the client's traceparent, the
admission step, the exchange with vLLM and its traceparent, the attributes, the exemplar, the end),
timed in a loop in one process, per design:

- off: tracing off (``NO_TRACE``), the floor.
- recorded, dropped: gpufleet's design for a request head sampling drops: its steps recorded as
  plain objects (``tracing.RecordedTrace``) and dropped at its end.
- recorded, kept: the same request kept by the tail rule (a refusal): replayed into the SDK's
  spans and exported (``tail_sampling.Replayer``).
- sampled: a request head sampling kept: the SDK's spans, exported.
- SDK records, dropped: the first design tried: the SDK's spans for every request (a sampler that
  records what it drops), held by a span processor until the root ends, then dropped.
- head only, dropped: the SDK's parent-based ratio sampler alone (non-recording spans): the
  head-only design, which cannot keep a request for what happens to it after its first span.
- export all: every request sampled and exported, for a collector's tail sampling to decide
  (the export's protobuf encoding counted, its network not).

Exported spans go through the OTLP exporter's encoding into a sink, on the batch thread as in a
guard; the figures are CPU per request on the request path plus that thread's.

    python bench/tracing_cost.py [--requests 20000]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kit"))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.sampling import (  # noqa: E402
    ALWAYS_ON,
    Decision,
    ParentBased,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind  # noqa: E402

from gpufleet_api import tracing as names  # noqa: E402
from gpufleet_api.tracing import TracingConfig  # noqa: E402
from gpufleet_kit.tracing import NO_TRACE, RequestTrace, Tracing, extract  # noqa: E402


class EncodingSink(SpanExporter):
    """The OTLP exporter's work short of the network: spans encoded to protobuf bytes."""

    def __init__(self) -> None:
        self.spans = self.bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.bytes += len(encode_spans(spans).SerializeToString())
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class RecordingSampler(ParentBased):
    """The first design's sampler: what parent-based ratio sampling drops is recorded all the same."""

    def should_sample(self, *args, **kwargs) -> SamplingResult:
        result = super().should_sample(*args, **kwargs)
        if result.decision is Decision.DROP:
            return SamplingResult(Decision.RECORD_ONLY, result.attributes, result.trace_state)
        return result


class HoldUntilRoot(BatchSpanProcessor):
    """The first design's processor: an unsampled request's spans held until its root ends."""

    def __init__(self, exporter: SpanExporter):
        super().__init__(exporter)
        self.held: dict[int, list[ReadableSpan]] = {}

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context.trace_flags.sampled:
            super().on_end(span)
        elif span.parent is None or span.parent.is_remote:
            self.held.pop(context.trace_id, None)
        else:
            self.held.setdefault(context.trace_id, []).append(span)


class SdkSpans(Tracing):
    """Every request's spans from the SDK, its sampler deciding (the designs gpufleet did not take)."""

    def begin(self, name, headers=None, attributes=None, start=None) -> RequestTrace:
        assert self.tracer is not None
        return RequestTrace(self.tracer, self.tracer.start_span(
            name, extract(headers) if headers else None, SpanKind.SERVER, attributes))


def gpufleets(ratio: float = 0.01) -> tuple[Tracing, EncodingSink]:
    sink = EncodingSink()
    tracing = Tracing.start(TracingConfig("http://unused:4318", sample_ratio=ratio), "bench", exporter=sink)
    assert tracing.replayer is not None
    tracing.replayer.per_second = 1e12   # every request the rule keeps is kept: the cost of one
    return tracing, sink


def sdk_with(sampler, hold: bool = False) -> tuple[Tracing, EncodingSink]:
    sink = EncodingSink()
    provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(HoldUntilRoot(sink) if hold else BatchSpanProcessor(sink))
    return SdkSpans(provider.get_tracer("bench"), provider), sink


def one_request(tracing: Tracing, parent: str | None, refused: bool) -> None:
    """The hooks the guard calls for one streamed, admitted request."""
    trace = tracing.begin(names.GUARD_REQUEST_SPAN, {"traceparent": parent} if parent else {}, {
        names.HTTP_ROUTE: "/v1/chat/completions", names.GEN_AI_OPERATION: "chat",
        names.GEN_AI_REQUEST_MODEL: "m", names.SERVICE: "chat"}) if tracing.on else NO_TRACE
    step = trace.step(names.GUARD_ADMISSION_SPAN, {names.CLASS: "interactive", names.RESERVED_BLOCKS: 10}
                      if trace.on else None)
    trace.end_step(step, {names.QUEUE_WAIT_SECONDS: 0.001} if trace.on else None)
    if trace.on:
        trace.set_all({names.CLASS: "interactive", names.RESERVED_BLOCKS: 10, names.QUEUE_WAIT_SECONDS: 0.001,
                       names.STREAM: True, names.GEN_AI_INPUT_TOKENS: 256})
    headers: dict[str, str] = {}
    engine = trace.step(names.GUARD_ENGINE_SPAN, client=True)
    trace.inject(headers)
    if trace.on:
        trace.set(names.TTFT_SECONDS, 0.05)
    trace.exemplar()
    trace.end_step(engine)
    if refused:
        trace.keep("refused")
    if trace.on:
        trace.set(names.GEN_AI_OUTPUT_TOKENS, 64)
    trace.end({names.HTTP_STATUS: 200} if trace.on else None)


def measure(label: str, tracing: Tracing, sink: EncodingSink | None, requests: int, refused: bool,
            parent: str | None) -> dict:
    for _ in range(500):
        one_request(tracing, parent, refused)
    if tracing.provider is not None:
        tracing.provider.force_flush()
    exported_before = sink.spans if sink else 0
    cpu = time.process_time()   # every thread of the process: the batch thread's encoding included
    wall = time.perf_counter()
    for _ in range(requests):
        one_request(tracing, parent, refused)
    if tracing.provider is not None:
        tracing.provider.force_flush()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if tracing.provider is not None:
        tracing.provider.shutdown()
    return {"design": label, "cpu_us_per_request": round(1e6 * cpu / requests, 1),
            "wall_us_per_request": round(1e6 * wall / requests, 1),
            "spans_exported_per_request": round(((sink.spans if sink else 0) - exported_before) / requests, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    n = args.requests
    # A client's unsampled and sampled requests: every design decides the same way for them.
    dropped = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    rows = [measure("off", Tracing.off(), None, n, False, None)]
    rows.append(measure("recorded, dropped (gpufleet)", *gpufleets(), n, False, dropped))
    rows.append(measure("recorded, kept by the tail rule (gpufleet)", *gpufleets(), n, True, dropped))
    rows.append(measure("sampled (gpufleet)", *gpufleets(), n, False, sampled))
    rows.append(measure("SDK records, dropped (first design)",
                        *sdk_with(RecordingSampler(TraceIdRatioBased(0.01)), hold=True), n, False, dropped))
    rows.append(measure("head only, dropped (non-recording)", *sdk_with(ParentBased(TraceIdRatioBased(0.01))),
                        n, False, dropped))
    rows.append(measure("export all (a collector's tail sampling)", *sdk_with(ALWAYS_ON), n, False, None))
    width = max(len(r["design"]) for r in rows)
    print(f"{'design':<{width}}  cpu µs/req  wall µs/req  spans exported/req")
    for r in rows:
        print(f"{r['design']:<{width}}  {r['cpu_us_per_request']:>10}  {r['wall_us_per_request']:>11}  "
              f"{r['spans_exported_per_request']:>18}")
    at_default = 0.99 * rows[1]["cpu_us_per_request"] + 0.01 * rows[3]["cpu_us_per_request"]
    print(f"\nat the default 1% head sampling, with no request kept by the tail rule: "
          f"{at_default:.1f} µs of CPU per request (off: {rows[0]['cpu_us_per_request']} µs)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
