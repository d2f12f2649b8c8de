"""The demo's pure parts: Prometheus targets from pods, and the report."""
from prometheus_client import generate_latest

from gpufleet.metrics import OperatorMetrics
from gpufleet_dev.demo.load import RequestResult
from gpufleet_dev.demo.operator_gauges import kv_percent
from gpufleet_dev.demo.prometheus import config, engine_targets, vllm_alone_targets
from gpufleet_dev.demo.report import Tick, render_png, render_text, summarize


def pod(name, ip, ready=True, deleting=False):
    meta = {"name": name, "namespace": "demo", "labels": {"gpufleet.dev/service": "chat"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_only_ready_live_pods_are_scraped_for_guard_and_vllm_metrics_on_the_guard_port(tmp_path):
    groups = engine_targets([pod("a", "127.64.0.2"), pod("b", "127.64.0.3", ready=False),
                             pod("c", "127.64.0.4", deleting=True)])
    labels = {"namespace": "demo", "pod": "a", "service": "chat", "run": "gpufleet"}
    assert groups == [
        {"targets": ["127.64.0.2:8080"], "labels": {**labels, "endpoint": "http", "__metrics_path__": "/metrics"}},
        {"targets": ["127.64.0.2:8080"],
         "labels": {**labels, "endpoint": "vllm", "__metrics_path__": "/metrics/engine"}}]
    cfg = config(tmp_path / "t.json", "127.0.0.1:9090")
    assert cfg["scrape_configs"][0]["honor_labels"] is True


def test_vllm_alone_is_scraped_on_its_own_port_under_its_own_run_label():
    assert vllm_alone_targets([pod("chat-vllm-alone", "10.88.0.5"), pod("x", "10.88.0.6", ready=False)]) == [
        {"targets": ["10.88.0.5:8000"], "labels": {"namespace": "demo", "pod": "chat-vllm-alone", "run": "vllm-alone",
                                                   "endpoint": "vllm", "__metrics_path__": "/metrics"}}]


def results():
    return [RequestResult(0, 1, "e", 200, ttft=0.1, tokens=64), RequestResult(0, 1, "e", 200, ttft=0.3, tokens=64),
            RequestResult(1, 1, "e", 429, retry_after="1"), RequestResult(2, 3, "e", 200, ttft=0.2, tokens=64,
                                                                          retried=1)]


def test_summary_counts_what_a_client_saw():
    s = summarize(results())
    assert (s["requests"], s["ok"], s["shed_429"], s["errors"], s["retried_elsewhere"]) == (4, 3, 1, 0, 1)
    assert s["ttft_p50"] == 0.2 and s["ttft_p99"] == 0.3 and s["tokens"] == 192


def test_report_tells_what_the_operator_did(tmp_path):
    ticks = [Tick(0, 1, 1, 10, 2), Tick(10, 2, 1, 85, 10), Tick(40, 2, 2, 50, 10), Tick(90, 1, 1, 5, 1)]
    decisions = [{"time": "t1", "from": 1, "to": 2, "reason": "KVHighWatermark", "message": "KV 85% >= 70%"},
                 {"time": "t2", "from": 2, "to": 1, "reason": "KVLowWatermark", "message": "KV 5% < 20%"}]
    text = render_text(service="demo/chat", spec_summary={"kvHighWatermarkPercent": 70, "kvLowWatermarkPercent": 20,
                                                          "kvWatermarkPercent": 15},
                       ticks=ticks, results=results(), decisions=decisions,
                       audit={"fragmentation": "Unavailable"}, prometheus={})
    assert "1 -> 2 replicas  (KVHighWatermark: KV 85% >= 70%)" in text
    assert "peak KV usage seen 85%" in text and "refused with 429 + Retry-After on every try 1" in text
    # The watermark is a promise about admission, not about usage: the report does not say "keeps 15% free"
    # next to a peak of 85% (or 95%) used.
    assert "keeps 15% free" not in text and "admits a request only while 15% of the KV pool stays free" in text
    render_png(tmp_path / "r.png", ticks, results(), kv_high=70, kv_low=20)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_the_live_kv_figure_is_the_operators_own_gauge():
    """The demo's timeline reads KV usage every 2 s: status has it only every
    --status-figures-interval-seconds, the operator's gauge on every read of the replicas."""
    metrics = OperatorMetrics()
    text = generate_latest(metrics.registry).decode()
    assert kv_percent(text, "demo", "chat") is None
    metrics.kv_usage.labels("demo", "chat").set(0.834)
    metrics.kv_usage.labels("demo", "other").set(0.1)
    text = generate_latest(metrics.registry).decode()
    assert kv_percent(text, "demo", "chat") == 83 and kv_percent(text, "ml", "chat") is None
