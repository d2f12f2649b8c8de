"""Trusted identity (a gateway's header) and the bounded usage label."""
from __future__ import annotations

from gpufleet_api.tenants import trusted
from gpufleet_api.tenants.declaration import TrustedIdentity
from gpufleet_api.tenants.identity import Identified, Refused
from gpufleet_api.tenants.labels import tenant_label

DECLARED = frozenset({"team-a", "team-b"})


def test_the_tenant_header_names_a_declared_tenant():
    assert trusted.identify({"x-gpufleet-tenant": "team-a"}, TrustedIdentity(), DECLARED) == Identified("team-a")


def test_a_name_not_declared_or_no_header_is_refused_without_echoing_it():
    out = trusted.identify({"x-gpufleet-tenant": "evil\r\nname"}, TrustedIdentity(), DECLARED)
    assert isinstance(out, Refused) and out.reason == "unknown" and "evil" not in out.message
    out = trusted.identify({}, TrustedIdentity(), DECLARED)
    assert isinstance(out, Refused) and out.reason == "missing"


def test_the_fairness_id_counts_only_where_accepted():
    gie = {"x-gateway-inference-fairness-id": "team-b"}
    llmd = {"x-llm-d-inference-fairness-id": "team-a"}
    assert trusted.identify(gie, TrustedIdentity(), DECLARED).reason == "missing"  # type: ignore[union-attr]
    accepting = TrustedIdentity(fairness_id="AsTenant")
    assert trusted.identify(gie, accepting, DECLARED) == Identified("team-b")
    assert trusted.identify(llmd, accepting, DECLARED) == Identified("team-a")


def test_the_tenant_header_wins_over_a_fairness_id():
    both = {"x-gpufleet-tenant": "team-a", "x-gateway-inference-fairness-id": "team-b"}
    assert trusted.identify(both, TrustedIdentity(fairness_id="AsTenant"), DECLARED) == Identified("team-a")


def test_labels_are_declared_tenants_or_unknown():
    assert tenant_label("team-a", DECLARED) == "team-a"
    assert tenant_label(None, DECLARED) == "unknown"
    # Free client input never becomes a label: a thousand made-up names make one series.
    assert {tenant_label(f"made-up-{i}", DECLARED) for i in range(1000)} == {"unknown"}
