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
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping, Optional

from gpufleet_api.tracing import KEPT, TracingConfig, http_traces_url

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

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
    """A process's tracing: ``begin`` one ``RequestTrace`` per request."""
    tracer: Optional[Tracer] = None
    provider: Optional[TracerProvider] = None

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

        from .tail_sampling import HeadSampler, TailKeepProcessor
        provider = TracerProvider(sampler=HeadSampler(config.sample_ratio), resource=Resource.create(
            {"service.name": service_name, **(resource_attributes or {})}))
        if exporter is None:
            problem = otlp_problem()
            if problem is not None:
                raise TracingUnavailable(f"tracing is configured (endpoint {config.endpoint}) but this build "
                                         f"cannot export spans: {problem}; install opentelemetry-sdk and "
                                         f"opentelemetry-exporter-otlp, or remove tracing")
            exporter = otlp_exporter(config)
        exporting: SpanProcessor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(TailKeepProcessor(exporting))
        return cls(provider.get_tracer("gpufleet"), provider)

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
        from opentelemetry.trace import SpanKind
        context = extract(headers) if headers is not None and TRACEPARENT in headers else None
        root = tracer.start_span(name, context, SpanKind.SERVER, attributes,
                                 start_time=_ns(start) if start is not None else None)
        return RequestTrace(tracer, root)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.provider.force_flush(timeout_millis) if self.provider is not None else True


def extract(headers: Mapping[str, str]) -> Any:
    """The W3C trace context of incoming ``headers`` (aiohttp's are case-insensitive)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier = {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if k in headers}
    return TraceContextTextMapPropagator().extract(carrier)


class TracingUnavailable(RuntimeError):
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
