"""OpenTelemetry traces for a gpufleet process: set up from ``TracingConfig``, one ``RequestTrace`` a
request, W3C context in and out of aiohttp headers, and nothing at all when tracing is off.

``Tracing.start(config, service_name)`` builds the SDK's provider (OTLP over HTTP or gRPC, the
head sampler and the tail rule of ``tail_sampling``); ``Tracing.off()`` is the one without spans,
whose ``begin`` returns ``NO_TRACE``, every method of which does nothing: a process with tracing
off pays an attribute read and a call per hook, and never imports the SDK.

A request's spans are started and ended explicitly, never made "current": the request path is
asyncio code, and attaching a context on every await would cost more than the spans.
"""
from __future__ import annotations

import contextvars
import random
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping, Optional

from gpufleet_api.tracing import KEPT, TracingConfig, http_traces_url

from .errors import KitError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from .tail_sampling import Replayer

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


class RequestTrace:
    """The spans of one request at one hop: a root span (the hop's server span) and the steps
    inside it. ``keep`` is the tail rule: the request is exported though head sampling dropped it."""

    __slots__ = ("_tracer", "root", "kept", "_step")

    def __init__(self, tracer: Tracer, root: Span):
        self._tracer = tracer
        self.root = root
        self.kept = ""
        self._step: Span | None = None

    @property
    def on(self) -> bool:
        return True

    def set(self, key: str, value: Any) -> None:
        self.root.set_attribute(key, value)

    def set_all(self, attributes: Mapping[str, Any]) -> None:
        self.root.set_attributes(attributes)

    def keep(self, reason: str) -> None:
        """Keep this request's trace whatever head sampling decided (the first reason wins)."""
        if not self.kept:
            self.kept = reason
            self.root.set_attribute(KEPT, reason)

    def step(self, name: str, attributes: Mapping[str, Any] | None = None, client: bool = False,
             start: float | None = None) -> Span:
        """A child span of the root, started now (or at ``start``, a ``time.monotonic`` reading);
        the caller ends it (``end_step``). ``client``: a call to another process, whose context
        ``inject`` then passes on."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        span = self._tracer.start_span(name, trace.set_span_in_context(self.root), kind, attributes,
                                       start_time=_ns(start) if start is not None else None)
        self._step = span
        return span

    def end_step(self, span: Span, attributes: Mapping[str, Any] | None = None, error: str = "") -> None:
        if attributes:
            span.set_attributes(attributes)
        if error:
            from opentelemetry.trace import Status, StatusCode
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
        if self._step is span:
            self._step = None

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """W3C ``traceparent`` (and ``tracestate``) of the open client step, else of the root."""
        span = self._step or self.root
        context = span.get_span_context()
        # Only the sampled flag: W3C level 1, which every hop after us reads.
        headers[TRACEPARENT] = (f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                                f"{'01' if context.trace_flags.sampled else '00'}")
        if context.trace_state:
            headers[TRACESTATE] = context.trace_state.to_header()
        else:
            headers.pop(TRACESTATE, None)

    def exemplar(self) -> dict[str, str] | None:
        """The trace id as a Prometheus exemplar's label, for a request whose trace is exported
        (head sampled, or kept by the tail rule so far); None otherwise."""
        context = self.root.get_span_context()
        if context.trace_flags.sampled or self.kept:
            return {"trace_id": f"{context.trace_id:032x}"}
        return None

    @property
    def trace_id(self) -> str:
        return f"{self.root.get_span_context().trace_id:032x}"

    def end(self, attributes: Mapping[str, Any] | None = None, error: str = "") -> None:
        """End the root: the tail rule decides here for a request head sampling dropped."""
        if self._step is not None:
            self._step.end()
            self._step = None
        self.end_step(self.root, attributes, error)


class _NoTrace(RequestTrace):
    """Tracing off: every hook does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        self.kept = ""

    @property
    def on(self) -> bool:
        return False

    def set(self, key: str, value: Any) -> None:
        pass

    def set_all(self, attributes: Mapping[str, Any]) -> None:
        pass

    def keep(self, reason: str) -> None:
        pass

    def step(self, name: str, attributes: Mapping[str, Any] | None = None, client: bool = False,
             start: float | None = None) -> Any:
        return None

    def end_step(self, span: Any, attributes: Mapping[str, Any] | None = None, error: str = "") -> None:
        pass

    def inject(self, headers: MutableMapping[str, str]) -> None:
        pass

    def exemplar(self) -> None:
        return None

    @property
    def trace_id(self) -> str:
        return ""

    def end(self, attributes: Mapping[str, Any] | None = None, error: str = "") -> None:
        pass


NO_TRACE: RequestTrace = _NoTrace()


