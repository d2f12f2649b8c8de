"""The alert rules: valid for Prometheus, unit-tested with promtool in both
directions (fires / stays silent), and each alert is actionable: a severity,
a summary, a description and a runbook that exists."""
from __future__ import annotations

import re
import subprocess
from collections import Counter

import pytest

from tests.unit.observability.assets import (
    REPO,
    RULE_TESTS,
    RULES,
    RUNBOOKS,
    alert_test_cases,
    alerting_rules,
    rule_groups,
    rule_test_files,
)

SEVERITIES = {"critical", "warning"}  # critical pages, warning opens a ticket
RUNBOOK_SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation", "## Escalation")
ALERT_NAMES = sorted({rule["alert"] for rule in alerting_rules()})


def rule_id(rule: dict) -> str:
    extra = {k: v for k, v in rule.get("labels", {}).items() if k != "severity"}
    return f'{rule["alert"]}[{rule["labels"]["severity"]}{"".join(f",{v}" for v in extra.values())}]'


def test_promtool_accepts_the_rules_file(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass(promtool):
    result = subprocess.run([promtool, "test", "rules", *map(str, RULE_TESTS)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_set_is_small_and_symptom_based():
    # 18 for a unified fleet, four that only prefill/decode services can fire (the hand-off
    # failing, either pool starved, decode recomputing the hand-offs), two that only services with
    # LoRA adapters can fire (an adapter failing to load, adapters thrashing the caches), and two that
    # only namespaces with tenants can fire (a tenant held at its limits, API keys no tenant holds).
    assert 10 <= len(ALERT_NAMES) <= 26, ALERT_NAMES
    assert all(name.startswith("Gpufleet") for name in ALERT_NAMES)


@pytest.mark.parametrize("rule", alerting_rules(), ids=rule_id)
def test_alert_is_actionable(rule):
    labels, annotations = rule.get("labels", {}), rule.get("annotations", {})
    assert labels.get("severity") in SEVERITIES
    for key in ("summary", "description", "runbook_url"):
        assert annotations.get(key, "").strip(), f"{rule['alert']} has no {key}"
    match = re.fullmatch(r"https://\S+/docs/runbooks/(\w+)\.md", annotations["runbook_url"])
    assert match, annotations["runbook_url"]
    assert match[1] == rule["alert"], "the runbook is named after the alert"
    assert (RUNBOOKS / f"{rule['alert']}.md").is_file()


def test_rules_of_one_alert_differ_in_labels():
    # Several rules may share an alert name (e.g. page and ticket burn rates);
    # their label sets keep the resulting alerts apart.
    label_sets = Counter((rule["alert"], tuple(sorted(rule.get("labels", {}).items()))) for rule in alerting_rules())
    assert all(count == 1 for count in label_sets.values()), label_sets


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_runbook_has_every_section(name):
    text = (RUNBOOKS / f"{name}.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {name}\n")
    positions = [text.find(section + "\n") for section in RUNBOOK_SECTIONS]
    assert all(p >= 0 for p in positions), f"{name}: sections {RUNBOOK_SECTIONS} required"
    assert positions == sorted(positions), f"{name}: sections out of order"
    assert "kubectl " in text, f"{name}: no kubectl command to confirm or mitigate"
    assert "```promql" in text, f"{name}: no PromQL to confirm with"


def test_every_runbook_belongs_to_an_alert():
    runbooks = {path.stem for path in RUNBOOKS.glob("*.md")}
    assert runbooks == set(ALERT_NAMES)


def test_test_files_evaluate_the_rules_file_in_a_fixed_group_order():
    # promtool evaluates groups in random order unless told otherwise, which
    # makes recorded series lag by one evaluation at random.
    groups = [group["name"] for group in rule_groups()]
    assert RULE_TESTS
    for name, content in rule_test_files().items():
        assert [(REPO / "rules" / "tests" / f).resolve() for f in content["rule_files"]] == [RULES], name
        assert content.get("group_eval_order") == groups, name


@pytest.mark.parametrize("rule", alerting_rules(), ids=rule_id)
def test_alert_rule_has_a_case_where_it_fires(rule):
    wanted = {"alertname": rule["alert"], **rule.get("labels", {})}
    firing = [
        (file, case["eval_time"])
        for file, case in alert_test_cases() if case["alertname"] == rule["alert"]
        for alert in case.get("exp_alerts") or []
        if wanted.items() <= {"alertname": rule["alert"], **alert.get("exp_labels", {})}.items()
    ]
    assert firing, f"no promtool case expects {wanted}"


@pytest.mark.parametrize("name", ALERT_NAMES)
def test_alert_has_a_case_where_it_stays_silent(name):
    silent = [(file, case["eval_time"]) for file, case in alert_test_cases()
              if case["alertname"] == name and not case.get("exp_alerts")]
    assert silent, f"no promtool case expects {name} to stay silent"
