"""The guard's metric names, request outcomes and refusal reasons.

The guard exports them (``gpufleet_engine.metrics``) and answers refusals with
the reason as the error ``code``; the operator's autoscaler parses them from
each replica's /metrics; docs/metrics.md, the alert rules and the dashboards
use the same names (tests check all three).
"""
from __future__ import annotations

PREFIX = "gpufleet_guard_"

REQUESTS = PREFIX + "requests"                # counter: exported as ..._total
REJECTIONS = PREFIX + "rejections"            # counter: exported as ..._total
QUEUE_SECONDS = PREFIX + "queue_seconds"
TTFT_SECONDS = PREFIX + "ttft_seconds"
ITL_SECONDS = PREFIX + "itl_seconds"
REQUEST_SECONDS = PREFIX + "request_seconds"
QUEUE_DEPTH = PREFIX + "queue_depth"
MAX_CONCURRENCY = PREFIX + "max_concurrency"
# The concurrency in force: max_concurrency, or less while the TTFT control holds it down.
CONCURRENCY_LIMIT = PREFIX + "concurrency_limit"
IN_FLIGHT = PREFIX + "in_flight"
# Of those, the ones whose first token has gone out: a stream cut now is cut mid-answer.
IN_FLIGHT_ANSWERING = PREFIX + "in_flight_answering"
KV_FREE_BLOCKS = PREFIX + "kv_free_blocks"
KV_RESERVED_BLOCKS = PREFIX + "kv_reserved_blocks"
KV_TOTAL_BLOCKS = PREFIX + "kv_total_blocks"
KV_WATERMARK_BLOCKS = PREFIX + "kv_watermark_blocks"
ENGINE_UP = PREFIX + "engine_up"
READY = PREFIX + "ready"
OUTPUT_TOKENS = PREFIX + "output_tokens"                      # histogram: the learned distribution
OUTPUT_TOKENS_PREDICTED = PREFIX + "output_tokens_predicted"  # gauge: the reservation quantile now
OUTPUT_PREDICTION_RATIO = PREFIX + "output_prediction_ratio"  # histogram: actual / reserved output
RESERVATION_EXTENSIONS = PREFIX + "reservation_extensions"    # counter: answers that outgrew a reservation
# Requests sent on to vLLM ahead of their parse (serving/send_ahead.py), by outcome: kept (the copy sent was the
# request served) or aborted (vLLM's copy closed: the parse refused it, changed it or needed more).
SENT_AHEAD = PREFIX + "sent_ahead"                            # counter: exported as ..._total
SENT_AHEAD_OUTCOMES = ("kept", "aborted")
# Service-level indicators counted at the source: events judged against the
# service's objectives (guard.json's ``slo``), good ones among them.
SLI_EVENTS = PREFIX + "sli_events"                            # counter: exported as ..._total
SLI_GOOD_EVENTS = PREFIX + "sli_good_events"                  # counter: exported as ..._total
# guard.json re-read while running (reload.py), by result: applied or invalid (refused, old kept).
CONFIG_RELOADS = PREFIX + "config_reloads"                    # counter: exported as ..._total
# 1 when the mounted guard.json changes fields that only a new pod applies.
CONFIG_RESTART_PENDING = PREFIX + "config_restart_pending"
# The share of the KV blocks in use that hold no token of an in-flight request
# (1 - tokens held / (blocks in use x block size)); absent when the guard does
# not know every in-flight sequence's length.
KV_WASTE_RATIO = PREFIX + "kv_waste_ratio"

# What this pod does in its service (guard.json ``role``): one series, value 1, labelled role =
# unified, prefill or decode; join it on ``pod`` to split any guard series by role.
ROLE_INFO = PREFIX + "role_info"
# Requests admitted that take part in a prefill/decode hand-off (admission/kv_handoff.py), by
# phase (prefill: hands its KV on; decode: arrived with kv_transfer_params) and outcome.
KV_HANDOFFS = PREFIX + "kv_handoffs"                          # counter: exported as ..._total
KV_HANDOFF_PHASES = ("prefill", "decode")
KV_HANDOFF_OUTCOMES = ("ok", "invalid", "timeout", "cancelled", "error")
# The shared-storage connector's directory on a pod that writes it (vllm/shared_storage.py): its
# prompt folders' bytes after the last pass, and the folders removed past the limit.
KV_STORAGE_BYTES = PREFIX + "kv_storage_bytes"
KV_STORAGE_REMOVED_PROMPTS = PREFIX + "kv_storage_removed_prompts"  # counter: exported as ..._total

