"""`gpufleet usage`: each tenant's requests, tokens and share of the replicas over a window, read from
Prometheus (the queries and what their answers mean: ``usage_report``)."""
from __future__ import annotations

import asyncio
import json

import click

from ..planning.errors import PrometheusError
from .plan import Duration
from .prometheus import PrometheusClient
from .usage_report import UsageReport, build_queries, render, report_of, series_of


@click.command()
@click.option("--prometheus", "prometheus_url", metavar="URL", required=True,
              help="The Prometheus that scrapes the routers and the operator (base URL).")
@click.option("--window", type=Duration(), default="30d", show_default=True, help="How far back to count.")
@click.option("--namespace", "-n", help="Only this namespace's tenants (default: every namespace).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def usage(prometheus_url: str, window: float, namespace: str | None, as_json: bool) -> None:
    """Per tenant: requests, refusals, prompt, cached and answer tokens, its share of the tokens, and its
    share of the replica-seconds (each service's ready replicas over the window, apportioned to its
    tenants by their share of its tokens). docs/tenants.md."""
    try:
        report = asyncio.run(read_report(prometheus_url, window, namespace))
    except PrometheusError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else render(report), nl=as_json)


async def read_report(url: str, window_seconds: float, namespace: str | None, *,
                      client: PrometheusClient | None = None) -> UsageReport:
    """Every query of the report, sent concurrently."""
    queries = build_queries(window_seconds, namespace)
    async with client or PrometheusClient(url) as prometheus:
        answers = await asyncio.gather(*(prometheus.data(q) for q in queries.values()))
    series = {key: series_of(data, queries[key]) for key, data in zip(queries, answers, strict=True)}
    return report_of(series, queries, url=prometheus.url, window_seconds=window_seconds, namespace=namespace)
