"""spec.gateway in the API: what the API server refuses (the generated CRD's CEL rules, evaluated in-process as in
test_tenants_crd.py), how the data path is decided (once, in route.py, for the operator and the router's picker),
and GIE's names defined once."""
from __future__ import annotations

import pytest

from gpufleet_api import SpecError, gateway_api, parse_spec, to_api
from gpufleet_api.crd import PRINTER_COLUMNS, build_crd
from gpufleet_api.route import gateway_via_router, route_view
from gpufleet_api.tenants.declaration import FAIRNESS_ID_HEADERS
from tests.support.cel import refusals

SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
DISAGGREGATED = {"disaggregation": {}, "engine": {"kvTransfer": {}}}


def checked(**spec) -> list[str]:
    return refusals(SCHEMA, to_api(parse_spec({"model": {"name": "m"}, **spec})))


@pytest.mark.parametrize("spec", [
    {"gateway": {}},
    {"gateway": {"dataPath": "Direct", "failureMode": "FailOpen", "parentRef": {"name": "gw"}}},
    {"gateway": {"dataPath": "Router"}, **DISAGGREGATED},
    {"gateway": {}, **DISAGGREGATED},
    {"gateway": {"parentRef": {"name": "gw", "namespace": "gateways", "sectionName": "https"},
                 "modelMatch": "Header"}},
])
def test_gateway_specs_that_work_are_taken(spec):
    assert checked(**spec) == []


def test_direct_with_disaggregation_is_refused_naming_the_field_and_the_fix():
    refused, = checked(gateway={"dataPath": "Direct"}, **DISAGGREGATED)
    assert refused.startswith("spec.gateway.dataPath Direct cannot serve spec.disaggregation")
    assert refused.endswith("set spec.gateway.dataPath to Router (or leave it unset)")
    rule = next(r for r in SCHEMA["x-kubernetes-validations"] if r["message"] == refused)
    assert rule["fieldPath"] == ".gateway.dataPath"


@pytest.mark.parametrize("gateway, path", [
    ({"failureMode": "Sometimes"}, "spec.gateway.failureMode"),
    ({"dataPath": "Mesh"}, "spec.gateway.dataPath"),
    ({"parentRef": {"name": "Not_A_Name"}}, "spec.gateway.parentRef.name"),
    ({"parentRef": {}}, "spec.gateway.parentRef"),
])
def test_bad_values_are_named(gateway, path):
    with pytest.raises(SpecError) as e:
        parse_spec({"model": {"name": "m"}, "gateway": gateway})
    assert e.value.path.startswith(path)


@pytest.mark.parametrize("spec, via_router", [
    ({}, False), ({"gateway": {}}, False), ({"gateway": {"dataPath": "Router"}}, True),
    ({"gateway": {}, **DISAGGREGATED}, True), ({"gateway": {"dataPath": "Router"}, **DISAGGREGATED}, True),
])
def test_the_data_path_is_decided_once_for_the_operator_and_the_picker(spec, via_router):
    isvc = {"metadata": {"name": "chat", "namespace": "ml"}, "spec": {"model": {"name": "m"}, **spec}}
    assert gateway_via_router(parse_spec(isvc["spec"])) is via_router
    view = route_view(isvc)
    assert view.via_router is via_router and view.gateway is ("gateway" in spec)


def test_gies_names_are_defined_once():
    assert gateway_api.FAIRNESS_ID_HEADER in FAIRNESS_ID_HEADERS
    assert gateway_api.INFERENCE_POOL_API_VERSION == "inference.networking.k8s.io/v1"
    assert gateway_api.INFERENCE_POOL_CRD == "inferencepools.inference.networking.k8s.io"
    assert gateway_api.EPP_PORT == 9002 and gateway_api.OBJECTIVE_HEADER == "x-gateway-inference-objective"


def test_a_gateway_column_for_the_on_call():
    column = next(c for c in PRINTER_COLUMNS if c["name"] == "Gateway")
    assert "GatewayReady" in column["jsonPath"] and column["priority"] == 1
