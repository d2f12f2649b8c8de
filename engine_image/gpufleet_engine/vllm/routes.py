"""Every HTTP route of the pinned vLLM's API server, and how the guard serves each.

Pure data. ``vllm_endpoints`` wires it into the guard's app and
``tests/unit/engine/test_route_table.py`` compares it with the routes vLLM
itself registers, so a route a new vLLM adds cannot go missing silently:
the test fails until the route is given a handling here.

docs/vllm-compat.md is this table for people.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from gpufleet_engine.admission.context import CHAT, COMPLETIONS, EMBEDDINGS

VLLM_VERSION = "0.32"


class Handling(enum.Enum):
    ADMITTED = "admitted"        # queued, KV blocks reserved, accounted: Guard.handle
    STATE = "state"              # vLLM's answer with the guard's state folded in
    PASSED = "passed"            # forwarded unchanged: no engine work to admit
    POD_ONLY = "pod-only"        # forwarded for the operator's token, or on the admin socket; else 401
    GUARD = "guard"              # the guard answers this path itself
    NOT_SERVED = "not-served"    # answered 404 in vLLM's format, with the reason


@dataclass(frozen=True)
class VllmRoute:
    path: str                     # as vLLM spells it, {name} for a path parameter
    methods: tuple[str, ...]
    handling: Handling
    reason: str
    # ADMITTED only: the proxied route whose queue class settings (defaultClassByRoute,
    # classHeaderPolicy) and output-length statistics the request shares.
    accounted_as: str | None = None

    def matches(self, path: str) -> bool:
        """Whether a request's ``path`` is this route (a {name} segment matches any one segment)."""
        return _PATTERNS[self.path].match(path) is not None


def _admitted(path: str, accounted_as: str, reason: str) -> VllmRoute:
    return VllmRoute(path, ("POST",), Handling.ADMITTED, reason, accounted_as)


_POD_ONLY = ("changes or inspects the engine's state (caches, sleep, weights, adapters, profiling, "
             "scaling); the operator's token on the guard's port, or the pod itself on the admin socket")
_RENDER = "renders a request into tokens in vLLM's API server; no engine work"
_PREFILL = "prefill only: the cost is the input's blocks, like /v1/embeddings"
_GENERIC = ("no request model of its own in the guard: every text in the body counts as prompt "
            "and max_tokens (else the rest of the context) as output, which over-reserves")
_AUDIO = ("audio input: its cost is not a token count the guard can make before vLLM decodes it, "
          "and gpufleet serves text models")

