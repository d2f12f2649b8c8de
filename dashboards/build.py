"""Build gpufleet's Grafana dashboards.

The JSON files next to this script are generated: edit this script, then run

    python dashboards/build.py            # rewrite the JSON files
    python dashboards/build.py --check    # exit 1 if they are out of date

Queries use only metrics from docs/metrics.md and the recording rules in
rules/gpufleet.rules.yaml; tests/unit/observability checks both.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent

Panel = dict[str, Any]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
SERVICE_DASHBOARD_UID = "gpufleet-service"

# Latency objectives apply to every class but `background` (see the rules).
LATENCY_CLASSES = 'class!="background"'
# Series drawn as dashed reference lines rather than data.
REFERENCE_SERIES = "/objective|watermark|admission limit|threshold|budget/"
# Series that list the services: the operator's, or the guards' when the
# operator is down or not scraped (the variables must not go blank with it).
SERVICE_SERIES = '__name__=~"gpufleet_service_desired_replicas|gpufleet_guard_ready"'
# The service dashboard repeats its LoRA adapter row for each adapter the guards report.
ADAPTER_VARIABLE = "adapter"


# --- panels -----------------------------------------------------------------

def target(expr: str, legend: str = "", *, instant: bool = False, exemplar: bool = False) -> dict[str, Any]:
    """One Prometheus query; refIds are assigned by the panel. ``exemplar``: show the series' exemplars,
    each a sampled request's trace id (docs/tracing.md)."""
    return {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        **({"format": "table"} if instant else {}),
        **({"exemplar": True} if exemplar else {}),
    }


def _with_ref_ids(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"refId": chr(ord("A") + i), **t} for i, t in enumerate(targets)]


def _thresholds(*steps: tuple[float, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": "green", "value": None}]
            + [{"color": color, "value": value} for value, color in steps]}


def timeseries(title: str, description: str, targets: list[dict[str, Any]], *, unit: str,
               max_value: float | None = None, threshold: float | None = None,
               stack: bool = False) -> Panel:
    custom: dict[str, Any] = {
        "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 30,
        "showPoints": "never", "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if threshold is not None else "off"},
    }
    defaults: dict[str, Any] = {"unit": unit, "min": 0, "custom": custom,
                                "color": {"mode": "palette-classic"}}
    if max_value is not None:
        defaults["max"] = max_value
    defaults["thresholds"] = _thresholds((threshold, "red")) if threshold is not None else _thresholds()
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _with_ref_ids(targets),
        "fieldConfig": {
            "defaults": defaults,
            "overrides": [{
                "matcher": {"id": "byRegexp", "options": REFERENCE_SERIES},
                "properties": [
                    {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                    {"id": "custom.fillOpacity", "value": 0},
                    {"id": "custom.lineWidth", "value": 2},
                    {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
                ],
            }],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, description: str, targets: list[dict[str, Any]], *, unit: str,
         steps: tuple[tuple[float, str], ...] = ()) -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _with_ref_ids(targets),
        "fieldConfig": {
            "defaults": {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": _thresholds(*steps)},
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
            "orientation": "auto", "textMode": "auto",
        },
    }


def services_table(title: str, description: str, columns: list[tuple[str, str, str]]) -> Panel:
    """One row per service; columns are (header, instant query, unit)."""
    targets = [target(expr, instant=True) for _, expr, _ in columns]
    refs = [chr(ord("A") + i) for i in range(len(columns))]
    rename = {f"Value #{ref}": header for ref, (header, _, _) in zip(refs, columns)}
    order = {"namespace": 0, "service": 1, **{header: i + 2 for i, (header, _, _) in enumerate(columns)}}
    overrides: list[dict[str, Any]] = [
        {"matcher": {"id": "byName", "options": header}, "properties": [{"id": "unit", "value": unit}]}
        for header, _, unit in columns
    ]
    overrides.append({
        "matcher": {"id": "byName", "options": "service"},
        "properties": [{"id": "links", "value": [{
            "title": "Open the service dashboard",
            "url": (f"/d/{SERVICE_DASHBOARD_UID}?var-datasource=${{datasource}}"
                    "&var-namespace=${__data.fields.namespace}&var-service=${__value.raw}&${__url_time_range}"),
        }]}],
    })
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _with_ref_ids(targets),
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True}, "renameByName": rename,
                                           "indexByName": order}},
        ],
        "fieldConfig": {"defaults": {"custom": {"align": "auto"}}, "overrides": overrides},
        "options": {"showHeader": True, "sortBy": [{"displayName": "namespace", "desc": False}]},
    }


class Grid:
    """Lays panels out left to right in rows of GRID_WIDTH columns and numbers them."""

    def __init__(self) -> None:
        self.panels: list[Panel] = []
        self._x = 0
        self._y = 0
        self._line_height = 0

    def _newline(self) -> None:
        self._y += self._line_height
        self._x = 0
        self._line_height = 0

    def _place(self, panel: Panel, w: int, h: int) -> None:
        if self._x + w > GRID_WIDTH:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self._x, "y": self._y}
        self.panels.append(panel)
        self._x += w
        self._line_height = max(self._line_height, h)

    def row(self, title: str, *, repeat: str | None = None) -> None:
        """A row header; with `repeat`, Grafana draws the row and its panels once per value of
        that variable."""
        self._newline()
        self._place({"type": "row", "title": title, "collapsed": False, "panels": [],
                     **({"repeat": repeat} if repeat else {})}, GRID_WIDTH, 1)
        self._newline()

    def add(self, panel: Panel, w: int, h: int = 8) -> None:
        self._place(panel, w, h)


# --- dashboard frame --------------------------------------------------------

def _query_variable(name: str, label: str, query: str, *, multi: bool) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,
        "sort": 1,
        "multi": multi,
        "includeAll": multi,
        **({"allValue": ".+"} if multi else {}),
        "current": {},
        "options": [],
        "hide": 0,
    }


def _variables(*, multi: bool) -> list[dict[str, Any]]:
    namespace_match = 'namespace=~"$namespace"'
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "options": [], "refresh": 1, "hide": 0},
        _query_variable("namespace", "Namespace", f"label_values({{{SERVICE_SERIES}}}, namespace)", multi=multi),
        _query_variable("service", "Service", f"label_values({{{SERVICE_SERIES}, {namespace_match}}}, service)",
                        multi=multi),
    ]


