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
IN_FLIGHT = PREFIX + "in_flight"
KV_FREE_BLOCKS = PREFIX + "kv_free_blocks"
KV_RESERVED_BLOCKS = PREFIX + "kv_reserved_blocks"
KV_TOTAL_BLOCKS = PREFIX + "kv_total_blocks"
KV_WATERMARK_BLOCKS = PREFIX + "kv_watermark_blocks"
ENGINE_UP = PREFIX + "engine_up"
READY = PREFIX + "ready"

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


REASONS = (Reason.KV_WATERMARK, Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL, Reason.CONTEXT_LENGTH,
           Reason.DRAINING, Reason.ENGINE_DOWN, Reason.INVALID_REQUEST)

# Refusals that mean "this replica is overloaded": another replica would have
# taken the request, so the autoscaler counts them as shedding.
SHED_REASONS = frozenset({Reason.KV_WATERMARK, Reason.QUEUE_TIMEOUT, Reason.QUEUE_FULL})
