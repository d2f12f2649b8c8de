"""Traces (docs/tracing.md): the settings a process's tracing is set up from, and the span and
attribute names every hop writes. Pure: the SDK set-up is the kit's (``gpufleet_kit.tracing``).

One source for the names: the guard and the router write them, the docs and the tests read them.
Attributes follow OpenTelemetry's GenAI semantic conventions where one exists (``gen_ai.*``);
the rest are gpufleet's (``gpufleet.*``). No prompt or answer text is ever an attribute.
"""
from __future__ import annotations

import typing
from typing import Annotated, Literal

from msgspec import Meta

from . import typed

OtlpProtocol = Literal["http/protobuf", "grpc"]
OTLP_PROTOCOLS = typing.get_args(OtlpProtocol)
# Head sampling when the spec names no ratio: one request in a hundred, plus every request the
# tail rule keeps (refused, errored, resumed, fell back, missed its objective).
DEFAULT_SAMPLE_RATIO = 0.01


class TracingConfig(typed.Model, frozen=True, forbid_unknown_fields=True):
    """Where a process sends its spans and how many requests it traces.

    ``endpoint``: the OTLP receiver (``http://collector:4318`` for http/protobuf, ``collector:4317``
    for grpc); the path ``/v1/traces`` is added for http/protobuf when absent.
    ``sample_ratio``: the share of requests traced from their start (head sampling, parent-based: a
    request that arrives with a W3C ``traceparent`` follows its sampled flag).
    ``engine_spans``: vLLM's own spans (``--otlp-traces-endpoint``) join the guard's.
    """
    endpoint: Annotated[str, Meta(min_length=1)]
    protocol: OtlpProtocol = "http/protobuf"
    sample_ratio: Annotated[float, Meta(ge=0, le=1)] = DEFAULT_SAMPLE_RATIO
    engine_spans: bool = False


def http_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of ``endpoint`` (``/v1/traces`` added to a bare host:port)."""
    base = endpoint if "://" in endpoint else f"http://{endpoint}"
    return base if base.rstrip("/").endswith("/v1/traces") else base.rstrip("/") + "/v1/traces"


# Resource service.name of each process that exports spans.
GUARD_SERVICE_NAME = "gpufleet-guard"
ROUTER_SERVICE_NAME = "gpufleet-router"

# Span names, one per hop's step.
GUARD_REQUEST_SPAN = "guard.request"      # the guard's server span: the request from arrival to its end
GUARD_ADMISSION_SPAN = "guard.admission"  # from the parse to the grant: reservation, queue wait
GUARD_ENGINE_SPAN = "guard.vllm"          # the exchange with vLLM (a client span: vLLM's spans are its children)
ROUTER_REQUEST_SPAN = "router.request"    # the router's server span: the request from arrival to its end
ROUTER_REPLICA_SPAN = "router.replica"    # one send to a replica's guard, from its pick (a client span: the guard's
#                                           spans are its children); a refusal or failure ends it in an error
ROUTER_HOLD_SPAN = "router.hold"          # held for a replica through a cold start
ROUTER_PREFILL_SPAN = "router.prefill"    # a disaggregated request's prefill step, to the hand-off or the fallback
ROUTER_RESUME_SPAN = "router.resume"      # a stream continued after its replica broke off mid-answer
EPP_PICK_SPAN = "router.epp.pick"         # the endpoint picker's decision for a gateway's request: the guard's
#                                           spans are its children (its context in the gateway's header mutation)
# vLLM's own (engineSpans On): its request span, a child of the guard's exchange span, and the service name the
# entrypoint gives its spans (OTEL_SERVICE_NAME; vLLM sets none of its own).
ENGINE_REQUEST_SPAN = "llm_request"
ENGINE_SERVICE_NAME = "vllm"
# Attributes of vLLM's request span (vLLM's SpanAttributes), in seconds: where the time inside vLLM went.
ENGINE_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
ENGINE_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
ENGINE_PREFILL_SECONDS = "gen_ai.latency.time_in_model_prefill"
ENGINE_DECODE_SECONDS = "gen_ai.latency.time_in_model_decode"
ENGINE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"

# OpenTelemetry GenAI semantic conventions.
GEN_AI_OPERATION = "gen_ai.operation.name"        # chat, text_completion, embeddings
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
HTTP_STATUS = "http.response.status_code"
HTTP_ROUTE = "http.route"
ERROR_TYPE = "error.type"

# gpufleet's own.
SERVICE = "gpufleet.service"
CLASS = "gpufleet.class"
TENANT = "gpufleet.tenant"
STREAM = "gpufleet.request.stream"
RESERVED_BLOCKS = "gpufleet.kv.reserved_blocks"
QUEUE_WAIT_SECONDS = "gpufleet.queue.wait_seconds"
REFUSAL_REASON = "gpufleet.refusal.reason"
TTFT_SECONDS = "gpufleet.ttft_seconds"
OUTCOME = "gpufleet.outcome"
ADAPTER = "gpufleet.adapter"
# The router's.
REPLICA = "gpufleet.replica"                 # the pod a send went to
ROLE = "gpufleet.role"                       # its pool: unified, prefill or decode
PICK_REASON = "gpufleet.pick.reason"         # why that replica (policy/choice.py's Reason)
PICK_CANDIDATES = "gpufleet.pick.candidates"  # the replicas it was picked among (pod names)
ATTEMPT = "gpufleet.attempt"                 # the how-manieth send of this request to the pool (1 first)
RETRY_REASON = "gpufleet.retry.reason"       # why this send is a retry: rejected, connect_failed, scale_out
FALLBACK_REASON = "gpufleet.prefill.fallback"  # the P/D hand-off skipped: decode computed the prompt (why)
TRANSFER_PARAMS = "gpufleet.prefill.transfer_params"  # the hand-off carried kv_transfer_params or not
HOLD_SECONDS = "gpufleet.hold.seconds"
RESUME_GAP_SECONDS = "gpufleet.resume.gap_seconds"  # from the break to the continuing replica's first event
BROKEN_REPLICA = "gpufleet.resume.broken_replica"
RESUMPTION = "gpufleet.resume.outcome"       # resumed, refused, failed (the router's resumed_streams outcome)
# Set on a request's local root span by the tail rule: why it was kept though head sampling dropped it.
KEPT = "gpufleet.trace.kept"

# The tail rule's reasons (``KEPT``'s values).
KeepReason = Literal["refused", "error", "resumed", "fallback", "slo"]
KEEP_REASONS = typing.get_args(KeepReason)

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/embeddings": "embeddings"}
