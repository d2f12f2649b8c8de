"""The dashboards' prefill/decode, KV-tier and LoRA adapter panels, queried in Prometheus's own engine (promtool)
over the series a disaggregated service and a unified service with kvTier Shared export, as
scraped (guard, vLLM and router targets with their labels; the unified one also serves LoRA
adapters) and with gpufleet's rules loaded:
each query returns a series for what it draws, no more (a join that matches nothing, or twice,
shows here), and the key ones the right values."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Any

import yaml

from tests.unit.observability.assets import (
    RULES,
    committed_dashboards,
    rule_groups,
    substitute_grafana_variables,
)

FLEET = "gpufleet-fleet-overview.json"
SERVICE = "gpufleet-service.json"
# The rows checked here, by dashboard.
ADAPTER_ROW = "LoRA adapters: $adapter"   # repeated per adapter; checked for ADAPTER
ROWS = {SERVICE: ("Prefill / decode", "KV tier (KV shared through the connector)", ADAPTER_ROW),
        FLEET: ("Prefill / decode", "Tenants")}
NAMESPACE = "default"
ADAPTER = "customer-a"
ADAPTER_STATES = ("Fetching", "Loading", "Loaded", "Failed", "Unloading")
EVAL_TIME = "30m"
MINUTES = 60


# --- the scraped series ---------------------------------------------------------

@dataclass
class Scrape:
    series: list[dict[str, str]] = field(default_factory=list)

    def add(self, name: str, labels: dict[str, str], values: str) -> None:
        matchers = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        self.series.append({"series": f"{name}{{{matchers}}}", "values": values})

    def per_minute(self, name: str, labels: dict[str, str], increase: float) -> None:
        self.add(name, labels, f"0+{increase}x{MINUTES}")

    def constant(self, name: str, labels: dict[str, str], value: float) -> None:
        self.add(name, labels, f"{value}x{MINUTES}")


def engine_pod(scrape: Scrape, service: str, pod: str, ip: str, role: str | None, *, model: str,
               requests: dict[str, float], ttft: tuple[float, float], itl: tuple[float, float] | None,
               shed_per_minute: float = 0,
               handoffs: dict[tuple[str, str], float] | None = None,
               external: tuple[float, float] | None = None, tokens_by_source: dict[str, float] | None = None,
               storage_bytes: float | None = None, removed_per_minute: float = 0) -> None:
    """One engine pod's guard and vLLM targets as the PodMonitor labels them: `role` only on a
    disaggregated service's pods. The guard's own role_info{role} meets the target's `role` label
    there, and Prometheus keeps the target's (the guard's becomes exported_role)."""
    target = {"namespace": NAMESPACE, "service": service, "pod": pod, "instance": f"{ip}:8080",
              **({"role": role} if role else {})}
    guard = {**target, "endpoint": "http", "job": f"{NAMESPACE}/{service}-engine"}
    vllm = {**target, "endpoint": "vllm", "job": f"{NAMESPACE}/{service}-engine", "model_name": model, "engine": "0"}
    role_info = {**guard, "role": role, "exported_role": role} if role else {**guard, "role": "unified"}
    scrape.constant("gpufleet_guard_role_info", role_info, 1)
    scrape.constant("gpufleet_guard_ready", guard, 1)
    # Latency histograms: (per minute under 0.5 s, per minute between 0.5 and 1 s); zero rates on
    # a pod that streams nothing (a prefill pod has no inter-token gaps).
    for histogram, counts in (("gpufleet_guard_ttft_seconds_bucket", ttft), ("gpufleet_guard_itl_seconds_bucket", itl)):
        fast, slow = counts or (0, 0)
        for le, per_minute in (("0.5", fast), ("1", fast + slow), ("+Inf", fast + slow)):
            scrape.per_minute(histogram, {**guard, "class": "interactive", "le": le}, per_minute)
    for outcome, per_minute in requests.items():
        scrape.per_minute("gpufleet_guard_requests_total", {**guard, "class": "interactive", "outcome": outcome},
                          per_minute)
    for reason in ("kv_watermark", "queue_full"):
        scrape.per_minute("gpufleet_guard_rejections_total", {**guard, "class": "interactive", "reason": reason},
                          shed_per_minute if reason == "kv_watermark" else 0)
    for phase in ("prefill", "decode"):
        for outcome in ("ok", "error"):
            scrape.per_minute("gpufleet_guard_kv_handoffs_total", {**guard, "phase": phase, "outcome": outcome},
                              (handoffs or {}).get((phase, outcome), 0))
    if storage_bytes is not None:
        scrape.constant("gpufleet_guard_kv_storage_bytes", guard, storage_bytes)
        scrape.per_minute("gpufleet_guard_kv_storage_removed_prompts_total", guard, removed_per_minute)
    scrape.constant("vllm:num_requests_running", vllm, 2)
    if external:
        queries, hits = external
        scrape.per_minute("vllm:external_prefix_cache_queries_total", vllm, queries)
        scrape.per_minute("vllm:external_prefix_cache_hits_total", vllm, hits)
    for source, per_minute in (tokens_by_source or {}).items():
        scrape.per_minute("vllm:prompt_tokens_by_source_total", {**vllm, "source": source}, per_minute)


def adapter_on_pod(scrape: Scrape, service: str, pod: str, ip: str, adapter: str, state: str, *,
                   requests: dict[str, float] | None = None, ttft: tuple[float, float] = (0, 0),
                   loads: float = 0, evictions: float = 0, activations: float = 0,
                   failures: dict[str, float] | None = None) -> None:
    """One LoRA adapter on a unified service's replica, as its guard exports it: a state gauge per
    state (1 for the one it is in), per-adapter requests and TTFT, and vLLM's cache counters
    (per minute); a load-failure series only once a load failed."""
    guard = {"namespace": NAMESPACE, "service": service, "pod": pod, "instance": f"{ip}:8080",
             "endpoint": "http", "job": f"{NAMESPACE}/{service}-engine", "adapter": adapter}
    for name in ADAPTER_STATES:
        scrape.constant("gpufleet_guard_adapter_state", {**guard, "state": name}, 1 if name == state else 0)
    for outcome, per_minute in (requests or {}).items():
        scrape.per_minute("gpufleet_guard_adapter_requests_total", {**guard, "outcome": outcome}, per_minute)
    fast, slow = ttft
    for le, per_minute in (("0.5", fast), ("1", fast + slow), ("+Inf", fast + slow)):
        scrape.per_minute("gpufleet_guard_adapter_ttft_seconds_bucket", {**guard, "le": le}, per_minute)
    scrape.per_minute("gpufleet_guard_adapter_loads_total", guard, loads)
    scrape.per_minute("gpufleet_guard_adapter_evictions_total", guard, evictions)
    scrape.per_minute("gpufleet_guard_adapter_activations_total", guard, activations)
    for reason, per_minute in (failures or {}).items():
        scrape.per_minute("gpufleet_guard_adapter_load_failures_total", {**guard, "reason": reason}, per_minute)


def router_pod(scrape: Scrape, pod: str, ip: str, model: str, *, handoffs: float,
               fallbacks: dict[str, float], prefill: tuple[float, float]) -> None:
    """A router pod's target as the chart's ServiceMonitor labels it: its own namespace and
    Service, and `model` on the series."""
    target = {"namespace": "gpufleet-system", "service": "gpufleet-router", "pod": pod, "instance": f"{ip}:8000",
              "job": "gpufleet-router", "model": model}
    scrape.per_minute("gpufleet_router_handoffs_total", {**target, "transfer_params": "none"}, handoffs)
    for reason, per_minute in fallbacks.items():
        scrape.per_minute("gpufleet_router_prefill_fallbacks_total", {**target, "reason": reason}, per_minute)
    fast, slow = prefill
    for le, per_minute in (("0.25", fast), ("0.5", fast + slow), ("+Inf", fast + slow)):
        scrape.per_minute("gpufleet_router_prefill_seconds_bucket", {**target, "le": le}, per_minute)


def tenant_usage(scrape: Scrape, pod: str, ip: str) -> None:
    """A router's tenant series as its ServiceMonitor keeps them (honorLabels): the namespace and service
    the request was for, not the router's own."""
    target = {"pod": pod, "instance": f"{ip}:8000", "job": "gpufleet-router"}
    usage = {**target, "namespace": NAMESPACE, "service": "chat", "model": "chat-model"}
    # tenant: requests, prompt, cached and answer tokens a minute
    for tenant, requests, prompt, cached, answer in (("search", 60, 30000, 12000, 6000), ("batch", 30, 12000, 0, 3000)):
        labels = {**usage, "tenant": tenant}
        scrape.per_minute("gpufleet_tenant_requests_total", labels, requests)
        scrape.per_minute("gpufleet_tenant_prompt_tokens_total", labels, prompt)
        scrape.per_minute("gpufleet_tenant_cached_prompt_tokens_total", labels, cached)
        scrape.per_minute("gpufleet_tenant_answer_tokens_total", labels, answer)
    scrape.per_minute("gpufleet_tenant_refusals_total", {**usage, "tenant": "search", "reason": "tokens_per_minute"}, 6)
    scrape.per_minute("gpufleet_tenant_refusals_total", {**usage, "tenant": "unknown", "reason": "key_unknown"}, 3)
    scrape.constant("gpufleet_tenant_limit_used_ratio",
                    {**target, "namespace": NAMESPACE, "tenant": "search", "limit": "tokens_per_minute"}, 0.9)
    scrape.constant("gpufleet_tenant_limit_used_ratio",
                    {**target, "namespace": NAMESPACE, "tenant": "batch", "limit": "concurrent_requests"}, 0.5)


