"""Traces shaped like the demo's requests, written over OTLP/HTTP with the times they name: the guard's spans
(service gpufleet-guard) and vLLM's request span (service vllm) under the client's sampled traceparent. The
demo's report tests read them back from a real Jaeger, and tests/unit/demo/data/ holds Jaeger v1.75.0's answers
for them (recorded with ``python -m tests.support.demo_traces``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from gpufleet_api import tracing as names

# The slowest request answered: refused once (the guard's queue full), retried 1.5 s later, queued 4 s.
SLOW = "5cf92f3577b34da6a3ce929d0e0e4701"
FAST = "5cf92f3577b34da6a3ce929d0e0e4702"
# Slower still, but its client gave up before a first token: not the answered request the report names.
ABANDONED = "5cf92f3577b34da6a3ce929d0e0e4703"
CLIENT_SPAN = "10f067aa0ba902b8"
DATA = Path(__file__).resolve().parents[1] / "unit" / "demo" / "data"


def _engine(queue: float, prefill: float, decode: float, tokens: int) -> dict:
    return {names.ENGINE_TIME_IN_QUEUE: queue, names.ENGINE_PREFILL_SECONDS: prefill,
            names.ENGINE_DECODE_SECONDS: decode, names.ENGINE_COMPLETION_TOKENS: tokens}


# (trace id, [(span, service, parent index or None for the client's span, start s, end s, attributes)])
TRACES = {
    SLOW: [(names.GUARD_REQUEST_SPAN, "guard", None, 0.0, 0.003,
            {names.HTTP_STATUS: 429, names.REFUSAL_REASON: "queue_full"}),
           (names.GUARD_REQUEST_SPAN, "guard", None, 1.5, 9.5, {names.HTTP_STATUS: 200}),
           (names.GUARD_ADMISSION_SPAN, "guard", 1, 1.501, 5.5, {names.QUEUE_WAIT_SECONDS: 3.99}),
           (names.GUARD_ENGINE_SPAN, "guard", 1, 5.5, 9.4, {}),
           (names.ENGINE_REQUEST_SPAN, "vllm", 3, 5.51, 9.39, _engine(0.2, 0.7, 2.9, 64))],
    FAST: [(names.GUARD_REQUEST_SPAN, "guard", None, 2.0, 4.0, {names.HTTP_STATUS: 200}),
           (names.GUARD_ADMISSION_SPAN, "guard", 0, 2.001, 2.1, {names.QUEUE_WAIT_SECONDS: 0.09}),
           (names.GUARD_ENGINE_SPAN, "guard", 0, 2.1, 3.9, {}),
           (names.ENGINE_REQUEST_SPAN, "vllm", 2, 2.11, 3.89, _engine(0.01, 0.3, 1.4, 64))],
    ABANDONED: [(names.GUARD_REQUEST_SPAN, "guard", None, 0.5, 10.5, {names.OUTCOME: "cancelled"}),
                (names.GUARD_ADMISSION_SPAN, "guard", 0, 0.501, 10.5, {})],
}


def write(endpoint: str, base: float) -> None:
    """Export ``TRACES`` to the OTLP/HTTP ``endpoint``, their times counted from the unix time ``base``."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    providers = {}
    for key, service in (("guard", names.GUARD_SERVICE_NAME), ("vllm", names.ENGINE_SERVICE_NAME)):
        providers[key] = TracerProvider(resource=Resource.create({"service.name": service}))
        providers[key].add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    for trace_id, spans in TRACES.items():
        client = TraceContextTextMapPropagator().extract({"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
        made: list = []
        for name, service, parent, start, _end, attributes in spans:
            context = client if parent is None else trace.set_span_in_context(made[parent])
            span = providers[service].get_tracer("demo-traces").start_span(
                name, context=context, start_time=int((base + start) * 1e9), attributes=attributes)
            made.append(span)
        for span, (_, _, _, _, end, _) in zip(made, spans):
            span.end(end_time=int((base + end) * 1e9))
    for provider in providers.values():
        provider.shutdown()


def record() -> None:
    """Write ``TRACES`` to a fresh built Jaeger and keep its answers (the search the report makes, and the
    slowest trace) in tests/unit/demo/data/."""
    import time

    from gpufleet_dev.devcluster import traces
    from tests.support.jaeger import running_jaeger

    base = time.time() - 60
    with running_jaeger() as ports:
        write(traces.otlp_http_endpoint(ports), base)
        query = traces.query_url(ports)
        deadline = time.monotonic() + 30
        while len(found := traces.find_traces(query, names.GUARD_SERVICE_NAME, operation=names.GUARD_REQUEST_SPAN,
                                              window=(base - 1, base + 20))) < len(TRACES):
            if time.monotonic() > deadline:
                sys.exit(f"Jaeger holds {len(found)} of the {len(TRACES)} traces")
            time.sleep(0.2)
        slow = traces.read_trace(query, SLOW)
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "jaeger_search.json").write_text(json.dumps({"data": found}, indent=1) + "\n")
    (DATA / "jaeger_trace.json").write_text(json.dumps({"data": [slow]}, indent=1) + "\n")


if __name__ == "__main__":
    record()
