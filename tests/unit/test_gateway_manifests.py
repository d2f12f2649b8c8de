"""spec.gateway's children (manifests/gateway.py): the InferencePool per data path (the engines' guard port, or the
routers' pods the EPP Service selects), its Endpoint Picker and failure mode, the HTTPRoute only with a parent
Gateway, and both as GIE's v1.5.0 CRD takes them (its schema and CEL rules, checked offline)."""
from __future__ import annotations

import pytest

from gpufleet.manifests import gateway as build
from gpufleet.manifests import names
from gpufleet_api import gateway_api as gie
from gpufleet_api import parse_spec
from tests.support.gie import pool_schema
from tests.support.openapi_check import problems

ISVC = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat"}}
ROUTER_LABELS = {"app.kubernetes.io/name": "gpufleet-router", "app.kubernetes.io/instance": "gpufleet"}
EPP_SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": gie.EPP_SERVICE, "namespace": "ml"},
               "spec": {"selector": ROUTER_LABELS,
                        "ports": [{"name": gie.EPP_PORT_NAME, "port": gie.EPP_PORT, "targetPort": gie.EPP_PORT},
                                  {"name": "http", "port": 80, "targetPort": 8000}]}}
DISAGGREGATED = {"disaggregation": {}, "engine": {"kvTransfer": {}}}


def spec(gateway: dict, **more):
    return parse_spec({"model": {"name": "org/chat", "servedName": "chat"}, "gateway": gateway, **more})


def picker() -> build.EndpointPicker:
    found = build.endpoint_picker(EPP_SERVICE)
    assert isinstance(found, build.EndpointPicker)
    return found


def test_a_direct_pool_selects_the_engine_pods_on_the_guard_port_and_names_the_routers_picker():
    pool = build.build_inference_pool(ISVC, spec({}), picker())
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["ownerReferences"][0]["uid"] == "u-chat"
    assert pool["spec"]["selector"] == {"matchLabels": names.selector_labels("chat")}
    assert pool["spec"]["targetPorts"] == [{"number": names.GUARD_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "gpufleet-router-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}
    assert build.data_path(spec({})) == "Direct"


@pytest.mark.parametrize("gateway, more", [({"dataPath": "Router"}, {}), ({}, DISAGGREGATED),
                                           ({"dataPath": "Router"}, DISAGGREGATED)])
def test_a_router_pool_selects_the_routers_pods_on_their_openai_port(gateway, more):
    s = spec(gateway, **more)
    assert build.router_problem(s, picker()) is None
    pool = build.build_inference_pool(ISVC, s, picker())
    assert pool["spec"]["selector"] == {"matchLabels": ROUTER_LABELS}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert build.data_path(s) == "Router"


def test_the_failure_mode_is_the_specs():
    pool = build.build_inference_pool(ISVC, spec({"failureMode": "FailOpen"}), picker())
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_a_router_pool_needs_the_routers_port_and_pods_from_the_epp_service():
    no_http = {**EPP_SERVICE, "spec": {**EPP_SERVICE["spec"], "ports": EPP_SERVICE["spec"]["ports"][:1]}}
    found = build.endpoint_picker(no_http)
    assert isinstance(found, build.EndpointPicker)
    assert build.router_problem(spec({}), found) is None  # Direct needs neither
    assert "no port 'http' with a numeric targetPort" in (build.router_problem(spec({"dataPath": "Router"}), found)
                                                           or "")
    assert build.endpoint_picker({**EPP_SERVICE, "spec": {"ports": []}}) == \
        f"Service {gie.EPP_SERVICE} has no port named {gie.EPP_PORT_NAME}"


def test_no_http_route_without_a_parent_gateway():
    assert build.build_http_route(ISVC, spec({})) is None


def test_the_http_route_attaches_the_pool_to_the_named_gateway_on_v1():
    route = build.build_http_route(ISVC, spec({"parentRef": {"name": "inference", "namespace": "gateways",
                                                             "sectionName": "http"}}))
    assert route is not None
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference", "namespace": "gateways", "sectionName": "http"}]
    rule, = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}]
    assert rule["timeouts"] == {"request": "300s"}  # admission.requestTimeoutSeconds' default


def test_model_match_header_matches_the_served_name_set_by_the_body_based_router():
    route = build.build_http_route(ISVC, spec({"parentRef": {"name": "inference"}, "modelMatch": "Header"}))
    assert route is not None
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference"}]
    assert route["spec"]["rules"][0]["matches"][0]["headers"] == [
        {"type": "Exact", "name": "X-Gateway-Model-Name", "value": "chat"}]


@pytest.mark.parametrize("gateway, more", [({}, {}), ({"dataPath": "Router", "failureMode": "FailOpen"}, {}),
                                           ({}, DISAGGREGATED)])
def test_the_rendered_pool_is_valid_for_gies_v1_5_crd(gateway, more):
    pool = build.build_inference_pool(ISVC, spec(gateway, **more), picker())
    assert problems(pool_schema(), pool) == []


def test_the_offline_check_catches_what_the_crd_refuses():
    pool = build.build_inference_pool(ISVC, spec({}), picker())
    bad = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8080}, {"number": 8080}], "extra": 1,
                            "endpointPickerRef": {"name": "x", "failureMode": "Maybe"}}}
    found = "\n".join(problems(pool_schema(), bad))
    assert "port number must be unique" in found
    assert "port is required when kind is 'Service'" in found
    assert ".spec.extra: unknown field" in found and "'Maybe' is not one of" in found