def fleet() -> Scrape:
    s = Scrape()
    # chat: one prefill and two decode pods sharing KV through the shared-storage connector; the
    # prefill pod writes the directory; decode-a refuses 2 requests a minute; one decode hand-off
    # a minute fails.
    engine_pod(s, "chat", "chat-prefill-a", "10.0.0.1", "prefill", model="chat-model", requests={"ok": 45},
               ttft=(40, 5), itl=None,
               handoffs={("prefill", "ok"): 45}, tokens_by_source={"local_compute": 20000},
               storage_bytes=2e9, removed_per_minute=3)
    engine_pod(s, "chat", "chat-decode-a", "10.0.0.2", "decode", model="chat-model",
               requests={"ok": 22, "error": 1, "rejected": 2}, ttft=(20, 2), itl=(2000, 10),
               shed_per_minute=2, handoffs={("decode", "ok"): 22, ("decode", "error"): 1}, external=(10000, 9500),
               tokens_by_source={"local_compute": 500, "external_kv_transfer": 9500})
    engine_pod(s, "chat", "chat-decode-b", "10.0.0.3", "decode", model="chat-model", requests={"ok": 22},
               ttft=(22, 0), itl=(2000, 0),
               handoffs={("decode", "ok"): 22}, external=(10000, 9500),
               tokens_by_source={"local_compute": 500, "external_kv_transfer": 9500})
    s.constant("gpufleet_service_slo_ttft_p99_seconds", {"namespace": NAMESPACE, "service": "chat"}, 1)
    router_pod(s, "gpufleet-router-a", "10.1.0.1", "chat-model", handoffs=45, fallbacks={"refused": 3, "timeout": 2},
               prefill=(40, 5))
    tenant_usage(s, "gpufleet-router-a", "10.1.0.1")
    # tier: a unified service with kvTier Shared; both replicas write and read the tier.
    for pod, ip in (("tier-engine-a", "10.0.1.1"), ("tier-engine-b", "10.0.1.2")):
        engine_pod(s, "tier", pod, ip, None, model="tier-model", requests={"ok": 31}, ttft=(30, 1), itl=(1500, 5),
                   external=(8000, 2400),
                   tokens_by_source={"local_compute": 5000, "local_cache_hit": 600, "external_kv_transfer": 2400},
                   storage_bytes=1e9, removed_per_minute=0)
    # tier's LoRA adapters: customer-a Loaded on tier-engine-a (its cache reloading it for some
    # requests), Failed on tier-engine-b (vLLM refusing it once a minute); customer-b, busier, on
    # tier-engine-a only (the panels for customer-a must not count it).
    adapter_on_pod(s, "tier", "tier-engine-a", "10.0.1.1", ADAPTER, "Loaded", requests={"ok": 30, "rejected": 3},
                   ttft=(20, 10), loads=6, evictions=6, activations=30)
    adapter_on_pod(s, "tier", "tier-engine-b", "10.0.1.2", ADAPTER, "Failed", failures={"LoadFailed": 1})
    adapter_on_pod(s, "tier", "tier-engine-a", "10.0.1.1", "customer-b", "Loaded", requests={"ok": 60},
                   ttft=(60, 0), loads=1, evictions=1, activations=60)
    return s


