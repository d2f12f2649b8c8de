"""What the CRD refuses before a child ever could: the schema's own patterns and
bounds, checked here without a cluster (tests/integration checks the API server
says the same)."""
import re

import celpy
import pytest

from gpufleet_api.crd import build_crd

SPEC = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def prop(*path):
    s = SPEC[path[0]]
    for p in path[1:]:
        s = s["items"]["properties"][p] if s.get("type") == "array" else s["properties"][p]
    return s


def matches(schema, value):
    return re.fullmatch(schema["pattern"].lstrip("^").rstrip("$"), value) is not None


@pytest.mark.parametrize("value", ["4", "500m", "32Gi", "1.5", "+2", "1e3", "0"])
def test_quantities_kubernetes_takes_are_accepted(value):
    assert matches(prop("resources", "memory"), value) and matches(prop("resources", "cpu"), value)


@pytest.mark.parametrize("value", ["-1Gi", "-500m", "lots", "1 Gi", ""])
def test_negative_or_malformed_quantities_are_refused(value):
    assert not matches(prop("resources", "memory"), value)


def test_integer_quantities_cannot_be_negative():
    assert prop("resources", "cpu")["minimum"] == 0 and prop("resources", "memory")["minimum"] == 0


@pytest.mark.parametrize("value, ok", [("99.9", True), ("99.999", True), ("95", True), ("100", False),
                                       ("100.0", False), ("99.9999", False), ("101", False)])
def test_availability_objectives_leave_an_error_budget(value, ok):
    assert matches(prop("slo", "availabilityPercent"), value) is ok


@pytest.mark.parametrize("value, ok", [("NVIDIA-H100-80GB-HBM3", True), ("a" * 63, True), ("a" * 64, False),
                                       ("NVIDIA H100", False), ("-x", False), ("", True)])
def test_label_valued_fields_take_label_values(value, ok):
    for schema in (prop("resources", "gpuProduct"), prop("isolation", "tolerations", "value"),
                   prop("isolation", "nodeSelector")["additionalProperties"]):
        assert (matches(schema, value) and len(value) <= schema["maxLength"]) is ok


@pytest.mark.parametrize("key, ok", [("zone", True), ("topology.kubernetes.io/zone", True),
                                     ("nvidia.com/gpu.product", True), ("no spaces", False), ("/x", False),
                                     ("a/b/c", False), ("x" * 64, False)])
def test_taint_and_node_label_keys_are_qualified_names(key, ok):
    assert matches(prop("isolation", "tolerations", "key"), key) is ok
    rule = prop("isolation", "nodeSelector")["x-kubernetes-validations"][0]["rule"]
    assert prop("isolation", "tolerations", "key")["pattern"] in rule   # the same test for both


def test_a_route_class_must_name_a_queue_class():
    rule, = prop("admission")["x-kubernetes-validations"]
    env = celpy.Environment()
    program = env.program(env.compile(rule["rule"]))
    classes = [{"name": "interactive", "level": 1, "maxQueueSeconds": 2}]

    def accepted(default_class):
        value = {"queueClasses": classes, "routeClasses": [{"route": "/v1/completions",
                                                             "defaultClass": default_class}]}
        return bool(program.evaluate({"self": celpy.json_to_cel(value)}))
    assert accepted("interactive") and not accepted("vip")
