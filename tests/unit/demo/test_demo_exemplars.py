"""The demo's tracing plumbing: its operator exports to the local cluster's trace store when one runs, and its
Prometheus stores the exemplars the guards' latency buckets carry (a real Debian Prometheus scraping an
OpenMetrics /metrics, skipped where Prometheus is not installed)."""
from __future__ import annotations

import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gpufleet_dev.demo import prometheus
from gpufleet_dev.demo.run import operator_argv
from gpufleet_kit.openmetrics import exposition
from tests.support.waiting import wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_the_operator_exports_to_the_local_trace_store_when_one_runs(tmp_path):
    state = {"traces": {"otlpHttp": "http://127.0.0.1:4318", "query": "http://127.0.0.1:16686"}}
    argv = operator_argv("kube.yaml", 9000, tmp_path / "token", state)
    assert argv[argv.index("--otlp-endpoint") + 1] == "http://127.0.0.1:4318"
    assert "--otlp-endpoint" not in operator_argv("kube.yaml", 9000, tmp_path / "token", {})


def test_prometheus_runs_with_exemplar_storage(tmp_path):
    assert "--enable-feature=exemplar-storage" in prometheus.argv("prometheus", tmp_path / "p.yml", tmp_path, 9090)


class _Metrics(BaseHTTPRequestHandler):
    registry: CollectorRegistry

    def do_GET(self) -> None:
        body, content_type = exposition(self.registry, self.headers.get("Accept"))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


async def test_the_demos_prometheus_keeps_a_latency_buckets_trace_id(tmp_path: Path):
    if not shutil.which("prometheus"):
        pytest.skip("prometheus is not installed (scripts/install-prometheus.sh)")
    registry = CollectorRegistry()
    ttft = Histogram("gpufleet_guard_ttft_seconds", "TTFT", registry=registry)
    ttft.observe(0.7, {"trace_id": TRACE_ID})
    handler = type("Handler", (_Metrics,), {"registry": registry})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prom = prometheus.LocalPrometheus(tmp_path, f"127.0.0.1:{server.server_port}")
    started = time.time()
    try:
        prom.start(timeout=60)

        def stored() -> list[dict] | None:
            found = prometheus.exemplars(prom.url, "gpufleet_guard_ttft_seconds_bucket", started - 60,
                                         time.time() + 60)
            return found or None
        found = await wait_for(stored, timeout=60, what="the scraped exemplar in Prometheus")
    finally:
        prom.stop()
        server.shutdown()
    assert {e["labels"]["trace_id"] for series in found for e in series["exemplars"]} == {TRACE_ID}
