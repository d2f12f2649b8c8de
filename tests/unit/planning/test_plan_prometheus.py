"""The Prometheus path against a real local HTTP server that speaks the
Prometheus HTTP API (`/api/v1/query`, its JSON envelope and error format) and
answers vLLM metric queries with known values."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.cli.prometheus import PrometheusClient, read_sample
from gpufleet.planning.errors import PrometheusError
from gpufleet.planning.planner import plan_from_prometheus
from gpufleet.planning.queries import selector

# (substrings a query must contain) → value. One hour with 36,000 finished requests.
ANSWERS = {
    ("sum(increase(vllm:request_success_total",): 36000,
    ("max_over_time(sum(rate(vllm:request_success_total",): 20,
    ("min_over_time(sum(rate(vllm:request_success_total",): 4,
    ("max_over_time(sum(rate(vllm:prompt_tokens_total",): 12000,
    ("max_over_time(sum(rate(vllm:generation_tokens_total",): 3000,
    ("histogram_quantile(0.5,", "vllm:request_prompt_tokens_bucket"): 500,
    ("histogram_quantile(0.95,", "vllm:request_prompt_tokens_bucket"): 1500,
    ("histogram_quantile(0.99,", "vllm:request_prompt_tokens_bucket"): 3000,
    ("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count"): 600,
    ("histogram_quantile(0.5,", "vllm:request_generation_tokens_bucket"): 100,
    ("histogram_quantile(0.95,", "vllm:request_generation_tokens_bucket"): 300,
    ("histogram_quantile(0.99,", "vllm:request_generation_tokens_bucket"): 800,
    ("vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count"): 150,
    ("vllm:num_requests_running", "vllm:num_requests_waiting"): 40,
    ("vllm:e2e_request_latency_seconds_sum",): 3.0,
}


class FakePrometheus:
    """Answers instant queries whose selector names service "chat"; anything
    else gets an empty vector, as a real Prometheus does for unknown series."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.queries: list[str] = []
        self.fail_with: tuple[int, dict] | None = None
        self.url = ""

    async def query(self, request: web.Request) -> web.Response:
        q = request.query.get("query", "")
        self.queries.append(q)
        if self.fail_with:
            status, body = self.fail_with
            return web.json_response(body, status=status)
        result = []
        if 'service="chat"' in q:
            for parts, value in self.answers.items():
                if all(p in q for p in parts):
                    result = [{"metric": {}, "value": [1750000000.0, str(value)]}]
                    break
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/query", self.query)
        return app


@pytest.fixture
async def prometheus():
    fake = FakePrometheus(dict(ANSWERS))
    server = TestServer(fake.app())
    await server.start_server()
    fake.url = str(server.make_url("/")).rstrip("/")
    yield fake
    await server.close()


async def sample_from(url: str, service: str = "chat", **kw):
    async with PrometheusClient(url) as client:
        return await read_sample(client, service=service, namespace=kw.get("namespace"),
                                 window_seconds=kw.get("window", 3600), rate_window_seconds=60)


async def test_sample_reads_every_number(prometheus):
    sample = await sample_from(prometheus.url)
    t = sample.traffic
    assert (t.requests, t.rps_peak, t.rps_trough, t.rps_mean) == (36000, 20, 4, 10)
    assert (t.prompt_tokens_per_s_peak, t.output_tokens_per_s_peak) == (12000, 3000)
    assert (sample.prompt.p50, sample.prompt.p95, sample.prompt.p99, sample.prompt.mean) == (500, 1500, 3000, 600)
    assert (sample.output.p50, sample.output.p95, sample.output.p99, sample.output.mean) == (100, 300, 800, 150)
    assert sample.concurrent_requests_peak == 40
    assert sample.e2e_latency_mean_seconds == 3.0
    # Windows and rate windows reach Prometheus as written in the queries.
    assert "max_over_time(sum(rate(vllm:request_success_total{service=\"chat\"}[60s]))[3600s:60s])" \
        in prometheus.queries