ROUTES: tuple[VllmRoute, ...] = (
    # Generation, admitted like /v1/completions.
    _admitted(CHAT, CHAT, "the chat template's token count plus max_tokens"),
    _admitted(COMPLETIONS, COMPLETIONS, "the prompt's token count plus max_tokens"),
    _admitted(EMBEDDINGS, EMBEDDINGS, "prefill only: the input's blocks"),
    _admitted("/v1/responses", CHAT, "instructions and input as chat messages plus max_output_tokens; "
              "a previous_response_id's stored history is not counted"),
    _admitted("/v1/messages", CHAT, "system and messages as chat messages plus max_tokens"),
    _admitted("/invocations", CHAT, "SageMaker: counted as the chat, completion or embedding request "
              "its body is"),
    _admitted("/inference/v1/generate", COMPLETIONS, "token_ids plus sampling_params.max_tokens"),
    _admitted("/v1/chat/completions/batch", CHAT, _GENERIC),
    _admitted("/v1/systemone", CHAT, _GENERIC),
    _admitted("/generative_scoring", COMPLETIONS, _GENERIC),
    _admitted("/cohere/v2/chat", CHAT, _GENERIC),
    _admitted("/pooling", EMBEDDINGS, _PREFILL),
    _admitted("/classify", EMBEDDINGS, _PREFILL),
    _admitted("/v2/embed", EMBEDDINGS, _PREFILL),
    _admitted("/score", EMBEDDINGS, "prefill only: each query-document pair"),
    _admitted("/v1/score", EMBEDDINGS, "prefill only: each query-document pair"),
    _admitted("/rerank", EMBEDDINGS, "prefill only: each query-document pair"),
    _admitted("/v1/rerank", EMBEDDINGS, "prefill only: each query-document pair"),
    _admitted("/v2/rerank", EMBEDDINGS, "prefill only: each query-document pair"),
    # Health and information, with the guard's state folded in.
    VllmRoute("/health", ("GET",), Handling.STATE,
              "503 while the guard would refuse work: draining, engine down, KV pool, tokenizer or context "
              "unknown; else vLLM's own answer"),
    VllmRoute("/ping", ("GET", "POST"), Handling.STATE, "SageMaker's health check: as /health"),
    VllmRoute("/load", ("GET",), Handling.STATE,
              "server_load: the requests the guard holds, running and queued (vLLM sees the running ones only)"),
    VllmRoute("/v1/models", ("GET",), Handling.STATE, "vLLM's list; 503 while the engine is down"),
    VllmRoute("/metrics", ("GET",), Handling.GUARD,
              "the guard's own metrics (gpufleet_guard_*); vLLM's are at /metrics/engine"),
    # No engine work: passed through as they are.
    VllmRoute("/version", ("GET",), Handling.PASSED, "static information"),
    VllmRoute("/kv_event_sources", ("GET",), Handling.PASSED, "where vLLM publishes KV-cache events"),
    VllmRoute("/tokenize", ("POST",), Handling.PASSED, "tokenization in vLLM's API server; no engine work"),
    VllmRoute("/detokenize", ("POST",), Handling.PASSED, "detokenization in vLLM's API server; no engine work"),
    VllmRoute("/tokenizer_info", ("GET",), Handling.PASSED, "static information"),
    VllmRoute("/v1/messages/count_tokens", ("POST",), Handling.PASSED, "tokenization; no engine work"),
    VllmRoute("/v1/chat/completions/render", ("POST",), Handling.PASSED, _RENDER),
    VllmRoute("/v1/completions/render", ("POST",), Handling.PASSED, _RENDER),
    VllmRoute("/v1/messages/render", ("POST",), Handling.PASSED, _RENDER),
    VllmRoute("/v1/responses/render", ("POST",), Handling.PASSED, _RENDER),
    VllmRoute("/v1/chat/completions/derender", ("POST",), Handling.PASSED, _RENDER),
    VllmRoute("/v1/completions/derender", ("POST",), Handling.PASSED, _RENDER),
    VllmRoute("/v1/responses/{response_id}", ("GET",), Handling.PASSED,
              "reads a stored response; the work was admitted when it was created"),
    VllmRoute("/v1/responses/{response_id}/cancel", ("POST",), Handling.PASSED,
              "cancels a stored response: frees work, adds none"),
    VllmRoute("/openapi.json", ("GET", "HEAD"), Handling.PASSED, "API documentation"),
    VllmRoute("/docs", ("GET", "HEAD"), Handling.PASSED, "API documentation"),
    VllmRoute("/docs/oauth2-redirect", ("GET", "HEAD"), Handling.PASSED, "API documentation"),
    VllmRoute("/redoc", ("GET", "HEAD"), Handling.PASSED, "API documentation"),
    # Administration: the operator's token on the guard's port, or the pod's admin socket.
    *(VllmRoute(path, (method,), Handling.POD_ONLY, _POD_ONLY) for method, path in (
        ("POST", "/reset_prefix_cache"), ("POST", "/reset_mm_cache"), ("POST", "/reset_encoder_cache"),
        ("POST", "/collective_rpc"), ("GET", "/server_info"), ("POST", "/sleep"),
        ("POST", "/release_kv_cache_memory"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
        ("POST", "/pause"), ("POST", "/resume"), ("POST", "/abort_requests"), ("GET", "/is_paused"),
        ("POST", "/init_weight_transfer_engine"), ("POST", "/shutdown_weight_transfer_engine"),
        ("POST", "/start_weight_update"), ("POST", "/start_draft_weight_update"), ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
        ("POST", "/weight_checker"), ("GET", "/get_world_size"), ("POST", "/scale_elastic_ep"),
        ("POST", "/is_scaling_elastic_ep"), ("POST", "/inference/v1/abort_requests"),
        ("POST", "/fault_tolerance/apply"), ("GET", "/fault_tolerance/status"),
        ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/start_profile"), ("POST", "/stop_profile"), ("POST", "/adapters"),
        ("DELETE", "/adapters/{adapter_name}"))),
    # Not served through the guard.
    VllmRoute("/v1/audio/transcriptions", ("POST",), Handling.NOT_SERVED, _AUDIO),
    VllmRoute("/v1/audio/translations", ("POST",), Handling.NOT_SERVED, _AUDIO),
    VllmRoute("/v1/realtime", ("WEBSOCKET",), Handling.NOT_SERVED, _AUDIO),
)


_PATTERNS = {r.path: re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(r.path)) + "$")
             for r in ROUTES}


def find(path: str) -> list[VllmRoute]:
    """The table's routes whose path matches ``path`` (a request's), any method."""
    return [r for r in ROUTES if r.matches(path)]


def allowed_methods(path: str) -> set[str]:
    """The methods vLLM accepts on ``path``: empty when vLLM has no such route."""
    return {m for r in find(path) for m in r.methods if m != "WEBSOCKET"}
