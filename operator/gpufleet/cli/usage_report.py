"""What ``gpufleet usage`` asks Prometheus and what it makes of the answers, with no I/O (``usage`` sends
the queries through ``prometheus.PrometheusClient``).

Per tenant of a namespace: its requests, refusals and tokens over the window (the router's usage
counters, ``gpufleet_api.tenants.usage``), its share of the tokens, and its share of the replica-seconds:
each service's ready replicas summed over the window (the operator's
``gpufleet_service_ready_replicas``, one sample a minute), apportioned to the service's tenants by their
share of its tokens (prompt + answer, what ``tokensPerMinute`` counts). Replica-seconds of a service that
served no tokens in the window belong to no tenant: they are reported as idle.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from gpufleet_api.tenants import usage as names
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT

from ..planning.errors import PrometheusError

READY_REPLICAS = "gpufleet_service_ready_replicas"  # operator/gpufleet/metrics.py, docs/metrics.md
REPLICA_STEP_SECONDS = 60  # the replicas are read once a minute over the window: a subquery's step

COUNTERS = {"requests": names.REQUESTS, "prompt_tokens": names.PROMPT_TOKENS,
            "cached_prompt_tokens": names.CACHED_PROMPT_TOKENS, "answer_tokens": names.ANSWER_TOKENS}


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def selector(namespace: str | None) -> str:
    return "{namespace=" + _quote(namespace) + "}" if namespace else ""


def build_queries(window_seconds: float, namespace: str | None = None) -> dict[str, str]:
    """Instant queries, each answered per series: the counters' increase over the window by namespace,
    service and tenant; refusals by namespace and tenant; replica-seconds by namespace and service."""
    w, sel = f"{round(window_seconds)}s", selector(namespace)
    queries = {key: f"sum by (namespace, service, tenant) (increase({metric}{sel}[{w}]))"
               for key, metric in COUNTERS.items()}
    queries["refusals"] = f"sum by (namespace, tenant) (increase({names.REFUSALS}{sel}[{w}]))"
    queries["replica_seconds"] = (f"sum by (namespace, service) (sum_over_time({READY_REPLICAS}{sel}"
                                  f"[{w}:{REPLICA_STEP_SECONDS}s])) * {REPLICA_STEP_SECONDS}")
    return queries


def series_of(data: dict, promql: str) -> list[tuple[dict[str, str], float]]:
    """The (labels, value) of each series of an instant query's ``data``; series whose value is not a
    finite number are left out."""
    if data.get("resultType") != "vector":
        raise PrometheusError(f"the query {promql} returned a {data.get('resultType')} result; expected a vector")
    out = []
    for s in data.get("result") or []:
        try:
            value = float(s["value"][1])
        except (KeyError, TypeError, ValueError, IndexError):
            raise PrometheusError(f"the query {promql} returned a malformed sample {s!r}") from None
        if math.isfinite(value):
            out.append(({str(k): str(v) for k, v in (s.get("metric") or {}).items()}, value))
    return out


@dataclass
class TenantUsage:
    namespace: str
    tenant: str
    requests: float = 0.0
    refusals: float = 0.0
    prompt_tokens: float = 0.0
    cached_prompt_tokens: float = 0.0
    answer_tokens: float = 0.0
    token_share: float = 0.0  # of every tenant's tokens in the report
    replica_seconds: float | None = None  # None: no replica figures in the window
    replica_share: float | None = None  # of every service's replica-seconds in the report, idle included

    @property
    def tokens(self) -> float:
        return self.prompt_tokens + self.answer_tokens


@dataclass
class UsageReport:
    url: str
    window_seconds: float
    namespace: str | None
    tenants: list[TenantUsage]
    replica_seconds: float | None  # every service's, None when Prometheus had none
    idle_replica_seconds: float | None  # those of services that served no tokens
    queries: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"prometheus": self.url, "windowSeconds": self.window_seconds, "namespace": self.namespace,
                "replicaSeconds": self.replica_seconds, "idleReplicaSeconds": self.idle_replica_seconds,
                "tenants": [{**{_camel(k): v for k, v in asdict(t).items()}, "tokens": t.tokens}
                            for t in self.tenants],
                "notes": self.notes, "queries": self.queries}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def report_of(answers: dict[str, list[tuple[dict[str, str], float]]], queries: dict[str, str], *, url: str,
              window_seconds: float, namespace: str | None) -> UsageReport:
    """The report from the series answering ``build_queries``' queries; PrometheusError when the window
    holds no tenant usage at all, naming what to check."""
    where = f" in namespace {namespace}" if namespace else ""
    if not any(answers[k] for k in COUNTERS) and not answers["refusals"]:
        raise PrometheusError(
            f"Prometheus at {url} has no {names.REQUESTS} or {names.REFUSALS}{where} in the last "
            f"{round(window_seconds)}s (--window): check that it scrapes the routers (the chart's router "
            "ServiceMonitor, monitoring.serviceMonitor.enabled), that the namespace declares its tenants (an "
            f"{names.TENANTS_KIND} named {names.TENANTS_NAME}), and that it had traffic in the window")
    tenants: dict[tuple[str, str], TenantUsage] = {}
    service_tokens: dict[tuple[str, str], dict[str, float]] = {}  # (namespace, service) -> tenant -> tokens

    def tenant(labels: dict[str, str]) -> TenantUsage:
        key = (labels.get("namespace", ""), labels.get("tenant", UNKNOWN_TENANT))
        return tenants.setdefault(key, TenantUsage(*key))

    for key in COUNTERS:
        for labels, value in answers[key]:
            t = tenant(labels)
            setattr(t, key, getattr(t, key) + value)
            if key in ("prompt_tokens", "answer_tokens"):
                per = service_tokens.setdefault((t.namespace, labels.get("service", "")), {})
                per[t.tenant] = per.get(t.tenant, 0.0) + value
    for labels, value in answers["refusals"]:
        tenant(labels).refusals += value
    total_tokens = sum(t.tokens for t in tenants.values())
    for t in tenants.values():
        t.token_share = t.tokens / total_tokens if total_tokens > 0 else 0.0

    notes: list[str] = []
    replicas = {(labels.get("namespace", ""), labels.get("service", "")): value
                for labels, value in answers["replica_seconds"]}
    total_replica_seconds: float | None = sum(replicas.values()) if replicas else None
    idle: float | None = None
    if total_replica_seconds is None:
        notes.append(f"no {READY_REPLICAS}{where} in the window: replica-seconds are not known (does Prometheus "
                     "scrape the operator? the chart's monitoring.serviceMonitor.enabled)")
    else:
        idle = 0.0
        for t in tenants.values():
            t.replica_seconds = 0.0
        for svc, seconds in replicas.items():
            per = service_tokens.get(svc, {})
            served = sum(per.values())
            if served <= 0:
                idle += seconds
                continue
            for name, tokens in per.items():
                t = tenants[(svc[0], name)]
                t.replica_seconds = (t.replica_seconds or 0.0) + seconds * tokens / served
        for t in tenants.values():
            t.replica_share = ((t.replica_seconds or 0.0) / total_replica_seconds
                               if total_replica_seconds > 0 else 0.0)
        unseen = sorted(f"{ns}/{svc}" for ns, svc in service_tokens if (ns, svc) not in replicas)
        if unseen:
            notes.append(f"tokens of {', '.join(unseen)} have no {READY_REPLICAS}: their tenants' replica-seconds "
                         "leave them out")
    ordered = sorted(tenants.values(), key=lambda t: (-t.tokens, t.namespace, t.tenant))
    return UsageReport(url=url, window_seconds=window_seconds, namespace=namespace, tenants=ordered,
                       replica_seconds=total_replica_seconds, idle_replica_seconds=idle, queries=queries,
                       notes=notes)


def _count(value: float) -> str:
    return f"{round(value):,}"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def render(report: UsageReport) -> str:
    """The report as a table, one row per tenant, for a terminal."""
    header = ("NAMESPACE", "TENANT", "REQUESTS", "REFUSED", "PROMPT", "CACHED", "ANSWER", "TOKENS%",
              "REPLICA-S", "REPLICA%")
    rows = [(t.namespace, t.tenant, _count(t.requests), _count(t.refusals), _count(t.prompt_tokens),
             _count(t.cached_prompt_tokens), _count(t.answer_tokens), _percent(t.token_share),
             "-" if t.replica_seconds is None else _count(t.replica_seconds), _percent(t.replica_share))
            for t in report.tenants]
    if report.idle_replica_seconds:
        share = report.idle_replica_seconds / report.replica_seconds if report.replica_seconds else 0.0
        rows.append(("", "(idle: no tokens)", "", "", "", "", "", "", _count(report.idle_replica_seconds),
                     _percent(share)))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    numeric = set(range(2, len(header)))
    lines = ["  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             .rstrip() for r in (header, *rows)]
    where = f", namespace {report.namespace}" if report.namespace else ""
    title = f"Tenant usage over the last {_duration(report.window_seconds)}{where} ({report.url})"
    return "\n".join([title, "", *lines, *([""] + [f"note: {n}" for n in report.notes] if report.notes else [])]) + "\n"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{round(seconds / size)}{unit}"
    return f"{round(seconds)}s"
