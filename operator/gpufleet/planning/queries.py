"""The queries that read a running service's request distribution from Prometheus, and the planner's
sample made of their answers (no I/O: ``gpufleet.cli.prometheus`` sends them).

Instant queries (``/api/v1/query``) over vLLM's own metrics: counters for
requests and tokens, the per-request token histograms, and the running and
waiting gauges. Peaks and troughs are subqueries over per-window rates, so
Prometheus does the windowing.
"""
from __future__ import annotations

import math
from typing import Any

from .distribution import PrometheusSample, TokenStats, Traffic
from .errors import PrometheusError


def single_value(data: dict, promql: str) -> float | None:
    """The one finite value of an instant query's ``data`` (None: no samples, or not finite)."""
    kind, result = data.get("resultType"), data.get("result")
    sample: Any
    if kind == "scalar":
        sample = result
    elif kind == "vector":
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"the query {promql} returned {len(result)} series where one was "
                                  "expected; is the selector ambiguous?")
        sample = result[0].get("value")
    else:
        raise PrometheusError(f"the query {promql} returned a {kind} result; expected a vector or scalar")
    try:
        number = float(sample[1])
    except (TypeError, ValueError, IndexError):
        raise PrometheusError(f"the query {promql} returned a malformed sample {sample!r}") from None
    return number if math.isfinite(number) else None


def selector(service: str, namespace: str | None = None) -> str:
    labels = {"service": service}
    if namespace:
        labels["namespace"] = namespace
    return "{" + ",".join(f"{k}={_quote(v)}" for k, v in labels.items()) + "}"


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def build_queries(sel: str, window_seconds: float, rate_window_seconds: float) -> dict[str, str]:
    w, r = f"{round(window_seconds)}s", f"{round(rate_window_seconds)}s"

    def peak(fn: str, counter: str) -> str:
        return f"{fn}(sum(rate({counter}{sel}[{r}]))[{w}:{r}])"

    def quantile(q: float, histogram: str) -> str:
        return f"histogram_quantile({q}, sum by (le) (increase({histogram}_bucket{sel}[{w}])))"

    def mean(histogram: str) -> str:
        return f"sum(increase({histogram}_sum{sel}[{w}])) / sum(increase({histogram}_count{sel}[{w}]))"

    queries = {
        "requests": f"sum(increase(vllm:request_success_total{sel}[{w}]))",
        "rps_peak": peak("max_over_time", "vllm:request_success_total"),
        "rps_trough": peak("min_over_time", "vllm:request_success_total"),
        "prompt_tps_peak": peak("max_over_time", "vllm:prompt_tokens_total"),
        "output_tps_peak": peak("max_over_time", "vllm:generation_tokens_total"),
        # Waiting requests count too: they are demand the engines have not admitted yet.
        "concurrency_peak": (f"max_over_time((sum(vllm:num_requests_running{sel}) + "
                             f"(sum(vllm:num_requests_waiting{sel}) or vector(0)))[{w}:{r}])"),
        "e2e_mean": mean("vllm:e2e_request_latency_seconds"),
    }
    for side, histogram in (("prompt", "vllm:request_prompt_tokens"), ("output", "vllm:request_generation_tokens")):
        for q in (50, 95, 99):
            queries[f"{side}_p{q}"] = quantile(q / 100, histogram)
        queries[f"{side}_mean"] = mean(histogram)
    return queries


_OPTIONAL = {"concurrency_peak", "e2e_mean"}


def sample_of(values: dict[str, float | None], queries: dict[str, str], *, url: str, sel: str,
              window_seconds: float, rate_window_seconds: float) -> PrometheusSample:
    """The planner's sample from the answers to ``build_queries``' queries (key -> value, None: no data);
    PrometheusError names the query with no data and what to check."""
    for key, query in queries.items():
        if key not in _OPTIONAL and values[key] is None:
            raise PrometheusError(
                f"Prometheus at {url} has no data for {query}; check that --service matches the "
                f"engines' service label ({sel}), that Prometheus scrapes the engine pods, and that the "
                f"service had traffic in the last {round(window_seconds)}s (--window)")
    # Every value below is one the loop above found present (only _OPTIONAL ones may be None).
    need: dict[str, float] = {k: v for k, v in values.items() if v is not None}
    if need["requests"] <= 0:
        raise PrometheusError(f"no requests finished for {sel} in the last {round(window_seconds)}s; "
                              "widen --window or pick a period with traffic")

    def stats(side: str) -> TokenStats:
        return TokenStats(p50=need[f"{side}_p50"], p95=need[f"{side}_p95"], p99=need[f"{side}_p99"],
                          mean=need[f"{side}_mean"], max=None)

    traffic = Traffic(
        requests=round(need["requests"]), span_seconds=window_seconds, window_seconds=rate_window_seconds,
        windows=max(1, round(window_seconds / rate_window_seconds)), rps_peak=need["rps_peak"],
        rps_trough=need["rps_trough"], rps_mean=need["requests"] / window_seconds,
        prompt_tokens_per_s_peak=need["prompt_tps_peak"], output_tokens_per_s_peak=need["output_tps_peak"])
    return PrometheusSample(url=url, selector=sel, window_seconds=window_seconds, prompt=stats("prompt"),
                            output=stats("output"), traffic=traffic,
                            concurrent_requests_peak=values["concurrency_peak"],
                            e2e_latency_mean_seconds=values["e2e_mean"], queries=queries)
