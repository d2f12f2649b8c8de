"""Head sampling that records everything, and the tail rule that keeps what on-call needs.

Head sampling alone cannot keep a request for what happens to it later: a refusal, an error or a
missed objective is known only once the request ends, long after its first span was sampled or
not. So ``HeadSampler`` never drops: a request head sampling would drop is recorded all the same
(``RECORD_ONLY``: its spans live in memory, its ``traceparent`` goes out with the sampled flag
off, so vLLM and the hops after it do not trace it), and ``TailKeepProcessor`` holds its spans
until its local root span ends. The root carries ``gpufleet.trace.kept`` when the tail rule
(``RequestTrace.keep``) marked it: its spans are exported as sampled; otherwise they are dropped.
Head-sampled spans go straight to the exporting processor. docs/tracing.md has the measured cost.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import Attributes

from gpufleet_api.tracing import KEPT

# Traces of head-dropped requests held at once while they run; past it the oldest are let go
# (their requests, if kept later, lose the spans that had ended: never memory without a bound).
MAX_PENDING_TRACES = 4096


class HeadSampler(Sampler):
    """Parent-based ratio sampling (a W3C ``traceparent``'s sampled flag decides where there is
    one) whose drops are recorded instead, for the tail rule."""

    def __init__(self, ratio: float):
        self.ratio = ratio
        self._head = ParentBased(TraceIdRatioBased(ratio))

    def should_sample(self, parent_context: Optional[Context], trace_id: int, name: str,
                      kind: Optional[SpanKind] = None, attributes: Attributes = None,
                      links: Optional[Sequence[Link]] = None,
                      trace_state: object = None) -> SamplingResult:
        result = self._head.should_sample(parent_context, trace_id, name, kind, attributes, links)
        if result.decision is Decision.DROP:
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"HeadSampler(ratio={self.ratio}, drops recorded for the tail rule)"


class TailKeepProcessor(SpanProcessor):
    """Sampled spans to ``exporting``; a head-dropped request's spans held until its local root
    ends, then exported when the root says kept, else dropped."""

    def __init__(self, exporting: SpanProcessor, max_pending: int = MAX_PENDING_TRACES):
        self.exporting = exporting
        self.max_pending = max_pending
        self._pending: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self._lock = threading.Lock()
        self.kept_traces = self.dropped_traces = 0

    def on_start(self, span: Span, parent_context: Optional[Context] = None) -> None:
        self.exporting.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None:
            return
        if context.trace_flags.sampled:
            self.exporting.on_end(span)
            return
        root = span.parent is None or span.parent.is_remote
        with self._lock:
            held = self._pending.pop(context.trace_id, None)
            if not root:
                held = held or []
                held.append(span)
                self._pending[context.trace_id] = held
                while len(self._pending) > self.max_pending:
                    self._pending.popitem(last=False)
                return
        if not (span.attributes or {}).get(KEPT):
            self.dropped_traces += 1
            return
        self.kept_traces += 1
        for each in (*(held or ()), span):
            self.exporting.on_end(_as_sampled(each))

    def shutdown(self) -> None:
        self.exporting.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporting.force_flush(timeout_millis)


def _as_sampled(span: ReadableSpan) -> ReadableSpan:
    """A kept span as the exporter takes it: the same span with its sampled flag set."""
    c = span.context
    assert c is not None
    return ReadableSpan(
        name=span.name, context=SpanContext(c.trace_id, c.span_id, c.is_remote, TraceFlags(TraceFlags.SAMPLED),
                                            c.trace_state),
        parent=span.parent, resource=span.resource, attributes=span.attributes, events=span.events,
        links=span.links, kind=span.kind, status=span.status, start_time=span.start_time,
        end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)