class _Recorded:
    """A step of a recorded request (``RecordedTrace``)."""
    __slots__ = ("name", "span_id", "client", "start_ns", "end_ns", "attributes", "error")

    def __init__(self, name: str, client: bool, start_ns: int, attributes: Mapping[str, Any] | None):
        self.name, self.client, self.start_ns = name, client, start_ns
        self.span_id = random.getrandbits(64)
        self.end_ns = 0
        self.attributes = dict(attributes) if attributes else {}
        self.error = ""


class RecordedTrace(RequestTrace):
    """A request head sampling dropped: its spans recorded as plain objects, at a fraction of the
    SDK's cost, and dropped at its end unless the tail rule kept it, which replays them into the
    exporter (``tail_sampling.Replayer``) with the ids and times they had. Its ``traceparent``
    goes on unsampled."""

    __slots__ = ("_replayer", "_trace_id", "_span_id", "_parent_span_id", "_tracestate", "_name", "_start_ns",
                 "_attributes", "_steps", "_open")

    def __init__(self, replayer: Replayer, name: str, trace_id: int, parent_span_id: int, tracestate: str,
                 attributes: Mapping[str, Any] | None, start_ns: int):
        self._replayer = replayer
        self._trace_id, self._parent_span_id, self._tracestate = trace_id, parent_span_id, tracestate
        self._span_id = random.getrandbits(64)
        self._name, self._start_ns = name, start_ns
        self._attributes: dict[str, Any] = dict(attributes) if attributes else {}
        self._steps: list[_Recorded] = []
        self._open: _Recorded | None = None
        self.kept = ""

    def set(self, key: str, value: Any) -> None:
        self._attributes[key] = value

    def set_all(self, attributes: Mapping[str, Any]) -> None:
        self._attributes.update(attributes)

    def keep(self, reason: str) -> None:
        """Kept, if the tail rule's budget a second has room (``tail_sampling.KEPT_PER_SECOND``)."""
        if not self.kept and self._replayer.admit():
            self.kept = reason
            self._attributes[KEPT] = reason

    def step(self, name: str, attributes: Mapping[str, Any] | None = None, client: bool = False,
             start: float | None = None) -> Any:
        step = _Recorded(name, client, _ns(start) if start is not None else time.time_ns(), attributes)
        self._steps.append(step)
        self._open = step
        return step

    def end_step(self, span: Any, attributes: Mapping[str, Any] | None = None, error: str = "") -> None:
        if span is None:
            return
        if attributes:
            span.attributes.update(attributes)
        span.error = error
        span.end_ns = time.time_ns()
        if self._open is span:
            self._open = None

    def inject(self, headers: MutableMapping[str, str]) -> None:
        span_id = self._open.span_id if self._open is not None else self._span_id
        headers[TRACEPARENT] = f"00-{self._trace_id:032x}-{span_id:016x}-00"
        if self._tracestate:
            headers[TRACESTATE] = self._tracestate
        else:
            headers.pop(TRACESTATE, None)

    def exemplar(self) -> dict[str, str] | None:
        return {"trace_id": f"{self._trace_id:032x}"} if self.kept else None

    @property
    def trace_id(self) -> str:
        return f"{self._trace_id:032x}"

    def end(self, attributes: Mapping[str, Any] | None = None, error: str = "") -> None:
        if not self.kept:
            return
        if attributes:
            self._attributes.update(attributes)
        self._replayer.replay(
            trace_id=self._trace_id, span_id=self._span_id, parent_span_id=self._parent_span_id, name=self._name,
            start_ns=self._start_ns, end_ns=time.time_ns(), attributes=self._attributes, error=error,
            steps=[(s.name, s.span_id, s.client, s.start_ns, s.end_ns, s.attributes, s.error) for s in self._steps])


# W3C trace context, version 00: trace id, parent span id, flags (sampled: the low bit).
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
# The request a task serves: set once where the request arrives, read where a step of it happens
# (tasks started for the request inherit it), so no signature on the way needs a trace argument.
_CURRENT: contextvars.ContextVar[RequestTrace] = contextvars.ContextVar("gpufleet_trace", default=NO_TRACE)


def current() -> RequestTrace:
    """The trace of the request this task serves (``NO_TRACE`` outside one, or with tracing off)."""
    return _CURRENT.get()


def bind(trace: RequestTrace) -> contextvars.Token[RequestTrace]:
    """Make ``trace`` the current request's for this task and those it starts (``unbind`` after)."""
    return _CURRENT.set(trace)


def unbind(token: contextvars.Token[RequestTrace]) -> None:
    _CURRENT.reset(token)


