"""Who owns a model name (gpufleet_api.name_claims): the namespace that claimed it first, whatever kind claims
it later; inside that namespace a base model before an adapter; deleting the owner frees the name."""
from __future__ import annotations

from gpufleet_api.name_claims import (
    ADAPTER,
    SERVICE,
    Claim,
    adapter_claim,
    decide,
    decide_objects,
    service_claim,
)

T1, T2, T3 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"


def isvc(name: str, ns: str, created: str, served: str | None = None, **extra) -> dict:
    model = {"name": f"org/{name}", **({"servedName": served} if served else {})}
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": created, **extra},
            "spec": {"model": model}}


def adapter(name: str, ns: str, created: str, **extra) -> dict:
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": created, **extra},
            "spec": {"service": "base", "source": {"huggingFace": {"name": f"org/{name}"}}}}


def test_the_oldest_claim_owns_a_name_and_a_later_namespace_loses_it_with_a_message_naming_the_owner():
    decision = decide_objects([isvc("b", "team-b", T2, "customer-a"), isvc("a", "team-a", T1, "customer-a")])
    assert decision.owners["customer-a"].key == (SERVICE, "team-a", "a")
    conflict = decision.conflict(SERVICE, "team-b", "b")
    assert conflict is not None and conflict.owner.key == (SERVICE, "team-a", "a")
    assert conflict.message == ("team-a/a already serves model 'customer-a'; give this InferenceService another "
                                "spec.model.servedName")
    assert decision.conflict(SERVICE, "team-a", "a") is None


def test_a_later_base_model_in_another_namespace_never_takes_an_adapters_name():
    decision = decide_objects([isvc("b", "team-b", T2, "customer-a")], [adapter("customer-a", "team-a", T1)])
    assert decision.owners["customer-a"].key == (ADAPTER, "team-a", "customer-a")
    conflict = decision.conflict(SERVICE, "team-b", "b")
    assert conflict is not None and "team-a/customer-a already serves the adapter 'customer-a'" in conflict.message


def test_a_later_adapter_in_another_namespace_loses_to_a_base_model_and_is_told_to_rename():
    decision = decide_objects([isvc("a", "team-a", T1, "customer-a")], [adapter("customer-a", "team-b", T2)])
    conflict = decision.conflict(ADAPTER, "team-b", "customer-a")
    assert conflict is not None and conflict.owner.key == (SERVICE, "team-a", "a")
    assert "rename this InferenceAdapter" in conflict.message and "metadata.name" in conflict.message


def test_inside_one_namespace_a_base_model_keeps_its_name_over_an_older_adapter():
    decision = decide_objects([isvc("chat", "ml", T2, "x")], [adapter("x", "ml", T1)])
    assert decision.owners["x"].kind == SERVICE
    assert decision.conflict(ADAPTER, "ml", "x") is not None


def test_the_owning_namespace_is_the_first_claims_even_when_its_base_model_came_later():
    # team-a's adapter claimed the name first; team-a's own base model then takes it inside team-a, and
    # team-b's claim (older than that base model) still loses: the name is team-a's.
    decision = decide_objects([isvc("late", "team-a", T3, "x"), isvc("b", "team-b", T2, "x")],
                              [adapter("x", "team-a", T1)])
    assert decision.owners["x"].key == (SERVICE, "team-a", "late")
    assert {k for k in decision.conflicts} == {(ADAPTER, "team-a", "x"), (SERVICE, "team-b", "b")}


def test_deleting_the_owner_frees_the_name_for_the_next_claim():
    going = isvc("a", "team-a", T1, "customer-a", deletionTimestamp=T3)
    decision = decide_objects([going, isvc("b", "team-b", T2, "customer-a")])
    assert decision.owners["customer-a"].key == (SERVICE, "team-b", "b") and not decision.conflicts
    gone = decide_objects([isvc("b", "team-b", T2, "customer-a")], [adapter("customer-a", "team-a", T1,
                                                                          deletionTimestamp=T3)])
    assert gone.owners["customer-a"].namespace == "team-b" and not gone.conflicts


def test_one_second_ties_are_decided_by_namespace_then_name_the_same_way_every_time():
    claims = [Claim(SERVICE, "zeta", "s", "m", T1), Claim(SERVICE, "alpha", "s", "m", T1)]
    assert decide(claims).owners["m"].namespace == decide(reversed(claims)).owners["m"].namespace == "alpha"


def test_a_service_claims_its_model_name_without_a_served_name_and_keeps_it_while_another_field_is_wrong():
    assert service_claim(isvc("chat", "ml", T1)).served == "org/chat"    # type: ignore[union-attr]
    broken = isvc("a", "team-a", T1, "customer-a")
    broken["spec"]["autoscaling"] = {"minReplicas": "many"}
    claim = service_claim(broken)
    assert claim is not None and claim.served == "customer-a"
    decision = decide_objects([broken, isvc("b", "team-b", T2, "customer-a")])
    assert decision.conflict(SERVICE, "team-b", "b") is not None
    assert service_claim({"metadata": {"name": "x", "namespace": "ml"}, "spec": {"model": {}}}) is None


def test_an_adapter_claims_its_metadata_name():
    claim = adapter_claim(adapter("support", "ml", T1))
    assert claim is not None and (claim.kind, claim.served) == (ADAPTER, "support")
    assert adapter_claim(adapter("support", "ml", T1, deletionTimestamp=T2)) is None
