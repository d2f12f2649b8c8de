"""The operator↔router contract (gpufleet_api.route): what the router routes an InferenceService by,
derived in one place, and the replica bounds the autoscaler keeps."""
from __future__ import annotations

import pytest

from gpufleet.autoscale.pools import pool_thresholds
from gpufleet_api import parse_spec
from gpufleet_api.route import SpecError, route_view


def service(**spec) -> dict:
    return {"metadata": {"name": "chat", "namespace": "ml", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"model": {"name": "org/chat"}, **spec}}


def test_the_view_names_the_served_model_and_the_bounds():
    view = route_view(service(model={"name": "org/chat", "servedName": "chat"},
                              autoscaling={"minReplicas": 1, "maxReplicas": 5}))
    assert (view.namespace, view.service, view.model, view.model_root) == ("ml", "chat", "chat", "org/chat")
    assert (view.min_replicas, view.max_replicas, view.pool_max) == (1, 5, ())
    assert view.created == "2026-01-01T00:00:00Z" and not view.deleting and not view.kv_tier


def test_the_ttft_objective_the_routers_tail_rule_keeps_by_is_the_services():
    assert route_view(service(slo={"ttftP99Milliseconds": 750})).ttft_objective_seconds == 0.75
    assert route_view(service()).ttft_objective_seconds == 2.0   # spec.slo's default


def test_a_disaggregated_services_pool_bounds_are_the_ones_its_autoscaler_keeps():
    isvc = service(engine={"kvTransfer": {"connector": "Nixl"}},
                   disaggregation={"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 6}})
    view, spec = route_view(isvc), parse_spec(isvc["spec"])
    assert dict(view.pool_max) == {role: pool_thresholds(spec, role).max_replicas for role in ("prefill", "decode")}
    assert dict(view.pool_max) == {"prefill": 2, "decode": 6}


def test_a_canary_in_progress_is_read_from_status_and_its_weight_clamped():
    isvc = service()
    isvc["status"] = {"rollout": {"canaryRevision": "abc123", "canaryWeightPercent": 140}}
    assert (route_view(isvc).canary_revision, route_view(isvc).canary_weight) == ("abc123", 100)
    isvc["status"]["rollout"]["canaryWeightPercent"] = True   # not a number: no share
    assert route_view(isvc).canary_weight == 0


def test_an_invalid_spec_names_its_field():
    with pytest.raises(SpecError) as e:
        route_view(service(autoscaling={"maxReplicas": "many"}))
    assert e.value.path.startswith("spec.autoscaling.maxReplicas")
