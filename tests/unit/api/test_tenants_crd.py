"""The InferenceTenants CRD, generated from the declaration's types: what `kubectl apply` refuses (every
CEL rule of the generated schema evaluated on the defaulted object, as in test_api_disaggregation.py), the
committed copies, and the columns an on-call engineer reads."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpufleet_api import typed
from gpufleet_api.crd import KINDS, TENANTS, build_crd, render_yaml
from gpufleet_api.tenants import declaration
from gpufleet_api.tenants.declaration import TenantsSpec
from gpufleet_api.tenants.usage import TENANTS_KIND, TENANTS_NAME, TENANTS_PLURAL
from tests.support.cel import refusals

ROOT = Path(__file__).resolve().parents[3]
FILE = f"{TENANTS_PLURAL}.serving.gpufleet.dev.yaml"
ROOT_SCHEMA = build_crd(TENANTS)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def checked(spec: dict, name: str = TENANTS_NAME) -> list[str]:
    """The API server's verdict on an object, after the schema's defaults (those the types apply)."""
    defaulted = typed.to_builtins(typed.convert(TenantsSpec, spec), omit_none=True)
    return refusals(ROOT_SCHEMA, {"metadata": {"name": name}, "spec": defaulted})


def keyed(name: str) -> dict:
    return {"name": name, "keys": {"name": f"{name}-keys", "key": "keys"}}


def test_the_committed_crd_and_the_charts_copy_match_the_types():
    text = render_yaml(TENANTS)
    assert (ROOT / "crds" / FILE).read_text() == text, \
        "crds/ drifted from the tenants' types: run `gpufleet crd --kind InferenceTenants -o crds/...`"
    assert (ROOT / "charts" / "gpufleet" / "crds" / FILE).read_text() == text, "run scripts/sync_chart.py"
    assert KINDS[TENANTS_KIND] is TENANTS


def test_a_namespaced_kind_with_no_status_and_a_short_name():
    crd = yaml.safe_load(render_yaml(TENANTS))
    assert crd["metadata"]["name"] == f"{TENANTS_PLURAL}.serving.gpufleet.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["kind"] == TENANTS_KIND and "tenants" in crd["spec"]["names"]["shortNames"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {} and "status" not in version["schema"]["openAPIV3Schema"]["properties"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Identity", "Tenants", "Age"]


def test_a_declaration_that_works_is_taken():
    assert checked({"tenants": [keyed("search"), keyed("batch-eval")]}) == []
    assert checked({"identity": "Trusted", "tenants": [{"name": "search", "weight": 2}]}) == []


@pytest.mark.parametrize("name", ["default", "team-a", "tenant"])
def test_any_other_name_is_refused_saying_the_one_name(name):
    (message,) = checked({"tenants": [keyed("search")]}, name=name)
    assert message.startswith("one declaration per namespace: name it tenants")
    rule = ROOT_SCHEMA["x-kubernetes-validations"][0]
    assert rule["fieldPath"] == ".metadata.name"


@pytest.mark.parametrize("spec, fragment", [
    ({"tenants": [keyed("search"), {"name": "batch"}]}, "identity is Keys, so each tenant needs keys"),
    ({"identity": "Trusted", "tenants": [keyed("search")]}, "identity is Trusted, so keys are never read"),
    ({"identity": "Trusted", "tenants": [{"name": "unknown"}]}, "'unknown' is the label of callers"),
])
def test_what_the_declaration_refuses_the_api_server_refuses_too(spec, fragment):
    (message,) = checked(spec)
    assert fragment in message
    # The same words as the parser's, so `kubectl apply` and the router's log say one thing.
    with pytest.raises(typed.Invalid) as e:
        declaration.parse(spec)
    assert any(fragment in str(p) for p in e.value.problems)


def test_duplicate_names_are_refused_by_the_lists_map_key():
    tenants = ROOT_SCHEMA["properties"]["spec"]["properties"]["tenants"]
    assert tenants["x-kubernetes-list-type"] == "map" and tenants["x-kubernetes-list-map-keys"] == ["name"]


def test_the_rules_fit_the_api_servers_cost_budget():
    # A rule over a list needs its bound, or the API server refuses the CRD (estimated cost too high).
    assert ROOT_SCHEMA["properties"]["spec"]["properties"]["tenants"]["maxItems"] == declaration.MAX_TENANTS
