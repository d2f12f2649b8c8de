"""Readers for the observability assets: the metric catalog, the rules file,
the promtool tests, the dashboards and the runbooks, plus a small PromQL
scanner that finds the metric names an expression selects."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[3]
CATALOG = REPO / "docs" / "metrics.md"
RULES = REPO / "rules" / "gpufleet.rules.yaml"
RULE_TESTS = sorted((REPO / "rules" / "tests").glob("*.yaml"))
RUNBOOKS = REPO / "docs" / "runbooks"
DASHBOARDS = REPO / "dashboards"
OBSERVABILITY_DOC = REPO / "docs" / "observability.md"

# vLLM's metric list in the catalog has no types; these are its histograms.
VLLM_HISTOGRAM_SUFFIX = "_seconds"
VLLM_OTHER_HISTOGRAMS = {"vllm:iteration_tokens_total"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

# Values for Grafana's variables when a panel query is checked as PromQL.
GRAFANA_VARIABLES = {
    "namespace": "default",
    "service": "chat",
    "adapter": "customer-a",
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
}


# --- catalog ----------------------------------------------------------------

@cache
def catalog() -> dict[str, str]:
    """Metric name → type ("counter", "gauge", "histogram", or "vllm")."""
    text = CATALOG.read_text(encoding="utf-8")
    names: dict[str, str] = {}
    for match in re.finditer(r"^\|\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*\|\s*(counter|gauge|histogram)\s*\|", text, re.M):
        names[match[1]] = match[2]
    for match in re.finditer(r"`(vllm:[a-z0-9_:]+)`", text):
        names.setdefault(match[1], "vllm")
    return names


def is_histogram(name: str, kind: str) -> bool:
    if kind == "vllm":
        return name.endswith(VLLM_HISTOGRAM_SUFFIX) or name in VLLM_OTHER_HISTOGRAMS
    return kind == "histogram"


@cache
def catalog_series() -> frozenset[str]:
    """Every series name the catalog allows, histogram series included."""
    series = set()
    for name, kind in catalog().items():
        series.add(name)
        if is_histogram(name, kind):
            series.update(name + suffix for suffix in HISTOGRAM_SERIES)
    return frozenset(series)


# --- PromQL -----------------------------------------------------------------

_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
             "group_right", "bool", "offset", "atan2", "inf", "nan"}
_TOKENS = re.compile(
    r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'           # string literals
    r"|\{[^}]*\}"                                               # label matchers
    r"|\[[^\]]*\]"                                              # ranges and subqueries
    r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"  # label lists
    r"|\boffset\s+-?\w+"                                        # offset durations
    r"|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"                    # numbers
    r"|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)"
)

# What follows a function or aggregation name: its arguments, possibly after
# a grouping clause (`sum by (le) (...)`).
_CALL = re.compile(r"\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\(")


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (not functions or keywords)."""
    names = set()
    for match in _TOKENS.finditer(expr):
        name = match["name"]
        if not name or name.lower() in _KEYWORDS:
            continue
        if _CALL.match(expr, match.end()):
            continue  # a function or an aggregation
        names.add(name)
    return names


def substitute_grafana_variables(expr: str) -> str:
    def value(match: re.Match[str]) -> str:
        return GRAFANA_VARIABLES[match[1]]  # KeyError: an unknown variable
    return re.sub(r"\$\{?(\w+)\}?", value, expr)


def promtool_check_exprs(promtool: str, exprs: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Parse expressions with promtool by checking them as recording rules.

    `exprs` maps a label (used in the error output) to the expression."""
    rules = [{"record": f"check:expr_{i}:parse", "expr": expr, "labels": {"source": label}}
             for i, (label, expr) in enumerate(exprs.items())]
    path = tmp_path / "exprs.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "parse-check", "rules": rules}]}, sort_keys=False))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


# --- rules and their tests ----------------------------------------------------

@cache
def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]


def rules() -> Iterator[dict[str, Any]]:
    for group in rule_groups():
        yield from group["rules"]


def alerting_rules() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def recording_rules() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "record" in rule]


@cache
def rule_test_files() -> dict[str, dict[str, Any]]:
    return {path.name: yaml.safe_load(path.read_text(encoding="utf-8")) for path in RULE_TESTS}


def alert_test_cases() -> Iterator[tuple[str, dict[str, Any]]]:
    """(test file name, alert_rule_test entry) for every alert test case."""
    for name, content in rule_test_files().items():
        for group in content.get("tests", []):
            for case in group.get("alert_rule_test", []):
                yield name, case


# --- dashboards ---------------------------------------------------------------

def load_build_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpufleet_dashboards_build", DASHBOARDS / "build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text(encoding="utf-8")) for path in sorted(DASHBOARDS.glob("*.json"))}


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and variable query."""
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            yield f'panel {panel["id"]} "{panel["title"]}" {t["refId"]}', t["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f'annotation "{annotation["name"]}"', annotation["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["query"]["query"])
            assert match, f"variable {variable['name']}: expected label_values(<selector>, <label>)"
            yield f'variable "{variable["name"]}"', match[1]


# --- runbooks -----------------------------------------------------------------

def promql_blocks(markdown: str) -> list[str]:
    return re.findall(r"```promql\n(.*?)```", markdown, re.S)
