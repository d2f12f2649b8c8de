"""`gpufleet usage`: the queries (built from the shared metric names), what the report makes of canned
Prometheus answers (token shares, replica-seconds apportioned by each service's tokens, idle replicas),
and the errors that name the fix."""
from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.cli import usage as usage_cli
from gpufleet.cli.prometheus import PrometheusClient
from gpufleet.cli.usage_report import READY_REPLICAS, build_queries, render, report_of, series_of
from gpufleet.planning.errors import PrometheusError
from gpufleet_api.tenants import usage as names

URL = "http://prometheus:9090"
DAY = 86400.0


def vector(*series: tuple[dict, float]) -> dict:
    return {"resultType": "vector", "result": [{"metric": m, "value": [1.75e9, str(v)]} for m, v in series]}


def ml(service: str, tenant: str) -> dict:
    return {"namespace": "ml", "service": service, "tenant": tenant}


# One day in namespace ml: chat served search 3/4 of its tokens and batch 1/4; embed served only batch;
# idle served nothing. 100 replica-seconds each on chat and embed, 50 on idle.
ANSWERS = {
    names.REQUESTS: vector((ml("chat", "search"), 300), (ml("chat", "batch"), 100), (ml("embed", "batch"), 50)),
    names.PROMPT_TOKENS: vector((ml("chat", "search"), 600), (ml("chat", "batch"), 200), (ml("embed", "batch"), 100)),
    names.CACHED_PROMPT_TOKENS: vector((ml("chat", "search"), 400)),
    names.ANSWER_TOKENS: vector((ml("chat", "search"), 150), (ml("chat", "batch"), 50)),
    names.REFUSALS: vector(({"namespace": "ml", "tenant": "batch"}, 7)),
    READY_REPLICAS: vector(({"namespace": "ml", "service": "chat"}, 100),
                           ({"namespace": "ml", "service": "embed"}, 100),
                           ({"namespace": "ml", "service": "idle"}, 50)),
}


def answer(promql: str, answers: dict = ANSWERS) -> dict:
    # The refusals counter's name holds no other's; the token counters' names hold "prompt_tokens_total".
    for metric in sorted(answers, key=len, reverse=True):
        if metric + "{" in promql or metric + "[" in promql:
            return answers[metric]
    return vector()


def report(answers: dict = ANSWERS, namespace: str | None = "ml"):
    queries = build_queries(DAY, namespace)
    return report_of({k: series_of(answer(q, answers), q) for k, q in queries.items()}, queries, url=URL,
                     window_seconds=DAY, namespace=namespace)


def test_queries_use_the_shared_names_the_window_and_the_namespace():
    queries = build_queries(30 * DAY, "ml")
    assert queries["requests"] == ('sum by (namespace, service, tenant) '
                                   f'(increase({names.REQUESTS}{{namespace="ml"}}[2592000s]))')
    assert queries["replica_seconds"] == ('sum by (namespace, service) (sum_over_time('
                                          f'{READY_REPLICAS}{{namespace="ml"}}[2592000s:60s])) * 60')
    assert all("namespace=" not in q for q in build_queries(DAY).values())
    assert 'namespace="a\\"b"' in build_queries(DAY, 'a"b')["requests"]


def test_each_tenants_counts_and_share_of_the_tokens():
    r = report()
    by = {t.tenant: t for t in r.tenants}
    assert [t.tenant for t in r.tenants] == ["search", "batch"]  # most tokens first
    assert (by["search"].requests, by["search"].prompt_tokens, by["search"].cached_prompt_tokens,
            by["search"].answer_tokens) == (300, 600, 400, 150)
    assert (by["batch"].requests, by["batch"].refusals, by["batch"].tokens) == (150, 7, 350)
    assert by["search"].token_share == pytest.approx(750 / 1100)


def test_replica_seconds_are_apportioned_by_each_services_tokens_and_idle_ones_are_nobodys():
    r = report()
    by = {t.tenant: t for t in r.tenants}
    # chat: search 750 of 1000 tokens -> 75 s, batch 25 s; embed: batch all -> 100 s; idle: 50 s to nobody.
    assert by["search"].replica_seconds == pytest.approx(75)
    assert by["batch"].replica_seconds == pytest.approx(125)
    assert r.replica_seconds == 250 and r.idle_replica_seconds == 50
    assert by["search"].replica_share == pytest.approx(0.3) and by["batch"].replica_share == pytest.approx(0.5)
    table = render(r)
    assert "(idle: no tokens)" in table and "20.0%" in table and "30.0%" in table
    assert table.startswith("Tenant usage over the last 1d, namespace ml (http://prometheus:9090)")


def test_without_the_replicas_metric_the_report_says_so_and_keeps_the_tokens():
    r = report({k: v for k, v in ANSWERS.items() if k != READY_REPLICAS})
    assert all(t.replica_seconds is None and t.replica_share is None for t in r.tenants)
    assert "does Prometheus scrape the operator?" in r.notes[0]
    assert "note: no gpufleet_service_ready_replicas" in render(r)


def test_a_window_without_tenant_usage_names_what_to_check():
    with pytest.raises(PrometheusError) as e:
        report({READY_REPLICAS: ANSWERS[READY_REPLICAS]})
    message = str(e.value)
    assert "no gpufleet_tenant_requests_total" in message and "in namespace ml" in message
    assert "scrapes the routers" in message and "InferenceTenants named tenants" in message
    assert "--window" in message


def test_non_finite_values_are_left_out_and_other_results_refused():
    assert series_of(vector(({"tenant": "a"}, float("nan")), ({"tenant": "b"}, 2)), "q") == [({"tenant": "b"}, 2.0)]
    with pytest.raises(PrometheusError, match="returned a matrix result"):
        series_of({"resultType": "matrix", "result": []}, "q")


def transport(answers: dict = ANSWERS) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = {"status": "success", "data": answer(request.url.params["query"], answers)}
        return httpx.Response(200, json=body)
    return httpx.MockTransport(handle)


def test_the_command_prints_a_table_and_json(monkeypatch):
    def client(url: str) -> PrometheusClient:
        return PrometheusClient(url, http=httpx.AsyncClient(transport=transport()))
    monkeypatch.setattr(usage_cli, "PrometheusClient", client)
    runner = CliRunner()
    table = runner.invoke(main, ["usage", "--prometheus", URL, "--window", "1d", "-n", "ml"])
    assert table.exit_code == 0, table.output
    assert "search" in table.output and "REPLICA%" in table.output
    out = runner.invoke(main, ["usage", "--prometheus", URL, "--window", "1d", "--json"])
    doc = json.loads(out.output)
    assert doc["windowSeconds"] == DAY and doc["replicaSeconds"] == 250
    search = next(t for t in doc["tenants"] if t["tenant"] == "search")
    assert search["replicaSeconds"] == pytest.approx(75) and search["tokens"] == 750
    assert set(doc["queries"]) == {"requests", "prompt_tokens", "cached_prompt_tokens", "answer_tokens",
                                   "refusals", "replica_seconds"}


def test_an_unreachable_prometheus_is_named_with_the_option_to_fix():
    result = CliRunner().invoke(main, ["usage", "--prometheus", "http://127.0.0.1:9", "--window", "1h"])
    assert result.exit_code == 1
    assert "cannot reach Prometheus at http://127.0.0.1:9" in result.output and "--prometheus" in result.output
