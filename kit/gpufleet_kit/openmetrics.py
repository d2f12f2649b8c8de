"""A process's /metrics body in the format its scraper asks for: OpenMetrics when the ``Accept`` header
names it (the only format that carries the latency histograms' exemplars, docs/tracing.md), Prometheus'
text format otherwise. The guard and the router serve their registries through it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(the body, its Content-Type) for a scrape whose ``Accept`` header is ``accept``."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