async def test_plan_from_prometheus_uses_the_running_gauge(prometheus, round_gpu, round_model, round_settings):
    plan = plan_from_prometheus(await sample_from(prometheus.url), round_gpu, round_model, round_settings)
    # 40 in flight × mean (600 + 150) tokens = 30,000 tokens × 20,000 bytes.
    assert plan.concurrency.tokens_peak == 30_000
    assert plan.fleet.kv_demand_bytes == 30_000 * 20_000
    assert plan.concurrency.method.startswith("Prometheus: peak of vllm:num_requests_running")
    # prefill:decode from the peak token rates: 12,000 ÷ 25,000 : 3,000 ÷ decode tok/s.
    assert plan.fleet.prefill_replica_units == pytest.approx(12_000 / 25_000)
    assert plan.fleet.decode_replica_units == pytest.approx(3000 / plan.replica.decode_tokens_per_s)


async def test_littles_law_without_the_gauge(prometheus, round_gpu, round_model, round_settings):
    del prometheus.answers[("vllm:num_requests_running", "vllm:num_requests_waiting")]
    plan = plan_from_prometheus(await sample_from(prometheus.url), round_gpu, round_model, round_settings)
    assert plan.concurrency.requests_peak == 20 * 3.0               # peak RPS × mean e2e latency
    assert plan.concurrency.tokens_peak == 60 * 750
    assert plan.concurrency.method.startswith("Little's law: peak RPS × mean vllm:e2e_request_latency_seconds")


async def test_estimated_duration_without_latency_metrics(prometheus, round_gpu, round_model, round_settings):
    del prometheus.answers[("vllm:num_requests_running", "vllm:num_requests_waiting")]
    del prometheus.answers[("vllm:e2e_request_latency_seconds_sum",)]
    plan = plan_from_prometheus(await sample_from(prometheus.url), round_gpu, round_model, round_settings)
    # 600 ÷ 25,000 s of prefill + 150 steps of (2e10 + 250 × 675 × 20,000) ÷ 5e11 s.
    duration = 600 / 25_000 + 150 * (2e10 + 250 * 675 * 20_000) / 5e11
    assert plan.concurrency.requests_peak == pytest.approx(20 * duration)
    assert "estimated from the profile" in plan.concurrency.method


async def test_injected_http_client_is_used_and_left_open(prometheus):
    async with httpx.AsyncClient() as http:
        async with PrometheusClient(prometheus.url, http=http) as client:
            assert await client.value('sum(increase(vllm:request_success_total{service="chat"}[1h]))') == 36000
        assert not http.is_closed


async def test_wrong_service_names_the_selector(prometheus):
    with pytest.raises(PrometheusError) as e:
        await sample_from(prometheus.url, service="nope")
    assert 'check that --service matches the engines\' service label ({service="nope"})' in str(e.value)


async def test_namespace_joins_the_selector(prometheus):
    await sample_from(prometheus.url, namespace="prod")
    assert all('{service="chat",namespace="prod"}' in q for q in prometheus.queries)


async def test_no_finished_requests(prometheus):
    prometheus.answers[("sum(increase(vllm:request_success_total",)] = 0
    with pytest.raises(PrometheusError, match=r"no requests finished for \{service=\"chat\"\} in the last 3600s"):
        await sample_from(prometheus.url)


async def test_query_error_is_reported_with_prometheus_message(prometheus):
    prometheus.fail_with = (400, {"status": "error", "errorType": "bad_data",
                                  "error": "1:1: parse error: unexpected character"})
    with pytest.raises(PrometheusError, match=r"Prometheus refused the query .*: bad_data: 1:1: parse error"):
        await sample_from(prometheus.url)


async def test_not_a_prometheus(prometheus):
    async with PrometheusClient(prometheus.url) as client:
        client.url = prometheus.url + "/nothing-here"
        with pytest.raises(PrometheusError, match="answered HTTP 404 without Prometheus API JSON"):
            await client.value("up")


async def test_unreachable_prometheus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # closed once the block ends: nothing listens there
    with pytest.raises(PrometheusError, match=rf"cannot reach Prometheus at http://127.0.0.1:{port}.*--prometheus"):
        await sample_from(f"http://127.0.0.1:{port}")


def test_selector_escapes_label_values():
    assert selector('a"b\\c') == '{service="a\\"b\\\\c"}'


async def test_cli_plans_from_prometheus(prometheus):
    args = ["plan", "--prometheus", prometheus.url, "--service", "chat", "--window", "1h", "--json"]
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["traffic"]["rps_peak"] == 20
    assert plan["concurrency"]["requests_peak"] == 40
    assert plan["source"].startswith(f"Prometheus {prometheus.url} {{service=\"chat\"}}, last 3600 s")
