"""The tenant alerts and dashboard read the refusal reasons and metric names the router exports: one
source, gpufleet_api/tenants/usage.py (a reason spelt differently here would leave an alert silent)."""
from __future__ import annotations

import re

from gpufleet_api.tenants import usage
from tests.unit.observability.assets import committed_dashboards, dashboard_queries, rules


def _rule(name: str) -> dict:
    return next(r for r in rules() if r.get("record") == name or r.get("alert") == name)


def test_the_limit_refusals_are_the_limits_the_router_counts():
    expr = _rule("namespace_tenant:gpufleet_tenant_limit_refusals:rate5m")["expr"]
    (reasons,) = re.findall(r'reason=~"([^"]+)"', expr)
    assert tuple(reasons.split("|")) == usage.LIMITS


def test_the_key_failures_alert_counts_unknown_keys():
    assert f'reason="{usage.KEY_UNKNOWN}"' in _rule("GpufleetTenantKeyFailures")["expr"]


def test_the_tenants_row_draws_every_usage_metric():
    exprs = " ".join(expr for d in committed_dashboards().values() for _, expr in dashboard_queries(d))
    for name in (usage.REQUESTS, usage.REFUSALS, usage.PROMPT_TOKENS, usage.ANSWER_TOKENS, usage.LIMIT_USED):
        assert name in exprs, name
