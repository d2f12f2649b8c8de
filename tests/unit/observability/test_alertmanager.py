"""rules/alertmanager.yaml: gpufleet's routing and inhibition. Checked by structure (the matchers
name real alerts; a small evaluator of the inhibit rules on the alerts of one incident) and, where
amtool is installed (Debian's prometheus-alertmanager), by Alertmanager's own parser and router."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.unit.observability.assets import REPO, alerting_rules

CONFIG = REPO / "rules" / "alertmanager.yaml"
ALERTS = {rule["alert"] for rule in alerting_rules()}
_MATCHER = re.compile(r'^(\w+)(=~|!~|!=|=)"(.*)"$')


def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def matches(matchers: list[str], labels: dict[str, str]) -> bool:
    for matcher in matchers:
        name, op, value = _MATCHER.match(matcher).groups()
        got = labels.get(name, "")
        ok = {"=": got == value, "!=": got != value,
              "=~": re.fullmatch(value, got) is not None, "!~": re.fullmatch(value, got) is None}[op]
        if not ok:
            return False
    return True


def inhibited(alert: dict[str, str], firing: list[dict[str, str]]) -> bool:
    return any(matches(rule["target_matchers"], alert) and matches(rule["source_matchers"], source)
               and source is not alert and all(alert.get(k, "") == source.get(k, "") for k in rule.get("equal", []))
               for rule in config()["inhibit_rules"] for source in firing)


def test_every_alert_named_in_a_matcher_exists():
    named = set()
    for rule in config()["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            name, op, value = _MATCHER.match(matcher).groups()
            if name == "alertname" and op in ("=", "=~"):
                named |= {a for a in ALERTS if re.fullmatch(value, a)}
                if "|" in value or op == "=":
                    assert set(value.split("|")) <= ALERTS, value
    assert named


def test_notifications_are_grouped_per_alert_and_service():
    route, = config()["route"]["routes"]
    assert route["group_by"] == ["alertname", "namespace", "service"]


def svc(alertname: str, severity: str, **labels: str) -> dict[str, str]:
    return {"alertname": alertname, "severity": severity, "namespace": "prod", "service": "chat", **labels}


def test_one_incident_pages_once():
    burn_1h = svc("GpufleetTTFTBudgetBurn", "critical", slo="ttft", burn_window="1h")
    burn_6h = svc("GpufleetTTFTBudgetBurn", "critical", slo="ttft", burn_window="6h")
    ticket = svc("GpufleetTTFTBudgetBurn", "warning", slo="ttft", burn_window="3d")
    shed_crit, shed_warn = svc("GpufleetRequestsShed", "critical"), svc("GpufleetRequestsShed", "warning")
    other_service = {**burn_6h, "service": "embed"}
    firing = [burn_1h, burn_6h, ticket, shed_crit, shed_warn, other_service]
    assert [a for a in firing if not inhibited(a, firing)] == [burn_1h, shed_crit, other_service]


def test_engine_down_silences_the_symptoms_of_that_service_only():
    down = svc("GpufleetEngineDown", "critical")
    symptoms = [svc(f"Gpufleet{n}BudgetBurn", "critical", burn_window="1h")
                for n in ("TTFT", "ITL", "RequestLatency", "Availability")] + [svc("GpufleetRequestsShed", "warning")]
    elsewhere = {**symptoms[0], "service": "embed"}
    firing = [down, *symptoms, elsewhere]
    assert [a for a in firing if not inhibited(a, firing)] == [down, elsewhere]


def test_a_prefill_pool_skipped_is_one_ticket_not_two():
    # Requests skipping prefill reach decode without a hand-off: decode's hit rate drops with them.
    for cause in (svc("GpufleetPrefillPoolStarved", "warning", cause="capacity"),
                  svc("GpufleetKVTransferFailures", "warning", phase="prefill")):
        misses = svc("GpufleetKVHandoffHitRateLow", "warning")
        elsewhere = {**misses, "service": "embed"}
        firing = [cause, misses, elsewhere]
        assert [a for a in firing if not inhibited(a, firing)] == [cause, elsewhere]
    # Decode failing its loads does not explain the misses of loads that were recomputed.
    load_errors = svc("GpufleetKVTransferFailures", "warning", phase="decode")
    misses = svc("GpufleetKVHandoffHitRateLow", "warning")
    assert [a for a in [load_errors, misses] if not inhibited(a, [load_errors, misses])] == [load_errors, misses]


def test_engine_down_silences_the_prefill_decode_alerts_of_that_service():
    down = svc("GpufleetEngineDown", "critical")
    pd = [svc("GpufleetKVTransferFailures", "warning", phase="prefill"),
          svc("GpufleetPrefillPoolStarved", "warning", cause="capacity"),
          svc("GpufleetDecodePoolStarved", "warning"), svc("GpufleetKVHandoffHitRateLow", "warning")]
    firing = [down, *pd]
    assert [a for a in firing if not inhibited(a, firing)] == [down]


def test_engine_down_silences_the_adapter_alerts_of_that_service():
    down = svc("GpufleetEngineDown", "critical")
    adapters = [svc("GpufleetAdapterLoadFailing", "warning", adapter="customer-a", reason="LoadFailed"),
                svc("GpufleetAdapterThrashing", "warning", adapter="customer-b")]
    elsewhere = {**adapters[1], "service": "embed"}
    firing = [down, *adapters, elsewhere]
    assert [a for a in firing if not inhibited(a, firing)] == [down, elsewhere]


def test_operator_down_silences_the_alerts_built_on_its_metrics():
    for source in ({"alertname": "GpufleetOperatorDown", "severity": "warning"},
                   {"alertname": "GpufleetMetricsMissing", "severity": "warning", "target": "operator"}):
        kv = svc("GpufleetKVCacheNearFull", "warning")
        burn = svc("GpufleetTTFTBudgetBurn", "critical", burn_window="1h")
        firing = [source, kv, burn]
        assert [a for a in firing if not inhibited(a, firing)] == [source, burn]


@pytest.fixture(scope="module")
def amtool() -> str:
    path = shutil.which("amtool")
    if not path:
        pytest.skip("amtool is not installed (scripts/install-prometheus.sh installs it); checked by structure only")
    return path


def test_amtool_accepts_the_config(amtool):
    result = subprocess.run([amtool, "check-config", str(CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("labels, receiver", [
    (["alertname=GpufleetTTFTBudgetBurn", "severity=critical"], "gpufleet-page"),
    (["alertname=GpufleetRequestsShed", "severity=warning"], "gpufleet-ticket"),
    (["alertname=GpufleetPrefillPoolStarved", "severity=warning", "cause=capacity"], "gpufleet-ticket"),
    (["alertname=GpufleetAdapterThrashing", "severity=warning", "adapter=customer-b"], "gpufleet-ticket"),
    (["alertname=KubePodCrashLooping", "severity=critical"], "default"),
])
def test_amtool_routes_pages_and_tickets(amtool, labels, receiver):
    result = subprocess.run([amtool, "config", "routes", "test", f"--config.file={CONFIG}", *labels],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == receiver, result.stdout + result.stderr
