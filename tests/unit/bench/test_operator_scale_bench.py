"""bench/operator_scale.py's pure parts: what it reads from the operator's /metrics. The measurement
itself needs the cluster and runs as a benchmark (bench/README.md)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from prometheus_client import generate_latest

from gpufleet.metrics import OperatorMetrics

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("operator_scale", BENCH / "operator_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_the_operators_requests_and_reconciles_are_read_from_its_metrics():
    m = OperatorMetrics()
    for _ in range(3):
        m.api_request("patch", "deployments", 200)
    m.api_request("get", "inferenceservices", 200)
    m.api_request("get", "inferenceservices", 404)
    for seconds in (0.02, 0.04):
        m.reconcile_seconds.observe(seconds)
    text = generate_latest(m.registry).decode()
    assert bench.api_requests(text) == {"patch deployments": 3, "get inferenceservices": 2}
    count, mean = bench.reconciles(text)
    assert count == 2 and abs(mean - 0.03) < 1e-9


def test_the_api_servers_requests_and_latency_are_summed_by_verb_and_resource():
    text = """# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",resource="pods",subresource="",verb="LIST"} 5
apiserver_request_total{code="500",component="apiserver",resource="pods",subresource="",verb="LIST"} 1
apiserver_request_total{code="201",component="apiserver",resource="pods",subresource="binding",verb="POST"} 2
# TYPE apiserver_request_duration_seconds histogram
apiserver_request_duration_seconds_bucket{resource="pods",subresource="",verb="LIST",le="+Inf"} 6
apiserver_request_duration_seconds_sum{resource="pods",subresource="",verb="LIST"} 0.5
apiserver_request_duration_seconds_count{resource="pods",subresource="",verb="LIST"} 6
apiserver_request_duration_seconds_sum{resource="pods",subresource="",verb="WATCH"} 900
"""
    figures = bench.parse_apiserver(text)
    assert figures["count"] == {"LIST pods": 6, "POST pods/binding": 2}
    assert figures["seconds"] == {"LIST pods": 0.5}
