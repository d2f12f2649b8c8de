"""Instant queries to Prometheus for ``gpufleet plan`` (a running service's request distribution: the
queries and what their answers mean are ``gpufleet.planning.queries``) and ``gpufleet usage`` (the
tenants' usage: ``usage_report``); this module sends them. The HTTP client (``httpx``) is injectable."""
from __future__ import annotations

import asyncio

import httpx

from ..planning.distribution import PrometheusSample
from ..planning.errors import PrometheusError
from ..planning.queries import build_queries, sample_of, selector, single_value


class PrometheusClient:
    """Instant queries against one Prometheus. Pass ``http`` to reuse or
    replace the HTTP client; one created here is closed by ``close``."""

    def __init__(self, url: str, *, http: httpx.AsyncClient | None = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        # Proxies from the environment apply, as they do to curl on the laptop running the planner.
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._owns_http = http is None
        self._timeout = timeout

    async def __aenter__(self) -> "PrometheusClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def value(self, promql: str) -> float | None:
        """The one value of an aggregated instant query; None when it has no
        samples or is not a finite number (e.g. 0/0, or a quantile of no data)."""
        return single_value(await self.data(promql), promql)

    async def data(self, promql: str) -> dict:
        """The ``data`` of an instant query's answer (resultType and result), as Prometheus sent it."""
        endpoint = f"{self.url}/api/v1/query"
        try:
            async with asyncio.timeout(self._timeout):
                resp = await self._http.get(endpoint, params={"query": promql})
        except (httpx.HTTPError, TimeoutError) as e:
            raise PrometheusError(f"cannot reach Prometheus at {self.url} ({type(e).__name__}: {e}); "
                                  "check --prometheus (the server's base URL, e.g. http://prometheus:9090)") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "status" not in body:
            raise PrometheusError(f"{endpoint} answered HTTP {resp.status_code} without Prometheus API JSON; "
                                  "check that --prometheus is the Prometheus server's base URL")
        if body["status"] != "success":
            raise PrometheusError(f"Prometheus refused the query {promql}: "
                                  f"{body.get('errorType', 'error')}: {body.get('error', 'no detail')}")
        return body.get("data") or {}


async def read_sample(client: PrometheusClient, *, service: str, namespace: str | None,
                      window_seconds: float, rate_window_seconds: float) -> PrometheusSample:
    """Every number the planner needs, read concurrently."""
    sel = selector(service, namespace)
    queries = build_queries(sel, window_seconds, rate_window_seconds)
    values = dict(zip(queries, await asyncio.gather(*(client.value(q) for q in queries.values())), strict=True))
    return sample_of(values, queries, url=client.url, sel=sel, window_seconds=window_seconds,
                     rate_window_seconds=rate_window_seconds)
