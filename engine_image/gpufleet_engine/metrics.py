"""The guard's Prometheus metrics (``gpufleet_guard_*``), on a registry of their own.

Names, types and labels are the catalogue in ``docs/metrics.md``. Every
class × outcome and class × reason series is created at zero up front, so
rate() and absent() in alert rules work before the first failure.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .contract import guard_metrics as m
from .contract.guard_metrics import OUTCOMES, REASONS

__all__ = ["CONTENT_TYPE", "OUTCOMES", "REASONS", "GuardMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GuardMetrics:
    def __init__(self, classes: list[str], registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(m.REQUESTS, "Finished requests by class and outcome.",
                                ["class", "outcome"], registry=r)
        self.rejections = Counter(m.REJECTIONS, "Requests refused by the guard, by reason.",
                                  ["class", "reason"], registry=r)
        self.queue_seconds = Histogram(m.QUEUE_SECONDS,
                                       "Time from arrival to dispatch to vLLM.", ["class"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram(m.TTFT_SECONDS,
                                      "Time to first token as the client sees it (streaming requests).",
                                      ["class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl_seconds = Histogram(m.ITL_SECONDS,
                                     "Inter-chunk latency as the client sees it (streaming requests).",
                                     ["class"], buckets=_ITL_BUCKETS, registry=r)
        self.request_seconds = Histogram(m.REQUEST_SECONDS,
                                         "End-to-end latency of admitted requests.", ["class"],
                                         buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_depth = Gauge(m.QUEUE_DEPTH, "Requests waiting in the guard's queue.",
                                 ["class"], registry=r)
        self.max_concurrency = Gauge(m.MAX_CONCURRENCY,
                                     "Most requests the guard dispatches to vLLM at once (maxConcurrency).",
                                     registry=r)
        self.in_flight = Gauge(m.IN_FLIGHT, "Requests dispatched to vLLM and not finished.",
                               registry=r)
        self.kv_free_blocks = Gauge(m.KV_FREE_BLOCKS,
                                    "Free KV blocks as the guard sees them.", registry=r)
        self.kv_reserved_blocks = Gauge(m.KV_RESERVED_BLOCKS,
                                        "Full block budgets of the guard's in-flight requests.", registry=r)
        self.kv_total_blocks = Gauge(m.KV_TOTAL_BLOCKS, "KV blocks in vLLM's pool.",
                                     registry=r)
        self.kv_watermark_blocks = Gauge(m.KV_WATERMARK_BLOCKS,
                                         "KV blocks the guard keeps free.", registry=r)
        self.engine_up = Gauge(m.ENGINE_UP,
                               "1 when vLLM answered the guard's last metrics read.", registry=r)
        self.ready = Gauge(m.READY, "1 when the guard reports ready.", registry=r)
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