# --- what each query returns --------------------------------------------------------

# (dashboard, panel, refId) → series it returns (NaN left out) for the service shown: chat, the
# disaggregated one, and tier, the unified one. The fleet overview shows every service.
SERIES = {
    (SERVICE, "Replicas ready per role", "A"): {"chat": 2, "tier": 1},       # prefill, decode | unified
    (SERVICE, "Replicas ready per role", "B"): {"chat": 2, "tier": 1},
    (SERVICE, "TTFT p99 per role", "A"): {"chat": 2, "tier": 1},
    (SERVICE, "TTFT p99 per role", "B"): {"chat": 1, "tier": 1},             # the objective
    (SERVICE, "ITL p99 per role", "A"): {"chat": 1, "tier": 1},              # prefill pods stream nothing
    (SERVICE, "ITL p99 per role", "B"): {"chat": 1, "tier": 1},
    (SERVICE, "Router prefill time", "A"): {"chat": 1, "tier": 0},
    (SERVICE, "Router prefill time", "B"): {"chat": 1, "tier": 0},
    (SERVICE, "Router prefill time", "C"): {"chat": 1, "tier": 1},
    (SERVICE, "Hand-offs and prefill fallbacks", "A"): {"chat": 1, "tier": 0},
    (SERVICE, "Hand-offs and prefill fallbacks", "B"): {"chat": 2, "tier": 0},
    (SERVICE, "KV hand-offs at the guards", "A"): {"chat": 3, "tier": 0},    # prefill ok, decode ok and error
    (SERVICE, "Refusals per role", "A"): {"chat": 1, "tier": 0},
    (SERVICE, "Decode KV hit rate", "A"): {"chat": 1, "tier": 0},
    (SERVICE, "External prefix-cache hit rate per replica", "A"): {"chat": 2, "tier": 2},
    (SERVICE, "Prompt tokens by source", "A"): {"chat": 2, "tier": 3},
    (SERVICE, "Shared KV storage", "A"): {"chat": 1, "tier": 2},
    (SERVICE, "Prompts removed from shared storage", "A"): {"chat": 1, "tier": 2},
    (SERVICE, "Adapter requests", "A"): {"chat": 0, "tier": 2},                # ok, rejected
    (SERVICE, "Adapter TTFT p99", "A"): {"chat": 0, "tier": 1},
    (SERVICE, "Adapter TTFT p99", "B"): {"chat": 1, "tier": 1},                # the objective
    (SERVICE, "Adapter loads and evictions", "A"): {"chat": 0, "tier": 1},
    (SERVICE, "Adapter loads and evictions", "B"): {"chat": 0, "tier": 1},
    (SERVICE, "Adapter loads and evictions", "C"): {"chat": 0, "tier": 1},
    (SERVICE, "Adapter loads and evictions", "D"): {"chat": 0, "tier": 1},     # failed: LoadFailed
    (SERVICE, "Adapter loads and evictions", "E"): {"chat": 0, "tier": 1},
    (SERVICE, "Adapter state per replica", "A"): {"chat": 0, "tier": 2},       # Loaded, Failed
    (FLEET, "Prefill fallbacks", "A"): {"": 1},
    (FLEET, "Refused per pool", "A"): {"": 2},
    (FLEET, "Decode KV hit rate", "A"): {"": 1},
    (FLEET, "Tokens by tenant", "A"): {"": 2},
    (FLEET, "Requests by tenant", "A"): {"": 2},
    (FLEET, "Refusals by tenant and reason", "A"): {"": 2},
    (FLEET, "Limits in use", "A"): {"": 2},
}

