"""The guard's HTTP paths that others scrape or probe, defined once.

vLLM listens on the pod's loopback only; everything reaches it through the
guard's port. The operator's PodMonitor, its replica reader and the local
Prometheus read vLLM's own metrics on ``ENGINE_METRICS_PATH``.
"""
from __future__ import annotations

GUARD_METRICS_PATH = "/metrics"          # gpufleet_guard_*
ENGINE_METRICS_PATH = "/metrics/engine"  # vLLM's /metrics, passed through unchanged (vllm:* and the rest)
# Where the engine listens inside the pod: only the guard (same network namespace) reaches it.
ENGINE_HOST = "127.0.0.1"
