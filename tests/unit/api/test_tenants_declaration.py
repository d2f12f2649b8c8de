"""The tenants declaration: defaults, bounds, and every bad input named by its field with the fix."""
from __future__ import annotations

import pytest

from gpufleet_api.tenants import declaration
from gpufleet_api.tenants.declaration import TENANT_HEADER, UNKNOWN_TENANT
from gpufleet_api.typed import Invalid


def keyed(name: str, **extra) -> dict:
    return {"name": name, "keys": {"name": f"{name}-keys", "key": "keys"}, **extra}


def test_defaults_weight_one_no_limits_keys_identity():
    spec = declaration.parse({"tenants": [keyed("team-a")]})
    (t,) = spec.tenants
    assert spec.identity == "Keys"
    assert t.weight == 1
    assert (t.limits.requests_per_second, t.limits.tokens_per_minute, t.limits.concurrent_requests) == (None,) * 3
    assert t.keys is not None and t.keys.name == "team-a-keys"
    assert spec.trusted.tenant_header == TENANT_HEADER and spec.trusted.fairness_id == "Ignore"


def test_limits_and_weight_read_in_camel_case():
    spec = declaration.parse({"tenants": [keyed("team-a", weight=3, limits={
        "requestsPerSecond": 5, "tokensPerMinute": 60000, "concurrentRequests": 4})]})
    t = spec.by_name()["team-a"]
    assert (t.weight, t.limits.requests_per_second, t.limits.tokens_per_minute,
            t.limits.concurrent_requests) == (3, 5, 60000, 4)


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(Invalid) as e:
        declaration.parse(raw)
    return [str(p) for p in e.value.problems]


@pytest.mark.parametrize("name", ["Team_A", "-a", "a" * 64, ""])
def test_a_name_that_is_no_dns_label_is_named(name):
    (p,) = problems_of({"tenants": [{"name": name, "keys": {"name": "keys"}}]})
    assert p.startswith("tenants[0].name")


@pytest.mark.parametrize("field,value", [("weight", 0), ("weight", 1001)])
def test_weight_out_of_bounds(field, value):
    (p,) = problems_of({"tenants": [keyed("a", **{field: value})]})
    assert p.startswith("tenants[0].weight")


@pytest.mark.parametrize("limit", ["requestsPerSecond", "tokensPerMinute", "concurrentRequests"])
def test_a_zero_limit_is_refused_leaving_it_out_means_none(limit):
    (p,) = problems_of({"tenants": [keyed("a", limits={limit: 0})]})
    assert p.startswith(f"tenants[0].limits.{limit}")


def test_every_problem_at_once_with_its_fix():
    found = problems_of({"tenants": [keyed("a"), keyed("a"), {"name": "b"}, keyed(UNKNOWN_TENANT)]})
    assert any(p.startswith("tenants[1].name") and "tenants[0]" in p for p in found)
    assert any(p.startswith("tenants[2].keys") and "identity: Trusted" in p for p in found)
    assert any(p.startswith("tenants[3].name") and "unknown" in p for p in found)
    assert len(found) == 3


def test_keys_under_trusted_identity_are_refused_as_never_read():
    (p,) = problems_of({"identity": "Trusted", "tenants": [keyed("a")]})
    assert p.startswith("tenants[0].keys") and "identity: Keys" in p


def test_trusted_identity_needs_no_keys_and_takes_a_header_name():
    spec = declaration.parse({"identity": "Trusted", "trusted": {"tenantHeader": "x-team", "fairnessId": "AsTenant"},
                              "tenants": [{"name": "a"}]})
    assert spec.trusted.tenant_header == "x-team" and spec.trusted.fairness_id == "AsTenant"


@pytest.mark.parametrize("header", ["X-Team", "x team", "x-team:"])
def test_a_tenant_header_that_is_no_lower_case_field_name_is_refused(header):
    (p,) = problems_of({"identity": "Trusted", "trusted": {"tenantHeader": header}, "tenants": [{"name": "a"}]})
    assert p.startswith("trusted.tenantHeader")


def test_no_tenants_and_too_many_tenants_are_refused():
    assert problems_of({"tenants": []})[0].startswith("tenants")
    many = [keyed(f"t{i}") for i in range(declaration.MAX_TENANTS + 1)]
    assert problems_of({"tenants": many})[0].startswith("tenants")


def test_a_misspelt_field_is_refused_not_read_as_no_limit():
    (p,) = problems_of({"tenants": [keyed("a", limit={"requestsPerSecond": 1})]})
    assert "limit" in p