# (dashboard, panel, refId, service) → {labels: value}, rounded to 0.001.
VALUES = {
    (SERVICE, "Replicas ready per role", "A", "chat"): {'{role="prefill"}': 1, '{role="decode"}': 2},
    (SERVICE, "Replicas ready per role", "A", "tier"): {'{role="unified"}': 2},
    (SERVICE, "Hand-offs and prefill fallbacks", "B", "chat"): {
        '{reason="refused"}': 0.05, '{reason="timeout"}': 0.033},
    (SERVICE, "KV hand-offs at the guards", "A", "chat"): {
        '{phase="prefill", outcome="ok"}': 0.75, '{phase="decode", outcome="ok"}': 0.733,
        '{phase="decode", outcome="error"}': 0.017},
    (SERVICE, "Refusals per role", "A", "chat"): {'{role="decode", reason="kv_watermark"}': 0.033},
    (SERVICE, "Decode KV hit rate", "A", "chat"): {"{}": 0.95},
    (SERVICE, "External prefix-cache hit rate per replica", "A", "tier"): {
        '{pod="tier-engine-a"}': 0.3, '{pod="tier-engine-b"}': 0.3},
    (SERVICE, "Adapter requests", "A", "tier"): {'{outcome="ok"}': 0.5, '{outcome="rejected"}': 0.05},
    (SERVICE, "Adapter TTFT p99", "A", "tier"): {"{}": 0.985},                 # 0.5 + (29.7 - 20) / 10 * 0.5
    (SERVICE, "Adapter loads and evictions", "A", "tier"): {"{}": 0.1},
    (SERVICE, "Adapter loads and evictions", "D", "tier"): {'{reason="LoadFailed"}': 0.017},
    (SERVICE, "Adapter loads and evictions", "E", "tier"): {                # 6 loads per 33 requests
        '{namespace="default", service="tier", adapter="customer-a"}': 0.182},
    (SERVICE, "Adapter state per replica", "A", "tier"): {'{state="Loaded"}': 1, '{state="Failed"}': 1},
    (FLEET, "Prefill fallbacks", "A", ""): {'{namespace="default", service="chat"}': 0.1},
    (FLEET, "Refused per pool", "A", ""): {
        '{namespace="default", service="chat", role="prefill"}': 0,
        '{namespace="default", service="chat", role="decode"}': 0.043},   # 2 of 47 a minute
    (FLEET, "Decode KV hit rate", "A", ""): {'{namespace="default", service="chat", role="decode"}': 0.95},
    (FLEET, "Tokens by tenant", "A", ""): {'{namespace="default", tenant="search"}': 600,
                                          '{namespace="default", tenant="batch"}': 250},
    (FLEET, "Refusals by tenant and reason", "A", ""): {
        '{namespace="default", tenant="search", reason="tokens_per_minute"}': 0.1,
        '{namespace="default", tenant="unknown", reason="key_unknown"}': 0.05},
    (FLEET, "Limits in use", "A", ""): {'{namespace="default", tenant="search", limit="tokens_per_minute"}': 0.9,
                                       '{namespace="default", tenant="batch", limit="concurrent_requests"}': 0.5},
}