@dataclass
class Tracing:
    """A process's tracing: ``begin`` one ``RequestTrace`` per request.

    Head sampling here, not in the SDK's sampler: a request with a valid W3C ``traceparent`` follows
    its sampled flag, one without is sampled at ``ratio``. A sampled request gets the SDK's spans;
    a dropped one a ``RecordedTrace``, which the tail rule may still keep."""
    tracer: Optional[Tracer] = None
    provider: Optional[TracerProvider] = None
    ratio: float = 0.0
    replayer: Optional[Replayer] = None

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    @classmethod
    def start(cls, config: TracingConfig | None, service_name: str,
              resource_attributes: Mapping[str, str] | None = None,
              exporter: SpanExporter | None = None, batch: bool = True) -> Tracing:
        """Tracing per ``config`` (None: off). ``exporter``: instead of OTLP to ``config.endpoint``
        (tests: an in-memory one). ``batch``: export from a background thread in batches (False:
        each span as it ends, for tests)."""
        if config is None:
            return cls.off()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        from .tail_sampling import PresetIds, Replayer
        resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
        # Every span that reaches the SDK is sampled: ``begin`` decided before.
        provider = TracerProvider(sampler=ALWAYS_ON, resource=resource)
        ids = PresetIds()
        # Its processor is the main provider's, which shuts it down (at exit too).
        replaying = TracerProvider(sampler=ALWAYS_ON, resource=resource, id_generator=ids, shutdown_on_exit=False)
        if exporter is None:
            problem = otlp_problem()
            if problem is not None:
                raise TracingUnavailable(f"tracing is configured (endpoint {config.endpoint}) but this build "
                                         f"cannot export spans: {problem}; install opentelemetry-sdk and "
                                         f"opentelemetry-exporter-otlp, or remove tracing")
            exporter = otlp_exporter(config)
        exporting: SpanProcessor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(exporting)
        replaying.add_span_processor(exporting)
        return cls(provider.get_tracer("gpufleet"), provider, config.sample_ratio,
                   Replayer(replaying.get_tracer("gpufleet"), ids))

    @property
    def on(self) -> bool:
        return self.tracer is not None

    def begin(self, name: str, headers: Mapping[str, str] | None = None,
              attributes: Mapping[str, Any] | None = None, start: float | None = None) -> RequestTrace:
        """The server span of a request that arrived with ``headers`` (its W3C context honoured);
        ``start``: its arrival, a ``time.monotonic`` reading."""
        tracer = self.tracer
        if tracer is None:
            return NO_TRACE
        parent = headers.get(TRACEPARENT) if headers is not None else None
        found = _TRACEPARENT.fullmatch(parent.strip().lower()) if parent else None
        if found is not None and (found[1] == "0" * 32 or found[2] == "0" * 16):
            found = None  # invalid ids: a new trace (W3C)
        sampled = bool(int(found[3], 16) & 1) if found is not None else random.random() < self.ratio
        if sampled:
            from opentelemetry.trace import SpanKind
            context = extract(headers) if found is not None and headers is not None else None
            root = tracer.start_span(name, context, SpanKind.SERVER, attributes,
                                     start_time=_ns(start) if start is not None else None)
            return RequestTrace(tracer, root)
        assert self.replayer is not None
        tracestate = (headers.get(TRACESTATE) or "") if found is not None and headers is not None else ""
        return RecordedTrace(self.replayer, name, int(found[1], 16) if found else random.getrandbits(128),
                             int(found[2], 16) if found else 0, tracestate, attributes,
                             _ns(start) if start is not None else time.time_ns())

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()   # the exporting processor, shared with the replayer's provider

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.provider.force_flush(timeout_millis) if self.provider is not None else True


def extract(headers: Mapping[str, str]) -> Any:
    """The W3C trace context of incoming ``headers`` (aiohttp's are case-insensitive)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier = {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if k in headers}
    return TraceContextTextMapPropagator().extract(carrier)


class TracingUnavailable(KitError):
    """Tracing is configured and this build cannot export spans."""


# What exporting over OTLP imports: the SDK and both exporters. vLLM's --otlp-traces-endpoint needs
# the same (vllm/tracing/otel.py refuses the flag when any of them does not import).
OTLP_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")


def otlp_problem() -> str | None:
    """Why spans cannot be exported over OTLP from this Python (None: they can)."""
    import importlib
    for module in OTLP_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"{module} does not import ({e})"
    return None


def otlp_exporter(config: TracingConfig) -> SpanExporter:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        return Grpc(endpoint=config.endpoint, insecure=not config.endpoint.startswith("https://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    return Http(endpoint=http_traces_url(config.endpoint))


_WALL_MINUS_MONOTONIC = time.time_ns() - time.monotonic_ns()


def _ns(monotonic: float) -> int:
    """A ``time.monotonic`` reading as the wall-clock nanoseconds spans take."""
    return int(monotonic * 1e9) + _WALL_MINUS_MONOTONIC