# LoRA adapters on this replica (serving/adapters.py, vllm/lora_stats.py). The ``adapter`` label
# takes at most engine.lora.maxAdapters values (the adapters this replica holds); requests for the
# base model carry no adapter series.
ADAPTER_STATE = PREFIX + "adapter_state"            # gauge 1 per adapter, label state (ADAPTER_STATES)
ADAPTER_REQUESTS = PREFIX + "adapter_requests"      # counter {adapter, outcome}: exported as ..._total
ADAPTER_TOKENS = PREFIX + "adapter_tokens"          # counter {adapter, kind=prompt|generation}: ..._total
ADAPTER_TTFT_SECONDS = PREFIX + "adapter_ttft_seconds"  # histogram {adapter}
# Inside vLLM's engine (the plugin counts them): an adapter read from disk into the CPU-side cache
# (--max-cpu-loras), one dropped from that cache to make room, one moved into a GPU slot (--max-loras).
ADAPTER_LOADS = PREFIX + "adapter_loads"            # counter {adapter}: exported as ..._total
ADAPTER_EVICTIONS = PREFIX + "adapter_evictions"    # counter {adapter}: exported as ..._total
ADAPTER_ACTIVATIONS = PREFIX + "adapter_activations"  # counter {adapter}: exported as ..._total
ADAPTER_LOAD_FAILURES = PREFIX + "adapter_load_failures"  # counter {adapter, reason}: ..._total
ADAPTER_STATES = ("Fetching", "Loading", "Loaded", "Failed", "Unloading")
ADAPTER_TOKEN_KINDS = ("prompt", "generation")

# GPU memory from inside vLLM's processes, per device (``device`` label): the
# vLLM plugin's reports (contract.gpu_memory), exported by the guard.
GPU_MEMORY_PREFIX = "gpufleet_engine_gpu_memory_"
GPU_MEMORY_RESERVED_BYTES = GPU_MEMORY_PREFIX + "reserved_bytes"
GPU_MEMORY_ALLOCATED_BYTES = GPU_MEMORY_PREFIX + "allocated_bytes"
GPU_MEMORY_ACTIVE_BYTES = GPU_MEMORY_PREFIX + "active_bytes"
GPU_MEMORY_INACTIVE_SPLIT_BYTES = GPU_MEMORY_PREFIX + "inactive_split_bytes"
GPU_MEMORY_FREE_BYTES = GPU_MEMORY_PREFIX + "free_bytes"
GPU_MEMORY_TOTAL_BYTES = GPU_MEMORY_PREFIX + "total_bytes"
GPU_MEMORY_FRAGMENTATION_RATIO = GPU_MEMORY_PREFIX + "fragmentation_ratio"
GPU_MEMORY_REPORT_AGE_SECONDS = GPU_MEMORY_PREFIX + "report_age_seconds"
GPU_MEMORY_ALLOC_RETRIES = GPU_MEMORY_PREFIX + "alloc_retries"   # counter: exported as ..._total
GPU_MEMORY_OOMS = GPU_MEMORY_PREFIX + "ooms"                     # counter: exported as ..._total



class SLI:
    """The ``sli`` label: what one event is and when it is good."""
    TTFT = "ttft"                  # a streaming request: its first token within slo.ttftP99Seconds
    ITL = "itl"                    # a gap between streamed chunks: within slo.itlP99Seconds
    LATENCY = "latency"            # a non-streaming request: answered within slo.requestP99Seconds
    AVAILABILITY = "availability"  # a request the service had to serve: it did, without 5xx or timeout


SLIS = (SLI.TTFT, SLI.ITL, SLI.LATENCY, SLI.AVAILABILITY)

OUTCOMES = ("ok", "rejected", "invalid", "timeout", "cancelled", "error")


class Reason:
    """Why the guard refused a request: the ``reason`` label and the error ``code``."""
    KV_WATERMARK = "kv_watermark"
    QUEUE_TIMEOUT = "queue_timeout"
    QUEUE_FULL = "queue_full"
    CONTEXT_LENGTH = "context_length"
    DRAINING = "draining"
    ENGINE_DOWN = "engine_down"
    INVALID_REQUEST = "invalid_request"
    # The request's reservation is larger than the whole KV pool: no replica
    # of this size could ever run it, so adding replicas would not help.
    EXCEEDS_KV_POOL = "exceeds_kv_pool"
    REQUEST_TOO_LARGE = "request_too_large"  # the body is over the size limit (413)
    # Every slot the TTFT control allows is taken and the request would wait
    # for one longer than the TTFT objective leaves (ttft_limit.py).
    TTFT_LIMIT = "ttft_limit"
    # The body did not fit in the request-body bytes held at once (the guard's bodyBudgetBytes, the
    # router's --body-budget-bytes): 503 with Retry-After. Not a shed: it is about bytes held, not KV,
    # and a flood of large bodies must not scale GPUs out. The router answers it with this code too.
    BODY_BUDGET = "body_budget"


REASONS = (Reason.KV_WATERMARK, Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL, Reason.CONTEXT_LENGTH,
           Reason.DRAINING, Reason.ENGINE_DOWN, Reason.INVALID_REQUEST, Reason.EXCEEDS_KV_POOL,
           Reason.REQUEST_TOO_LARGE, Reason.TTFT_LIMIT, Reason.BODY_BUDGET)

# Refusals that mean "this replica is overloaded": another replica would have
# taken the request, so the autoscaler counts them as shedding. A request that
# cannot fit even an empty replica (EXCEEDS_KV_POOL) is not: scaling out
# would only add replicas that refuse it too.
SHED_REASONS = frozenset({Reason.KV_WATERMARK, Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL, Reason.TTFT_LIMIT})
