"""The tail rule's second half: a request head sampling dropped, and the tail rule then kept, becomes
the SDK's spans after the fact (``Replayer``), with the ids and times it was recorded with.

Head sampling alone cannot keep a request for what happens to it later: a refusal, an error or a
missed objective is known only once the request ends, long after its first span was sampled or not.
So a head-dropped request is recorded by ``tracing.RecordedTrace``, plain Python objects at a tenth
of the SDK's cost a span (bench/tracing_cost.py), and dropped at its end unless the tail rule kept
it; a kept one is replayed here into the exporting pipeline, as sampled. Its ``traceparent`` went
out with the sampled flag off, so the hops after it (vLLM) did not trace it.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Iterable, Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, Tracer


class PresetIds(IdGenerator):
    """The ids of the span being replayed; random ones otherwise."""

    def __init__(self) -> None:
        self.trace_id = self.span_id = 0

    def generate_trace_id(self) -> int:
        value, self.trace_id = self.trace_id, 0
        return value or random.getrandbits(128)

    def generate_span_id(self) -> int:
        value, self.span_id = self.span_id, 0
        return value or random.getrandbits(64)


# One recorded step: (name, span id, client, start ns, end ns (0: open), attributes, error).
Step = tuple[str, int, bool, int, int, Mapping[str, Any], str]


# Head-dropped requests the tail rule may keep a second, per process, beyond head sampling. Under
# overload most requests are refused or slow: keeping every one would spend the CPU the engine needs
# on traces that all say the same (the metrics count them all); the first ones each second are kept.
KEPT_PER_SECOND = 20.0


class Replayer:
    """Turns a recorded request into exported spans. ``tracer``'s provider samples everything and has
    ``ids`` as its id generator. ``admit`` hands out the tail rule's budget: ``per_second`` a second,
    as many at once."""

    def __init__(self, tracer: Tracer, ids: PresetIds, per_second: float = KEPT_PER_SECOND):
        self.tracer, self.ids = tracer, ids
        self._lock = threading.Lock()
        self.per_second = per_second
        self._tokens, self._refilled = per_second, time.monotonic()
        self.replayed = self.over_budget = 0

    def admit(self) -> bool:
        """One more kept request, if the budget has room (else it is counted in ``over_budget``)."""
        now = time.monotonic()
        self._tokens = min(self.per_second, self._tokens + (now - self._refilled) * self.per_second)
        self._refilled = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        self.over_budget += 1
        return False

    def replay(self, *, trace_id: int, span_id: int, parent_span_id: int, name: str, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any], error: str, steps: Iterable[Step]) -> None:
        with self._lock:
            ids, tracer = self.ids, self.tracer
            parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
                trace_id, parent_span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT)))) \
                if parent_span_id else None
            ids.trace_id, ids.span_id = trace_id, span_id
            root = tracer.start_span(name, parent, SpanKind.SERVER, attributes, start_time=start_ns)
            inside = trace.set_span_in_context(root)
            for step_name, step_id, client, started, ended, step_attributes, step_error in steps:
                ids.span_id = step_id
                span = tracer.start_span(step_name, inside, SpanKind.CLIENT if client else SpanKind.INTERNAL,
                                         step_attributes, start_time=started)
                if step_error:
                    span.set_status(Status(StatusCode.ERROR, step_error))
                span.end(end_time=ended or end_ns)
            if error:
                root.set_status(Status(StatusCode.ERROR, error))
            root.end(end_time=end_ns)
            self.replayed += 1