def _scaling_annotation(direction: str, selector: str, title: str, color: str) -> dict[str, Any]:
    return {
        "name": f"Scaled {direction}",
        "datasource": DATASOURCE,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": (f'sum by (namespace, service) (increase(gpufleet_autoscaler_decisions_total'
                 f'{{{selector}, direction="{direction}"}}[2m])) > 0'),
        "step": "1m",
        "titleFormat": title,
        "textFormat": "autoscaler decision",
        "tagKeys": "namespace,service",
    }


def _pod_annotations(selector: str) -> list[dict[str, Any]]:
    """New engine pods (rollouts, scale-outs, replacements) and guard restarts, from the guards' series."""
    common = {"datasource": DATASOURCE, "enable": True, "hide": False, "step": "1m",
              "tagKeys": "namespace,service,pod"}
    return [
        {**common, "name": "Replica started", "iconColor": "purple",
         "expr": f"count by (namespace, service, pod) (gpufleet_guard_ready{{{selector}}}"
                 f" unless gpufleet_guard_ready{{{selector}}} offset 2m)",
         "titleFormat": "{{pod}} started", "textFormat": "new engine pod (rollout, scale-out or replacement)"},
        {**common, "name": "Guard restarted", "iconColor": "red",
         "expr": f"sum by (namespace, service, pod) (resets(gpufleet_guard_requests_total{{{selector}}}[2m])) > 0",
         "titleFormat": "{{pod}} restarted", "textFormat": "the guard's counters reset: its container restarted"},
    ]


def alerts_table(title: str, description: str, selector: str) -> Panel:
    """The gpufleet alerts firing now, one row each."""
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": _with_ref_ids([target(f'ALERTS{{alertname=~"Gpufleet.+", alertstate="firing", {selector}}}',
                                         instant=True)]),
        "transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value": True, "__name__": True, "alertstate": True},
            "indexByName": {"alertname": 0, "severity": 1, "namespace": 2, "service": 3}}}],
        "fieldConfig": {"defaults": {"custom": {"align": "auto"}, "noValue": "none firing"}, "overrides": []},
        "options": {"showHeader": True, "sortBy": [{"displayName": "severity", "desc": False}]},
    }