def checked_targets() -> dict[tuple[str, str, str], str]:
    """(dashboard, panel, refId) → expr, for every target of the rows checked here."""
    found = {}
    for name, dashboard in committed_dashboards().items():
        row = None
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                row = panel["title"]
            elif row in ROWS.get(name, ()):
                for t in panel["targets"]:
                    found[(name, panel["title"], t["refId"])] = t["expr"]
    return found


def query(dashboard: str, expr: str, service: str) -> str:
    if dashboard == FLEET:
        return substitute_grafana_variables(expr.replace("$namespace", ".+").replace("$service", ".+"))
    return substitute_grafana_variables(expr.replace("$namespace", NAMESPACE).replace("$service", service)
                                        .replace("$adapter", ADAPTER))


def test_every_panel_of_the_rows_is_checked():
    assert set(checked_targets()) == set(SERIES)
    assert set(k[:3] for k in VALUES) <= set(SERIES)


def test_the_panels_return_their_series_in_prometheus(promtool, tmp_path):
    cases: list[dict[str, Any]] = []
    for (dashboard, title, ref), expr in checked_targets().items():
        for service, count in SERIES[(dashboard, title, ref)].items():
            q = query(dashboard, expr, service)
            cases.append({"expr": f"count(({q}) >= 0)", "eval_time": EVAL_TIME,
                          "exp_samples": [{"labels": "{}", "value": count}] if count else []})
            values = VALUES.get((dashboard, title, ref, service))
            if values is not None:
                cases.append({"expr": f"round(({q}), 0.001)", "eval_time": EVAL_TIME,
                              "exp_samples": [{"labels": labels, "value": value} for labels, value in values.items()]})
    test_file = tmp_path / "dashboard_data_test.yaml"
    test_file.write_text(yaml.safe_dump({
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "group_eval_order": [group["name"] for group in rule_groups()],
        "tests": [{"interval": "1m", "input_series": fleet().series, "promql_expr_test": cases}],
    }, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

