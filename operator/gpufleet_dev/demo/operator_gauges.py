"""The operator's per-second figures for the demo's live display, read from its /metrics. Pure.

Status has a service's KV usage only every --status-figures-interval-seconds (docs/metrics.md,
"Status figures"); the operator's gauge has it on every one-second read of the replicas, which is
what a timeline of a surge wants (and what Prometheus and the dashboards read)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "gpufleet_service_kv_usage_ratio"


def kv_percent(metrics_text: str, namespace: str, service: str) -> int | None:
    """The service's mean KV-cache usage over its ready replicas, percent; None before the first read."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name != KV_USAGE:
            continue
        for sample in family.samples:
            if sample.labels.get("namespace") == namespace and sample.labels.get("service") == service:
                return round(sample.value * 100)
    return None