def _dashboard(uid: str, title: str, description: str, grid: Grid, *, multi: bool,
               annotations: list[dict[str, Any]],
               extra_variables: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["gpufleet"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "timezone": "",
        "links": [{"title": "gpufleet dashboards", "type": "dashboards", "tags": ["gpufleet"],
                   "asDropdown": True, "includeVars": True, "keepTime": True}],
        "templating": {"list": _variables(multi=multi) + (extra_variables or [])},
        "annotations": {"list": annotations},
        "panels": grid.panels,
    }


# --- fleet overview ---------------------------------------------------------

def fleet_overview() -> dict[str, Any]:
    sel = 'namespace=~"$namespace", service=~"$service"'
    ttft_vs_objective = (
        f"histogram_quantile(0.99, namespace_service_le:gpufleet_guard_ttft_seconds_bucket:rate1h{{{sel}}})"
        " / on (namespace, service) namespace_service:gpufleet_slo_ttft_p99_seconds:objective")
    itl_vs_objective = (
        f"histogram_quantile(0.99, namespace_service_le:gpufleet_guard_itl_seconds_bucket:rate1h{{{sel}}})"
        " / on (namespace, service) namespace_service:gpufleet_slo_itl_p99_seconds:objective")
    gpus_in_use = (f"gpufleet_service_ready_replicas{{{sel}}}"
                   f" * on (namespace, service) gpufleet_service_gpus_per_replica{{{sel}}}")

    g = Grid()
    g.row("Fleet")
    g.add(stat("Services", "InferenceServices the operator manages.",
               [target(f"count(gpufleet_service_desired_replicas{{{sel}}})")], unit="none"), 4, 4)
    g.add(stat("Replicas ready / desired", "Ready engine replicas against what the operator wants.",
               [target(f"sum(gpufleet_service_ready_replicas{{{sel}}})", "ready"),
                target(f"sum(gpufleet_service_desired_replicas{{{sel}}})", "desired")], unit="none"), 4, 4)
    g.add(stat("GPUs in use", "GPUs held by ready replicas (replicas × GPUs per replica).",
               [target(f"sum({gpus_in_use})")], unit="none"), 4, 4)
    g.add(stat("Stranded GPUs", "Free GPUs that no InferenceService can use (all node pools).",
               [target("sum(gpufleet_stranded_gpus) or vector(0)")], unit="none", steps=((1, "orange"),)), 4, 4)
    g.add(stat("Refused (HTTP 429)", "Requests per second the guards refuse for lack of KV blocks or queue room.",
               [target(f"sum(namespace_service:gpufleet_guard_shed:rate5m{{{sel}}}) or vector(0)")],
               unit="reqps", steps=((0.01, "orange"),)), 4, 4)
    g.add(stat("Services missing a latency SLO",
               "Services whose TTFT or inter-token p99 over the last hour is above the objective.",
               [target(f"count(({ttft_vs_objective}) > 1 or on (namespace, service) ({itl_vs_objective}) > 1)"
                       " or vector(0)")], unit="none", steps=((1, "red"),)), 4, 4)

    g.row("Services")
    g.add(services_table(
        "Services", "One row per service; click a service for its dashboard. Latency columns are the "
        "last hour's p99 divided by the objective: above 100% misses the SLO.",
        [
            ("Ready", f"max by (namespace, service) (gpufleet_service_ready_replicas{{{sel}}})", "none"),
            ("Desired", f"max by (namespace, service) (gpufleet_service_desired_replicas{{{sel}}})", "none"),
            ("Max", f"max by (namespace, service) (gpufleet_service_max_replicas{{{sel}}})", "none"),
            ("KV cache", f"namespace_service:gpufleet_kv_cache_usage:ratio{{{sel}}}", "percentunit"),
            ("Refused", f"namespace_service:gpufleet_guard_shed:ratio_rate5m{{{sel}}}", "percentunit"),
            ("TTFT p99 / objective", ttft_vs_objective, "percentunit"),
            ("ITL p99 / objective", itl_vs_objective, "percentunit"),
            ("Fragmentation", f"max by (namespace, service) (gpufleet_fragmentation_ratio{{{sel}}})",
             "percentunit"),
        ]), 24, 9)

    g.row("Capacity")
    g.add(timeseries("Ready replicas", "Ready engine replicas per service.",
                     [target(f"max by (namespace, service) (gpufleet_service_ready_replicas{{{sel}}})",
                             "{{namespace}}/{{service}}")], unit="none", stack=True), 12)
    g.add(timeseries("GPUs in use and stranded",
                     "GPUs held by each service's ready replicas, and free GPUs nothing can use.",
                     [target(gpus_in_use, "{{namespace}}/{{service}}"),
                      target("sum by (node_pool, gpu_product) (gpufleet_stranded_gpus)",
                             "stranded: {{node_pool}} {{gpu_product}}")], unit="none"), 12)
    g.add(timeseries("KV-cache usage", "Mean KV-cache usage per service; the autoscaler scales out above "
                     "the service's high watermark (GpufleetKVCacheNearFull).",
                     [target(f"namespace_service:gpufleet_kv_cache_usage:ratio{{{sel}}}",
                             "{{namespace}}/{{service}}")], unit="percentunit", max_value=1), 12)
    g.add(timeseries("GPU memory fragmentation", "Worst replica's fragmentation per service, from the "
                     "audit (inactive split / reserved bytes of vLLM's caching allocator).",
                     [target(f"max by (namespace, service) (gpufleet_fragmentation_ratio{{{sel}}})",
                             "{{namespace}}/{{service}}")], unit="percentunit", max_value=1), 12)

    g.row("Traffic and SLOs")
    g.add(timeseries("Requests", "Finished requests per second per service (all outcomes).",
                     [target(f"namespace_service:gpufleet_guard_requests:rate5m{{{sel}}}",
                             "{{namespace}}/{{service}}")], unit="reqps"), 12)
    g.add(timeseries("Refused (HTTP 429)", "Share of requests refused for lack of KV blocks or queue "
                     "room (GpufleetRequestsShed above 5%).",
                     [target(f"namespace_service:gpufleet_guard_shed:ratio_rate5m{{{sel}}}",
                             "{{namespace}}/{{service}}")], unit="percentunit", threshold=0.05), 12)
    g.add(timeseries("TTFT p99 / objective (1h)", "Last hour's time-to-first-token p99 over the "
                     "service's objective; above 100% the SLO is missed.",
                     [target(ttft_vs_objective, "{{namespace}}/{{service}}")], unit="percentunit",
                     threshold=1), 12)
    g.add(timeseries("ITL p99 / objective (1h)", "Last hour's inter-token latency p99 over the "
                     "service's objective; above 100% the SLO is missed.",
                     [target(itl_vs_objective, "{{namespace}}/{{service}}")], unit="percentunit",
                     threshold=1), 12)

    g.row("Errors and alerts")
    g.add(alerts_table("Firing alerts", "gpufleet alerts firing now (critical pages, warning tickets).", sel), 12)
    g.add(timeseries("Failed requests (availability SLI, 5m)", "Share of requests answered with a 5xx, timed "
                     "out or refused for a queue timeout or an engine down, per service.",
                     [target("namespace_service_sli:gpufleet_guard_sli_error:ratio_rate5m"
                             f'{{{sel}, sli="availability"}}', "{{namespace}}/{{service}}")], unit="percentunit"), 12)

    g.row("Router")
    g.add(timeseries("Router requests by outcome", "Requests through `gpufleet router` per second, by "
                     "outcome (docs/router.md); invalid: the router's own 4xx or a guard's.",
                     [target("sum by (outcome) (rate(gpufleet_router_requests_total[$__rate_interval]))",
                             "{{outcome}}")], unit="reqps", stack=True), 6)
    g.add(timeseries("Replica picks by reason", "Why the router chose each replica: prefix affinity "
                     "(the replica it sent the prompt's leading blocks to), a new prefix placed, or the most "
                     "free KV blocks.",
                     [target("sum by (reason) (rate(gpufleet_router_picks_total[$__rate_interval]))",
                             "{{reason}}")], unit="ops", stack=True), 6)
    g.add(timeseries("Prefix-affinity hits", "Share of requests with a prefix key sent to a replica the "
                     "router had sent at least half of their leading blocks to: its estimate of the "
                     "prefix-cache hit share.",
                     [target("sum by (model) (rate(gpufleet_router_prefix_affinity_hits_total[$__rate_interval])) "
                             "/ sum by (model) (rate(gpufleet_router_prefix_keyed_requests_total"
                             "[$__rate_interval]))", "{{model}}")], unit="percentunit", max_value=1), 6)
    g.add(timeseries("Held requests and cold starts", "Requests the router holds for a service with no "
                     "ready replica, and the p90 time to a first ready replica.",
                     [target(f"sum by (namespace, service) (gpufleet_router_held_requests{{{sel}}})",
                             "held: {{namespace}}/{{service}}"),
                      target("histogram_quantile(0.9, sum by (le, namespace, service) (rate("
                             f"gpufleet_router_cold_start_seconds_bucket{{{sel}}}[$__rate_interval])))",
                             "cold start p90 (s): {{namespace}}/{{service}}")], unit="none"), 6)
    router_exemplars = (" The points are exemplars: a traced request in that bucket, its trace (the router's "
                        "spans, then the guard's) one click away (docs/tracing.md).")
    g.add(timeseries("Router time to first token", "Streamed answers through the router: arrival to the first "
                     "event sent to the client, holds, retries and a prefill included." + router_exemplars,
                     _quantiles("gpufleet_router_ttft_seconds", "", exemplars=True), unit="s"), 12)
    g.add(timeseries("Router request latency", "Arrival to the answer's last byte, through the router."
                     + router_exemplars, _quantiles("gpufleet_router_request_seconds", "", exemplars=True),
                     unit="s"), 12)

    _tenants_row(g, sel)

    g.row("Prefill / decode")
    g.add(timeseries("Prefill fallbacks", "Share of each disaggregated service's requests the router sent to "
                     "decode without a prefill (no prefill replica, refused, failed): decode computed the prompt.",
                     [target(f"sum by (namespace, service) (namespace_service_reason:gpufleet_router_prefill_fallbacks:"
                             f"rate5m{{{sel}}}) / on (namespace, service) namespace_service:gpufleet_router_"
                             f"disaggregated_requests:rate5m{{{sel}}}", "{{namespace}}/{{service}}")],
                     unit="percentunit", threshold=0.05), 8)
    g.add(timeseries("Refused per pool", "Share of requests each pool's guards refused with HTTP 429 "
                     "(GpufleetPrefillPoolStarved, GpufleetDecodePoolStarved).",
                     [target("namespace_service_role:gpufleet_guard_shed:ratio_rate5m"
                             f'{{{sel}, role=~"prefill|decode"}}',
                             "{{namespace}}/{{service}} {{role}}")], unit="percentunit", threshold=0.05), 8)
    g.add(timeseries("Decode KV hit rate", "Prompt tokens the decode pods loaded from the KV hand-off over those "
                     "they looked up (GpufleetKVHandoffHitRateLow below 50%).",
                     [target("namespace_service_role:vllm_external_prefix_cache_hit:ratio_rate5m"
                             f'{{{sel}, role="decode"}}',
                             "{{namespace}}/{{service}}")], unit="percentunit", max_value=1, threshold=0.5), 8)

    g.row("Operator")
    g.add(timeseries("Reconcile errors", "Failed reconciliations per second per service "
                     "(GpufleetReconcileErrors).",
                     [target(f"sum by (namespace, service) (rate(gpufleet_reconcile_errors_total{{{sel}}}"
                             "[$__rate_interval]))", "{{namespace}}/{{service}}")], unit="ops"), 8)
    g.add(timeseries("Reconcile latency", "Operator reconcile latency, all services.",
                     [target(f"histogram_quantile({q}, sum by (le) (rate(gpufleet_reconcile_duration_seconds_bucket"
                             "[$__rate_interval])))", f"p{round(q * 100)}") for q in (0.5, 0.99)], unit="s"), 8)
    g.add(timeseries("Replica metric read errors", "Failed reads of replica metrics: the autoscaler "
                     "is blind for these services.",
                     [target(f"sum by (namespace, service) (rate(gpufleet_metrics_read_errors_total{{{sel}}}"
                             "[$__rate_interval]))", "{{namespace}}/{{service}}")], unit="ops"), 8)

    return _dashboard(
        "gpufleet-fleet", "gpufleet / Fleet overview",
        "All InferenceServices: replicas, GPUs in use and stranded, refusals and SLO status.",
        g, multi=True,
        annotations=[_scaling_annotation("up", sel, "{{namespace}}/{{service}} scaled up", "green"),
                     _scaling_annotation("down", sel, "{{namespace}}/{{service}} scaled down", "blue"),
                     *_pod_annotations(sel)])


# --- tenants ----------------------------------------------------------------

def _tenants_row(g: Grid, sel: str) -> None:
    """Per tenant of the namespaces shown (docs/tenants.md): what it uses, what it is refused and why,
    and how full its limits are. The limits are the namespace's, not a service's: no service filter."""
    def tokens(metric: str) -> str:
        return f"sum by (namespace, tenant) (rate({metric}{{{sel}}}[$__rate_interval]))"
    g.row("Tenants")
    g.add(timeseries("Tokens by tenant", "Prompt plus answer tokens per second of each tenant's answered "
                     "requests, across the services shown: what tokensPerMinute limits and `gpufleet usage` "
                     "apportions replicas by.",
                     [target(tokens("gpufleet_tenant_prompt_tokens_total") + " + "
                             + tokens("gpufleet_tenant_answer_tokens_total"), "{{namespace}}/{{tenant}}")],
                     unit="short", stack=True), 6)
    g.add(timeseries("Requests by tenant", "Requests per second each tenant sent on to a replica; `unknown` "
                     "is every caller that is not a declared tenant.",
                     [target(f"sum by (namespace, tenant) (rate(gpufleet_tenant_requests_total{{{sel}}}"
                             "[$__rate_interval]))", "{{namespace}}/{{tenant}}")], unit="reqps", stack=True), 6)
    g.add(timeseries("Refusals by tenant and reason", "Requests per second refused: 401 for a missing, malformed "
                     "or unknown key (GpufleetTenantKeyFailures), 429 for a limit with no room "
                     "(GpufleetTenantAtQuota), or a guard's own refusal passed on.",
                     [target(f"sum by (namespace, tenant, reason) (rate(gpufleet_tenant_refusals_total{{{sel}}}"
                             "[$__rate_interval]))", "{{namespace}}/{{tenant}} {{reason}}")], unit="reqps"), 6)
    g.add(timeseries("Limits in use", "Share of each tenant's limits in use now, the fullest router's view "
                     "(each router holds its own budgets); 100% refuses, a token budget in debt reads above.",
                     [target('max by (namespace, tenant, limit) (gpufleet_tenant_limit_used_ratio'
                             '{namespace=~"$namespace"})', "{{namespace}}/{{tenant}} {{limit}}")],
                     unit="percentunit", threshold=1), 6)


# --- one service ------------------------------------------------------------

def _quantiles(histogram: str, selector: str, by: str = "le", exemplars: bool = False) -> list[dict[str, Any]]:
    """p50, p95 and p99; ``exemplars``: the p99's query shows the histogram's exemplars (one query does:
    each would show the same points)."""
    return [target(f"histogram_quantile({q}, sum by ({by}) (rate({histogram}_bucket{{{selector}}}"
                   "[$__rate_interval])))", f"p{round(q * 100)}", exemplar=exemplars and q == 0.99)
            for q in (0.5, 0.95, 0.99)]


def _quantiles_by_class(histogram: str, selector: str) -> list[dict[str, Any]]:
    return [target(f"histogram_quantile(0.95, sum by (class, le) (rate({histogram}_bucket{{{selector}}}"
                   "[$__rate_interval])))", "{{class}}")]


def _prefill_decode_rows(g: Grid, sel: str, latency_sel: str) -> None:
    """A disaggregated service's pools and hand-off, and the KV tier (a unified service with
    kvTier Shared shows in the second row too). Guard and vLLM series are split by pool with a
    join on the pod's gpufleet_guard_role_info (unified on a unified service); the router's
    per-model series reach the service through vLLM's model_name (the rules' served-model map)."""
    roles = f"gpufleet_guard_role_info{{{sel}}}"
    decode = f'gpufleet_guard_role_info{{{sel}, role="decode"}}'
    served_model = f"namespace_service_model:vllm_served_model:group{{{sel}}}"

    def by_role(per_pod: str) -> str:
        return f"{per_pod} * on (namespace, pod) group_left (role) {roles}"

    def router(per_model: str) -> str:
        return f"{per_model} * on (model) group_left () {served_model}"

    prefill_buckets = router("sum by (model, le) (rate(gpufleet_router_prefill_seconds_bucket[$__rate_interval]))")
    handoffs = router("sum by (model, transfer_params) (rate(gpufleet_router_handoffs_total[$__rate_interval]))")
    fallbacks = router("sum by (model, reason) (rate(gpufleet_router_prefill_fallbacks_total[$__rate_interval]))")

    g.row("Prefill / decode")
    g.add(timeseries("Replicas ready per role", "Engine pods per pool, and those whose guard is ready (a "
                     "request needs a ready prefill and a ready decode pod; unified: a unified service).",
                     [target(f"sum by (role) ({by_role(f'gpufleet_guard_ready{{{sel}}}')})", "ready {{role}}"),
                      target(f"count by (role) ({roles})", "pods {{role}}")], unit="none"), 6)
    g.add(timeseries("TTFT p99 per role", "The guards' time to first token per pool (all classes but "
                     "background). On prefill pods it is the prefill time (the answer is one token); on "
                     "decode pods the KV load and the first step; unified pods the whole prefill.",
                     [target(f"histogram_quantile(0.99, sum by (role, le) ("
                             f"{by_role(f'rate(gpufleet_guard_ttft_seconds_bucket{{{latency_sel}}}[$__rate_interval])')}))",
                             "{{role}}"),
                      target(f"namespace_service:gpufleet_slo_ttft_p99_seconds:objective{{{sel}}}", "p99 objective")],
                     unit="s"), 6)
    g.add(timeseries("ITL p99 per role", "Gap between streamed tokens per pool (decode streams the "
                     "answers), and the p99 objective.",
                     [target(f"histogram_quantile(0.99, sum by (role, le) ("
                             f"{by_role(f'rate(gpufleet_guard_itl_seconds_bucket{{{latency_sel}}}[$__rate_interval])')}))",
                             "{{role}}"),
                      target(f"namespace_service:gpufleet_slo_itl_p99_seconds:objective{{{sel}}}", "p99 objective")],
                     unit="s"), 6)
    g.add(timeseries("Router prefill time", "The router's prefill step for requests handed to decode: first "
                     "send to a prefill pod (retry included) to its answer. Above the TTFT objective at p99, "
                     "decode waits on prefill (GpufleetPrefillPoolStarved).",
                     [target(f"histogram_quantile({q}, sum by (le) ({prefill_buckets}))", f"p{round(q * 100)}")
                      for q in (0.5, 0.99)]
                     + [target(f"namespace_service:gpufleet_slo_ttft_p99_seconds:objective{{{sel}}}",
                               "TTFT p99 objective")], unit="s"), 6)
    g.add(timeseries("Hand-offs and prefill fallbacks", "Requests the router sent to decode: after a prefill "
                     "(transfer params returned by the connector, or none: shared storage finds the KV by the "
                     "prompt), or without one, by reason (decode computes the prompt). no_prefill_replica and "
                     "refused: prefill capacity; error, timeout, unreachable: failures "
                     "(GpufleetKVTransferFailures).",
                     [target(f"sum by (transfer_params) ({handoffs})", "hand-off ({{transfer_params}})"),
                      target(f"sum by (reason) ({fallbacks})", "fallback: {{reason}}")], unit="reqps", stack=True), 6)
    g.add(timeseries("KV hand-offs at the guards", "Admitted hand-off requests by phase and outcome (zero "
                     "series hidden). A decode error is a KV load that failed with loadFailurePolicy Fail, "
                     "or another vLLM error on a decode pod.",
                     [target(f"sum by (phase, outcome) (rate(gpufleet_guard_kv_handoffs_total{{{sel}}}"
                             "[$__rate_interval])) > 0", "{{phase}} {{outcome}}")], unit="reqps", stack=True), 6)
    g.add(timeseries("Refusals per role", "Requests each pool's guards refused, by reason (zero series "
                     "hidden). Decode refusals throw a finished prefill away (GpufleetDecodePoolStarved); "
                     "prefill refusals send the prompt to decode.",
                     [target(f"sum by (role, reason) ("
                             f"{by_role(f'rate(gpufleet_guard_rejections_total{{{sel}}}[$__rate_interval])')}) > 0",
                             "{{role}} {{reason}}")], unit="reqps", stack=True), 6)
    g.add(timeseries("Decode KV hit rate", "The KV tier's hit rate for the hand-off: prompt tokens the decode "
                     "pods loaded from the connector over those they looked up (vLLM's external prefix-cache "
                     "counters). Near 100% when hand-offs work (each prompt's last partial block is "
                     "computed); below 50% decode recomputes them (GpufleetKVHandoffHitRateLow).",
                     [target(f"sum(rate(vllm:external_prefix_cache_hits_total{{{sel}}}[$__rate_interval])"
                             f" * on (namespace, pod) group_left () {decode})"
                             f" / sum(rate(vllm:external_prefix_cache_queries_total{{{sel}}}[$__rate_interval])"
                             f" * on (namespace, pod) group_left () {decode})", "decode")],
                     unit="percentunit", max_value=1, threshold=0.5), 6)

    g.row("KV tier (KV shared through the connector)")
    g.add(timeseries("External prefix-cache hit rate per replica", "Per replica, prompt tokens loaded from "
                     "the KV connector over those looked up in it: on decode pods the hand-off, on a unified "
                     "service with kvTier Shared the prefixes other replicas computed, on prefill pods the "
                     "prompts already in the store (repeated ones).",
                     [target(f"sum by (pod) (rate(vllm:external_prefix_cache_hits_total{{{sel}}}[$__rate_interval]))"
                             f" / sum by (pod) (rate(vllm:external_prefix_cache_queries_total{{{sel}}}"
                             "[$__rate_interval]))", "{{pod}}")], unit="percentunit", max_value=1), 6)
    g.add(timeseries("Prompt tokens by source", "Prompt tokens per second the engines computed, found in "
                     "their own prefix cache, or loaded through the KV connector.",
                     [target(f"sum by (source) (rate(vllm:prompt_tokens_by_source_total{{{sel}}}[$__rate_interval]))",
                             "{{source}}")], unit="short", stack=True), 6)
    g.add(timeseries("Shared KV storage", "Bytes of prompt folders in the shared-storage connector's directory, "
                     "as each pod that writes it measured after its last bounding pass.",
                     [target(f"max by (pod) (gpufleet_guard_kv_storage_bytes{{{sel}}})", "{{pod}}")],
                     unit="bytes"), 6)
    g.add(timeseries("Prompts removed from shared storage", "Prompt folders the guards removed, oldest first, "
                     "to keep the directory under sharedStorageLimitBytes. Removed faster than decode loads "
                     "them, the hand-offs miss.",
                     [target(f"sum by (pod) (rate(gpufleet_guard_kv_storage_removed_prompts_total{{{sel}}}"
                             "[$__rate_interval]))", "{{pod}}")], unit="ops"), 6)


def _adapter_row(g: Grid, sel: str) -> None:
    """One row per LoRA adapter of the service (the `adapter` variable, repeated): its traffic,
    first-token latency, the loads and evictions its replicas' caches go through, and its state
    on each replica (GpufleetAdapterThrashing, GpufleetAdapterLoadFailing)."""
    one = f'{sel}, adapter="${ADAPTER_VARIABLE}"'
    g.row(f"LoRA adapters: ${ADAPTER_VARIABLE}", repeat=ADAPTER_VARIABLE)
    g.add(timeseries("Adapter requests", "Finished requests naming the adapter, by outcome, over the "
                     "service's replicas.",
                     [target(f"sum by (outcome) (rate(gpufleet_guard_adapter_requests_total{{{one}}}"
                             "[$__rate_interval]))", "{{outcome}}")], unit="reqps", stack=True), 6)
    g.add(timeseries("Adapter TTFT p99", "The adapter's time to first token at p99 (streaming requests, "
                     "every class), and the service's p99 objective. Loads from disk show here first.",
                     [target(f"histogram_quantile(0.99, sum by (le) (rate(gpufleet_guard_adapter_ttft_seconds_bucket"
                             f"{{{one}}}[$__rate_interval])))", "p99"),
                      target(f"namespace_service:gpufleet_slo_ttft_p99_seconds:objective{{{sel}}}",
                             "p99 objective")], unit="s"), 6)
    g.add(timeseries("Adapter loads and evictions", "Per second over the replicas: reads from disk into "
                     "vLLM's CPU-side adapter cache (cpuCacheAdapters), drops from it, moves into a GPU slot "
                     "(maxAdaptersPerBatch) and failed loads by reason; and loads per request (5m): above 0.2 "
                     "with evictions the caches thrash (GpufleetAdapterThrashing).",
                     [target(f"sum(rate(gpufleet_guard_adapter_loads_total{{{one}}}[$__rate_interval]))", "loads"),
                      target(f"sum(rate(gpufleet_guard_adapter_evictions_total{{{one}}}[$__rate_interval]))",
                             "evictions"),
                      target(f"sum(rate(gpufleet_guard_adapter_activations_total{{{one}}}[$__rate_interval]))",
                             "GPU slot activations"),
                      target(f"sum by (reason) (rate(gpufleet_guard_adapter_load_failures_total{{{one}}}"
                             "[$__rate_interval])) > 0", "failed: {{reason}}"),
                      target(f"namespace_service_adapter:gpufleet_guard_adapter_loads_per_request:ratio_rate5m"
                             f"{{{one}}}", "loads per request")], unit="short"), 6)
    g.add(timeseries("Adapter state per replica", "Replicas holding the adapter in each state: Loaded "
                     "serves it; Failed does not (GpufleetAdapterLoadFailing; kubectl describe iad says why).",
                     [target(f"count by (state) (gpufleet_guard_adapter_state{{{one}}} == 1)", "{{state}}")],
                     unit="none", stack=True), 6)


def service() -> dict[str, Any]:
    sel = 'namespace="$namespace", service="$service"'
    latency_sel = f"{sel}, {LATENCY_CLASSES}"

    def vs_objective(histogram: str, objective: str) -> str:
        return (f"histogram_quantile(0.99, namespace_service_le:{histogram}_bucket:rate1h{{{sel}}})"
                f" / on (namespace, service) namespace_service:{objective}:objective{{{sel}}}")

    g = Grid()
    g.row("Overview")
    g.add(stat("Replicas ready / desired", "Ready engine replicas against what the autoscaler wants.",
               [target(f"max(gpufleet_service_ready_replicas{{{sel}}})", "ready"),
                target(f"max(gpufleet_service_desired_replicas{{{sel}}})", "desired")], unit="none"), 4, 4)
    g.add(stat("KV-cache usage", "Mean KV-cache usage over the replicas.",
               [target(f"namespace_service:gpufleet_kv_cache_usage:ratio{{{sel}}}")], unit="percentunit",
               steps=((0.8, "orange"), (0.9, "red"))), 4, 4)
    g.add(stat("TTFT p99 / objective (1h)", "Above 100% the time-to-first-token SLO is missed.",
               [target(vs_objective("gpufleet_guard_ttft_seconds", "gpufleet_slo_ttft_p99_seconds"))],
               unit="percentunit", steps=((1, "red"),)), 4, 4)
    g.add(stat("ITL p99 / objective (1h)", "Above 100% the inter-token latency SLO is missed.",
               [target(vs_objective("gpufleet_guard_itl_seconds", "gpufleet_slo_itl_p99_seconds"))],
               unit="percentunit", steps=((1, "red"),)), 4, 4)
    g.add(stat("Refused (HTTP 429)", "Share of requests refused for lack of KV blocks or queue room.",
               [target(f"namespace_service:gpufleet_guard_shed:ratio_rate5m{{{sel}}} or vector(0)")],
               unit="percentunit", steps=((0.01, "orange"), (0.05, "red"))), 4, 4)
    g.add(stat("Fragmentation", "Worst replica's GPU memory fragmentation from the last audit.",
               [target(f"max(gpufleet_fragmentation_ratio{{{sel}}})")], unit="percentunit",
               steps=((0.25, "orange"),)), 4, 4)

    g.row("Errors, alerts and replicas")
    g.add(timeseries("Bad share by SLI (5m)", "Share of events the guard judged bad against the service's "
                     "objectives (gpufleet_guard_sli_*), and each SLI's error budget; the burn-rate alerts "
                     "compare the two.",
                     [target(f"namespace_service_sli:gpufleet_guard_sli_error:ratio_rate5m{{{sel}}}", "{{sli}}"),
                      target(f"namespace_service_sli:gpufleet_slo_error_budget:ratio{{{sel}}}", "{{sli}} budget")],
                     unit="percentunit"), 8)
    g.add(alerts_table("Firing alerts", "gpufleet alerts firing now for this service.", sel), 8)
    g.add(timeseries("Replicas ready and engines up", "Per pod: the guard ready (1), vLLM answering the "
                     "guard (1), and Prometheus scraping each endpoint (up).",
                     [target(f"gpufleet_guard_ready{{{sel}}}", "ready {{pod}}"),
                      target(f"gpufleet_guard_engine_up{{{sel}}}", "engine up {{pod}}"),
                      target(f"up{{{sel}}}", "scraped {{pod}} {{endpoint}}")], unit="none", max_value=1), 8)

    g.row("Latency (as clients see it; all classes but background)")
    exemplars = (" The points are exemplars: a traced request in that bucket, its trace one click away "
                 "(docs/tracing.md).")
    g.add(timeseries("Time to first token", "TTFT quantiles and the p99 objective." + exemplars,
                     _quantiles("gpufleet_guard_ttft_seconds", latency_sel, exemplars=True)
                     + [target(f"namespace_service:gpufleet_slo_ttft_p99_seconds:objective{{{sel}}}",
                               "p99 objective")], unit="s"), 8)
    g.add(timeseries("Inter-token latency", "Gap between streamed tokens: quantiles and the p99 objective."
                     + exemplars, _quantiles("gpufleet_guard_itl_seconds", latency_sel, exemplars=True)
                     + [target(f"namespace_service:gpufleet_slo_itl_p99_seconds:objective{{{sel}}}",
                               "p99 objective")], unit="s"), 8)
    g.add(timeseries("End-to-end latency", "Whole-request latency of admitted requests, and the p99 "
                     "objective of non-streaming requests (slo.requestP99Milliseconds)." + exemplars,
                     _quantiles("gpufleet_guard_request_seconds", latency_sel, exemplars=True)
                     + [target(f"max(gpufleet_service_slo_request_p99_seconds{{{sel}}})",
                               "non-streaming p99 objective")],
                     unit="s"), 8)
    g.add(timeseries("TTFT p99 per replica", "The guard's TTFT p99 per pod: one slow pod is a bad node or GPU.",
                     [target(f"histogram_quantile(0.99, sum by (pod, le) (rate(gpufleet_guard_ttft_seconds_bucket"
                             f"{{{latency_sel}}}[$__rate_interval])))", "{{pod}}")], unit="s"), 12)
    g.add(timeseries("vLLM's own TTFT", "Time to first token inside vLLM (prefill, without the guard's "
                     "queue). Against the guard's TTFT: queue or engine?",
                     _quantiles("vllm:time_to_first_token_seconds", sel), unit="s"), 12)

    g.row("Throughput")
    g.add(timeseries("Tokens per second", "Prompt tokens read and tokens generated by the engines.",
                     [target(f"sum(rate(vllm:prompt_tokens_total{{{sel}}}[$__rate_interval]))", "prompt"),
                      target(f"sum(rate(vllm:generation_tokens_total{{{sel}}}[$__rate_interval]))", "generated")],
                     unit="short"), 8)
    g.add(timeseries("Requests by outcome", "Finished requests per second at the guard.",
                     [target(f"sum by (outcome) (rate(gpufleet_guard_requests_total{{{sel}}}[$__rate_interval]))",
                             "{{outcome}}")], unit="reqps", stack=True), 8)
    g.add(timeseries("Refusals by reason", "kv_watermark, queue_full and queue_timeout are HTTP 429 "
                     "(shedding); context_length is the client's; draining and engine_down are outages.",
                     [target(f"sum by (reason) (rate(gpufleet_guard_rejections_total{{{sel}}}[$__rate_interval]))",
                             "{{reason}}")], unit="reqps", stack=True), 8)

    g.row("KV cache")
    g.add(timeseries("KV-cache usage against the watermarks",
                     "Per replica. Above the high watermark the autoscaler scales out, below the low one "
                     "it scales in; above the admission limit the guard answers HTTP 429.",
                     [target(f"vllm:kv_cache_usage_perc{{{sel}}}", "{{pod}}"),
                      target(f"namespace_service:gpufleet_kv_high_watermark:ratio{{{sel}}}", "high watermark"),
                      target(f"max(gpufleet_service_kv_low_watermark_ratio{{{sel}}})", "low watermark"),
                      target(f"1 - max(gpufleet_guard_kv_watermark_blocks{{{sel}}}"
                             f" / gpufleet_guard_kv_total_blocks{{{sel}}})", "admission limit")],
                     unit="percentunit", max_value=1), 8)
    g.add(timeseries("Free KV blocks", "Free blocks as the guard counts them, and the reserve it keeps.",
                     [target(f"gpufleet_guard_kv_free_blocks{{{sel}}}", "free {{pod}}"),
                      target(f"max(gpufleet_guard_kv_watermark_blocks{{{sel}}})", "admission limit (reserve)")],
                     unit="short"), 8)
    g.add(timeseries("Preemptions", "Sequences vLLM evicted for lack of KV blocks; should be ~0 "
                     "when admission works.",
                     [target(f"sum(rate(vllm:num_preemptions_total{{{sel}}}[$__rate_interval]))", "preemptions")],
                     unit="ops"), 8)

    _prefill_decode_rows(g, sel, latency_sel)

    g.row("GPU memory inside vLLM")
    g.add(timeseries("Allocator memory per replica",
                     "PyTorch's caching allocator in vLLM, per replica (all its devices): reserved from the GPU, "
                     "allocated to live tensors, and inactive split (reserved, free, usable only by "
                     "allocations that fit its pieces).",
                     [target(f"sum by (pod) (gpufleet_engine_gpu_memory_reserved_bytes{{{sel}}})", "reserved {{pod}}"),
                      target(f"sum by (pod) (gpufleet_engine_gpu_memory_allocated_bytes{{{sel}}})",
                             "allocated {{pod}}"),
                      target(f"sum by (pod) (gpufleet_engine_gpu_memory_inactive_split_bytes{{{sel}}})",
                             "inactive split {{pod}}")], unit="bytes"), 8)
    g.add(timeseries("Allocation retries and OOMs per minute",
                     "The symptom of lost memory: cudaMalloc failed, the allocator flushed its cache and "
                     "retried (each a stall), or failed outright (OOM). Should be 0.",
                     [target(f"sum by (pod) (rate(gpufleet_engine_gpu_memory_alloc_retries_total{{{sel}}}[5m])) * 60",
                             "retries {{pod}}"),
                      target(f"sum by (pod) (rate(gpufleet_engine_gpu_memory_ooms_total{{{sel}}}[5m])) * 60",
                             "OOMs {{pod}}")], unit="short"), 8)
    g.add(timeseries("KV-pool waste", "Share of the KV blocks in use that hold no token of an in-flight "
                     "request, per replica (a few percent with paged blocks; gaps: a request of unknown "
                     "length was in flight).",
                     [target(f"gpufleet_guard_kv_waste_ratio{{{sel}}}", "{{pod}}")],
                     unit="percentunit", max_value=1), 8)

    g.row("Queueing and batching")
    g.add(timeseries("Queue time p95 by class", "Time from arrival to dispatch to vLLM.",
                     _quantiles_by_class("gpufleet_guard_queue_seconds", sel), unit="s"), 8)
    g.add(timeseries("Queue share of latency by class", "Share of end-to-end latency spent queued "
                     "(GpufleetQueueTimeHigh above 40%, background excluded).",
                     [target(f"namespace_service_class:gpufleet_guard_queue_share:ratio_rate15m{{{sel}}}",
                             "{{class}}")], unit="percentunit", threshold=0.4), 8)
    g.add(timeseries("Queue depth by class", "Requests waiting in the guard's queues.",
                     [target(f"sum by (class) (gpufleet_guard_queue_depth{{{sel}}})", "{{class}}")],
                     unit="short", stack=True), 8)
    g.add(timeseries("Batch fill", "Requests dispatched to vLLM over maxConcurrency, per replica, and "
                     "the limit in force (lower while the TTFT control holds it down).",
                     [target(f"gpufleet_guard_in_flight{{{sel}}} / gpufleet_guard_max_concurrency{{{sel}}}",
                             "{{pod}}"),
                      target(f"gpufleet_guard_concurrency_limit{{{sel}}} / gpufleet_guard_max_concurrency{{{sel}}}",
                             "limit {{pod}}")], unit="percentunit", max_value=1), 8)
    g.add(timeseries("Engine scheduler", "Requests running and waiting inside vLLM, and tokens per "
                     "engine step.",
                     [target(f"sum(vllm:num_requests_running{{{sel}}})", "running"),
                      target(f"sum(vllm:num_requests_waiting{{{sel}}})", "waiting"),
                      target(f"sum(rate(vllm:iteration_tokens_total_sum{{{sel}}}[$__rate_interval]))"
                             f" / sum(rate(vllm:iteration_tokens_total_count{{{sel}}}[$__rate_interval]))",
                             "tokens per step")], unit="short"), 8)
    g.add(timeseries("Prefix-cache hit rate", "Share of prompt tokens served from the prefix cache.",
                     [target(f"sum(rate(vllm:prefix_cache_hits_total{{{sel}}}[$__rate_interval]))"
                             f" / sum(rate(vllm:prefix_cache_queries_total{{{sel}}}[$__rate_interval]))",
                             "hit rate")], unit="percentunit", max_value=1), 8)

    g.row("Scaling and fleet health")
    g.add(timeseries("Replicas", "Desired and ready replicas within the spec's bounds; scaling "
                     "decisions are annotated.",
                     [target(f"max(gpufleet_service_desired_replicas{{{sel}}})", "desired"),
                      target(f"max(gpufleet_service_ready_replicas{{{sel}}})", "ready"),
                      target(f"max(gpufleet_service_min_replicas{{{sel}}})", "min"),
                      target(f"max(gpufleet_service_max_replicas{{{sel}}})", "max"),
                      target(f"max(gpufleet_service_crashlooping_replicas{{{sel}}})", "crash-looping")],
                     unit="none"), 8)
    g.add(timeseries("GPU memory fragmentation", "Per replica and device, inactive split / reserved bytes of "
                     "vLLM's allocator; the audit's worst replica, and the threshold (GpufleetFragmentationHigh).",
                     [target(f"max by (pod, device) (gpufleet_engine_gpu_memory_fragmentation_ratio{{{sel}}})",
                             "{{pod}} gpu{{device}}"),
                      target(f"max(gpufleet_fragmentation_ratio{{{sel}}})", "audit (worst replica)"),
                      target(f"namespace_service:gpufleet_fragmentation_threshold:ratio{{{sel}}}", "threshold")],
                     unit="percentunit", max_value=1), 8)
    g.add(timeseries("Isolation and reconciliation", "Foreign pods on the service's reserved nodes, "
                     "and failed reconciliations per second.",
                     [target(f"max(gpufleet_isolation_violations{{{sel}}})", "foreign pods"),
                      target(f"sum(rate(gpufleet_reconcile_errors_total{{{sel}}}[$__rate_interval]))",
                             "reconcile errors/s")], unit="short"), 8)

    _adapter_row(g, sel)

    return _dashboard(
        SERVICE_DASHBOARD_UID, "gpufleet / Service",
        "One InferenceService: latency against its SLOs, throughput, KV cache against its watermarks, "
        "queueing, batching, prefix caching, preemptions, fragmentation and scaling.",
        g, multi=False,
        annotations=[_scaling_annotation("up", sel, "Scaled up", "green"),
                     _scaling_annotation("down", sel, "Scaled down", "blue"),
                     *_pod_annotations(sel)],
        extra_variables=[_query_variable(
            ADAPTER_VARIABLE, "LoRA adapter",
            f"label_values(gpufleet_guard_adapter_state{{{sel}}}, {ADAPTER_VARIABLE})", multi=True)])


# --- output -----------------------------------------------------------------

DASHBOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "gpufleet-fleet-overview.json": fleet_overview,
    "gpufleet-service.json": service,
}


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def build_all() -> dict[str, str]:
    """File name → JSON text, for every dashboard."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is out of date")
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write (default: next to this script)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in build_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python dashboards/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
