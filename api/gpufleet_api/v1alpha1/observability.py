"""spec.observability: what the service's requests leave behind beyond metrics — traces (docs/tracing.md)."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..tracing import DEFAULT_SAMPLE_RATIO

DEFAULT_SAMPLED_PER_MILLE = round(DEFAULT_SAMPLE_RATIO * 1000)


class TracingSpec(Model, frozen=True, kw_only=True):
    """OpenTelemetry traces of the service's requests, sent to the fleet's OTLP endpoint (the chart's
    tracing.otlpEndpoint); without one the operator renders no tracing and says so in an Event."""
    mode: Annotated[Literal["On", "Off"], Meta(
        description="On: the guards trace requests (head sampling at sampledPerMille, plus every request "
                    "refused, failed or slower than the SLO).")] = "On"
    sampled_per_mille: Annotated[int, Meta(
        description="Requests traced from their start, per thousand (head sampling; a client's W3C traceparent "
                    "decides for its request). Refused, failed and SLO-missing requests are kept whatever this is.",
        ge=0, le=1000)] = DEFAULT_SAMPLED_PER_MILLE
    engine_spans: Annotated[Literal["On", "Off"], Meta(
        description="On: vLLM's own request spans (queue, prefill, decode, tokens) join the guard's "
                    "(vLLM's --otlp-traces-endpoint); needs an engine image whose vLLM has the OpenTelemetry "
                    "packages. Changing it restarts the engine pods.")] = "Off"


class ObservabilitySpec(Model, frozen=True, kw_only=True):
    tracing: Annotated[TracingSpec, Meta(
        description="Traces of the service's requests (docs/tracing.md).")] = msgspec.field(
        default_factory=TracingSpec)
