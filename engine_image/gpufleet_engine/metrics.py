"""The guard's Prometheus metrics (``gpufleet_guard_*``), on a registry of their own.

Names, types and labels are the catalogue in ``docs/metrics.md``. Every
class × outcome and class × reason series is created at zero up front, so
rate() and absent() in alert rules work before the first failure.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("ok", "rejected", "invalid", "timeout", "cancelled", "error")
REASONS = ("kv_watermark", "queue_timeout", "queue_full", "context_length", "draining",
           "engine_down", "invalid_request")  # docs/metrics.md lists the same

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GuardMetrics:
    def __init__(self, classes: list[str], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("gpufleet_guard_requests", "Finished requests by class and outcome.",
                                ["class", "outcome"], registry=r)
        self.rejections = Counter("gpufleet_guard_rejections", "Requests refused by the guard, by reason.",
                                  ["class", "reason"], registry=r)
        self.queue_seconds = Histogram("gpufleet_guard_queue_seconds",
                                       "Time from arrival to dispatch to vLLM.", ["class"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("gpufleet_guard_ttft_seconds",
                                      "Time to first token as the client sees it (streaming requests).",
                                      ["class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl_seconds = Histogram("gpufleet_guard_itl_seconds",
                                     "Inter-chunk latency as the client sees it (streaming requests).",
                                     ["class"], buckets=_ITL_BUCKETS, registry=r)
        self.request_seconds = Histogram("gpufleet_guard_request_seconds",
                                         "End-to-end latency of admitted requests.", ["class"],
                                         buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_depth = Gauge("gpufleet_guard_queue_depth", "Requests waiting in the guard's queue.",
                                 ["class"], registry=r)
        self.max_concurrency = Gauge("gpufleet_guard_max_concurrency",
                                     "Most requests the guard dispatches to vLLM at once (maxConcurrency).",
                                     registry=r)
        self.in_flight = Gauge("gpufleet_guard_in_flight", "Requests dispatched to vLLM and not finished.",
                               registry=r)
        self.kv_free_blocks = Gauge("gpufleet_guard_kv_free_blocks",
                                    "Free KV blocks as the guard sees them.", registry=r)
        self.kv_reserved_blocks = Gauge("gpufleet_guard_kv_reserved_blocks",
                                        "Full block budgets of the guard's in-flight requests.", registry=r)
        self.kv_total_blocks = Gauge("gpufleet_guard_kv_total_blocks", "KV blocks in vLLM's pool.",
                                     registry=r)
        self.kv_watermark_blocks = Gauge("gpufleet_guard_kv_watermark_blocks",
                                         "KV blocks the guard keeps free.", registry=r)
        self.engine_up = Gauge("gpufleet_guard_engine_up",
                               "1 when vLLM answered the guard's last metrics read.", registry=r)
        self.ready = Gauge("gpufleet_guard_ready", "1 when the guard reports ready.", registry=r)
        for c in classes:
            for o in OUTCOMES:
                self.requests.labels(c, o)
            for reason in REASONS:
                self.rejections.labels(c, reason)
            self.queue_seconds.labels(c)
            self.ttft_seconds.labels(c)
            self.itl_seconds.labels(c)
            self.request_seconds.labels(c)
            self.queue_depth.labels(c)

    def render(self) -> bytes:
        return generate_latest(self.registry)
