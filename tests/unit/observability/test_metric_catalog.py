"""Alerts, recording rules and runbooks use only metric names from
docs/metrics.md (and series the rules record), so a renamed metric breaks a
test instead of silently blanking a panel or muting an alert."""
from __future__ import annotations

import re

import pytest

from tests.unit.observability.assets import (
    OBSERVABILITY_DOC,
    RUNBOOKS,
    catalog,
    catalog_series,
    metric_names,
    promql_blocks,
    promtool_check_exprs,
    recording_rules,
    rules,
)

RECORD_NAME = re.compile(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+")  # level:metric:operations


@pytest.mark.parametrize(("expr", "names"), [
    ("up", {"up"}),
    ('sum by (namespace, le) (rate(a_bucket{class!="background", le="0.5"}[5m]))', {"a_bucket"}),
    ("histogram_quantile(0.99, x:y:z) > on (namespace, service) group_left (le) other", {"x:y:z", "other"}),
    ("vllm:kv_cache_usage_perc unless on (instance) vllm:gpu_cache_usage_perc",
     {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}),
    ("count(a) or vector(0) > bool 1e3", {"a"}),
    ("rate(a[5m] offset 1h) / ignoring(pod) b offset 5m", {"a", "b"}),
    ("avg_over_time(c[3d:5m]) and d", {"c", "d"}),
    ("max without (pod) (e) unless f", {"e", "f"}),
    ('label_replace(g, "dst", "$1", "src", "(.*)")', {"g"}),
])
def test_metric_names_finds_selected_series_only(expr, names):
    assert metric_names(expr) == names


def test_the_catalog_is_read():
    names = catalog()
    assert names["gpufleet_guard_ttft_seconds"] == "histogram"
    assert names["gpufleet_guard_requests_total"] == "counter"
    assert names["gpufleet_stranded_gpus"] == "gauge"
    assert {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
            "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"} <= set(names)
    series = catalog_series()
    assert "gpufleet_guard_ttft_seconds_bucket" in series
    assert "vllm:time_per_output_token_seconds_bucket" in series
    assert "vllm:iteration_tokens_total_sum" in series
    assert "gpufleet_guard_requests_total_bucket" not in series


def test_rules_use_only_catalogued_metrics_and_recorded_series():
    allowed = catalog_series() | {rule["record"] for rule in recording_rules()}
    unknown = {rule.get("alert") or rule["record"]: sorted(metric_names(rule["expr"]) - allowed)
               for rule in rules() if metric_names(rule["expr"]) - allowed}
    assert not unknown


def test_recorded_names_follow_the_convention_or_bridge_a_vllm_rename():
    for rule in recording_rules():
        name = rule["record"]
        if name.startswith("vllm:"):
            # A bridge: the new vLLM name, recorded from the old one.
            assert name in catalog_series(), name
            assert rule["labels"]["gpufleet_bridged_from"], name
        else:
            assert RECORD_NAME.fullmatch(name), f"{name}: expected level:metric:operations"


def docs_promql() -> list[tuple[str, str]]:
    docs = [*sorted(RUNBOOKS.glob("*.md")), OBSERVABILITY_DOC]
    return [(f"{path.name} block {i + 1}", block)
            for path in docs for i, block in enumerate(promql_blocks(path.read_text(encoding="utf-8")))]


def test_promql_in_the_docs_uses_only_catalogued_metrics_and_recorded_series():
    allowed = catalog_series() | {rule["record"] for rule in recording_rules()}
    unknown = {where: sorted(metric_names(expr) - allowed) for where, expr in docs_promql()
               if metric_names(expr) - allowed}
    assert not unknown


def test_promql_in_the_docs_is_valid(promtool, tmp_path):
    blocks = docs_promql()
    assert blocks
    result = promtool_check_exprs(promtool, dict(blocks), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
