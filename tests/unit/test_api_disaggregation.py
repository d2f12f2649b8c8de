"""spec.disaggregation, spec.engine.kvTransfer and spec.engine.kvTier: what the API server refuses
(every CEL rule of the generated CRD evaluated on the defaulted spec, as in test_api_bounds.py;
tests/integration/test_samples.py has a real API server take the sample) and what a valid spec
parses to."""
from pathlib import Path

import msgspec
import pytest
import yaml

from gpufleet.planning.live_ratio import LiveRatio
from gpufleet.reconcile.ratio import ratio_status
from gpufleet_api import SpecError, parse_spec, to_api
from gpufleet_api.crd import build_crd
from gpufleet_api.v1alpha1 import InferenceServiceStatus
from tests.support.cel import refusals

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
CPU = {"runtime": "vllm-cpu", "kvCache": {"blockSize": 32}}
SHARED = {"connector": "SharedStorage", "sharedStorage": {"hostPath": {"path": "/var/lib/kv"}}}


def checked(**spec) -> list[str]:
    """The API server's verdict on a spec, after its defaults (those the types apply) are filled in."""
    return refusals(SCHEMA, to_api(parse_spec({"model": {"name": "m"}, **spec})))


@pytest.mark.parametrize("spec", [
    {},
    {"disaggregation": {}, "engine": {"kvTransfer": {}}},
    {"disaggregation": {"prefill": {"minReplicas": 2, "maxReplicas": 4, "resources": {"gpusPerReplica": 2}},
                        "decode": {"replicas": 3}},
     "autoscaling": {"mode": "Manual"}, "engine": {"kvTransfer": {"connector": "Nixl",
                                                                  "loadFailurePolicy": "Fail"}}},
    {"disaggregation": {}, "engine": {**CPU, "kvTransfer": SHARED}},
    {"disaggregation": {}, "engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {
        "persistentVolumeClaim": {"claimName": "kv"}}}}},
    {"engine": {"kvTier": "Shared", "kvTransfer": {"connector": "LMCache", "extraConfig": {"lmcache.x": "y"}}}},
    {"engine": {**CPU, "kvTier": "Shared", "kvTransfer": SHARED}},
    {"disaggregation": {}, "isolation": {"mode": "Exclusive"}, "engine": {"kvTransfer": {
        "connector": "SharedStorage", "sharedStorage": {"persistentVolumeClaim": {"claimName": "kv"}}}}},
    {"disaggregation": {}, "engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {
        "persistentVolumeClaim": {"size": "100Gi", "storageClassName": "nfs", "accessMode": "ReadWriteMany"}}}}},
    # A unified service keeps its kvTransfer while kvTier is Off (it is not rendered): switching
    # disaggregation off needs no other edit.
    {"engine": {"kvTransfer": {}}},
])
def test_specs_that_work_are_taken(spec):
    assert checked(**spec) == []


@pytest.mark.parametrize("spec, fragment", [
    ({"disaggregation": {}}, "disaggregation needs engine.kvTransfer"),
    ({"engine": {"kvTier": "Shared"}}, "engine.kvTier Shared needs engine.kvTransfer"),
    ({"engine": {"kvTransfer": {"connector": "SharedStorage"}}},
     "engine.kvTransfer.sharedStorage is required with connector SharedStorage"),
    ({"engine": {"kvTransfer": {"connector": "Nixl", "sharedStorage": {"hostPath": {"path": "/kv"}}}}},
     "engine.kvTransfer.sharedStorage is for connector SharedStorage only"),
    ({"engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {}}}},
     "engine.kvTransfer.sharedStorage: set exactly one of hostPath and persistentVolumeClaim"),
    ({"engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {
        "hostPath": {"path": "/kv"}, "persistentVolumeClaim": {"claimName": "kv"}}}}},
     "engine.kvTransfer.sharedStorage: set exactly one of hostPath and persistentVolumeClaim"),
    ({"engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {"persistentVolumeClaim": {}}}}},
     "set exactly one of claimName (an existing claim) and size (the operator creates the claim <service>-kv-store)"),
    ({"engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {"persistentVolumeClaim": {
        "claimName": "kv", "size": "1Gi"}}}}}, "set exactly one of claimName (an existing claim) and size"),
    ({"engine": {"kvTransfer": {"connector": "SharedStorage", "sharedStorage": {"persistentVolumeClaim": {
        "claimName": "kv", "storageClassName": "nfs"}}}}},
     "storageClassName and accessMode are for the claim the operator creates"),
    ({"disaggregation": {}, "engine": {**CPU, "kvTransfer": {"connector": "Nixl"}}},
     "engine.kvTransfer.connector Nixl and LMCache move KV between GPUs; with engine.runtime vllm-cpu use "
     "connector SharedStorage"),
    ({"disaggregation": {}, "engine": {**CPU, "kvTransfer": {"connector": "LMCache"}}},
     "with engine.runtime vllm-cpu use connector SharedStorage"),
    ({"disaggregation": {}, "engine": {"kvTier": "Shared", "kvTransfer": SHARED}},
     "engine.kvTier Shared is for a unified service"),
    ({"engine": {"kvTier": "Shared", "kvTransfer": {"connector": "Nixl"}}},
     "Nixl only hands KV from a prefill to a decode pod"),
    ({"disaggregation": {"decode": {"minReplicas": 3, "maxReplicas": 2}}, "engine": {"kvTransfer": {}}},
     "a pool's minReplicas must be at most its maxReplicas"),
    ({"engine": {"kvTransfer": {**SHARED, "extraConfig": {"shared_storage_path": "/elsewhere"}}}},
     "engine.kvTransfer.extraConfig.shared_storage_path is set by the operator"),
    ({"disaggregation": {}, "engine": {"kvTransfer": SHARED}, "isolation": {"mode": "Exclusive"}},
     "isolation.mode Exclusive puts every engine pod on a node of its own"),
    ({"engine": {"kvTier": "Shared", "kvTransfer": SHARED}, "isolation": {"mode": "Exclusive"}},
     "use sharedStorage.persistentVolumeClaim (ReadWriteMany) or isolation.mode Dedicated"),
    ({"disaggregation": {}, "replicas": 2, "engine": {"kvTransfer": {}}},
     "with spec.disaggregation set disaggregation.prefill.replicas and disaggregation.decode.replicas"),
    ({"disaggregation": {"prefill": {"replicas": 5}}, "autoscaling": {"mode": "Manual"},
      "engine": {"kvTransfer": {}}},
     "disaggregation.prefill.replicas and disaggregation.decode.replicas must lie within"),
    ({"disaggregation": {"decode": {"resources": {"gpusPerReplica": 3}}},
      "engine": {"tensorParallelSize": 2, "kvTransfer": {}}, "resources": {"gpusPerReplica": 2}},
     "engine.tensorParallelSize must divide the resources.gpusPerReplica of each pool"),
    ({"disaggregation": {"decode": {"resources": {"migProfile": "1g.10gb"}}},
      "engine": {"tensorParallelSize": 2, "kvTransfer": {}}, "resources": {"gpusPerReplica": 2}},
     "engine.tensorParallelSize must be 1 with a pool's resources.migProfile"),
])
def test_impossible_combinations_are_refused_naming_the_field_and_the_fix(spec, fragment):
    problems = checked(**spec)
    assert any(fragment in p for p in problems), problems


def test_a_manual_pools_replicas_are_checked_only_in_manual_mode():
    auto = {"disaggregation": {"prefill": {"replicas": 9}}, "engine": {"kvTransfer": {}}}
    assert checked(**auto) == []


def test_pool_rules_name_each_pool_not_a_shared_list_literal():
    """The API server type-checks list literals as homogeneous, and the two pools are distinct
    types: a rule over [prefill, decode] would not compile there."""
    rules = [r["rule"] for r in SCHEMA["x-kubernetes-validations"]]
    assert not any("[self.disaggregation.prefill" in r for r in rules)
    assert sum("self.disaggregation.decode" in r for r in rules) >= 3


def test_defaults_make_a_short_disaggregated_spec():
    spec = parse_spec({"model": {"name": "m"}, "disaggregation": {}, "engine": {"kvTransfer": {}}})
    assert spec.engine.kv_transfer is not None
    assert (spec.engine.kv_transfer.connector, spec.engine.kv_transfer.load_failure_policy) == ("Nixl", "Recompute")
    assert spec.engine.kv_tier == "Off"
    assert spec.disaggregation is not None
    for pool in (spec.disaggregation.prefill, spec.disaggregation.decode):
        assert (pool.min_replicas, pool.max_replicas, pool.replicas, pool.resources) == (1, 4, None, None)


def test_a_unified_spec_parses_to_what_it_did():
    """Existing services gain no field but the defaulted kvTier: Off."""
    doc = yaml.safe_load((ROOT / "samples" / "full.yaml").read_text())["spec"]
    again = to_api(parse_spec(doc))
    assert "disaggregation" not in again and "kvTransfer" not in again["engine"]
    assert again["engine"]["kvTier"] == "Off"


def test_the_pd_sample_is_a_vllm_cpu_service_sharing_kv_through_a_host_directory():
    doc = yaml.safe_load((ROOT / "samples" / "pd-tiny.yaml").read_text())
    spec = parse_spec(doc["spec"])
    assert spec.engine.runtime == "vllm-cpu" and spec.disaggregation is not None
    assert spec.engine.kv_transfer is not None and spec.engine.kv_transfer.connector == "SharedStorage"
    assert spec.engine.kv_transfer.shared_storage is not None
    assert spec.engine.kv_transfer.shared_storage.host_path is not None
    assert refusals(SCHEMA, to_api(spec)) == []


def test_status_has_pools_keyed_by_role_and_wide_columns_per_pool():
    version = build_crd()["spec"]["versions"][0]
    pools = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["pools"]
    assert pools["x-kubernetes-list-type"] == "map" and pools["x-kubernetes-list-map-keys"] == ["role"]
    assert pools["items"]["required"] == ["role"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    for role in ("prefill", "decode"):
        column = columns[role.capitalize()]
        assert column["jsonPath"] == f'.status.pools[?(@.role=="{role}")].readyReplicas'
        assert column["priority"] == 1


def test_the_ratio_policy_defaults_to_none_and_takes_bound_with_a_tolerance():
    spec = parse_spec({"model": {"name": "m"}, "disaggregation": {}, "engine": {"kvTransfer": {}}})
    assert spec.disaggregation is not None
    assert (spec.disaggregation.ratio_policy, spec.disaggregation.ratio_tolerance_percent) == ("None", 25)
    assert checked(disaggregation={"ratioPolicy": "Bound", "ratioTolerancePercent": 0},
                   engine={"kvTransfer": {}}) == []


@pytest.mark.parametrize("disaggregation, field", [
    ({"ratioPolicy": "Always"}, "ratioPolicy"),
    ({"ratioTolerancePercent": 101}, "ratioTolerancePercent"),
    ({"prefill": {"minReplicas": 0}}, "minReplicas"),   # a pool never scales to zero
])
def test_out_of_range_ratio_and_pool_settings_are_refused(disaggregation, field):
    with pytest.raises(SpecError, match=field):
        parse_spec({"model": {"name": "m"}, "disaggregation": disaggregation, "engine": {"kvTransfer": {}}})
    schema = SCHEMA["properties"]["disaggregation"]["properties"]
    assert schema["prefill"]["properties"]["minReplicas"]["minimum"] == 1
    assert schema["ratioPolicy"]["enum"] == ["None", "Bound"]


def test_the_ratio_the_operator_writes_is_what_the_status_schema_describes():
    written = ratio_status(LiveRatio("Measured", "m", prefill=2, decode=5, decode_per_prefill=2.3456, requests=900,
                                     window_seconds=300), None, "2026-01-01T00:00:00Z")
    last = {"time": "2026-01-01T00:00:00Z", "from": 1, "to": 2, "role": "prefill", "reason": "TTFT"}
    status = msgspec.convert({"prefillDecodeRatio": written, "lastScaling": last}, InferenceServiceStatus)
    assert status.prefill_decode_ratio is not None and status.prefill_decode_ratio.decode_per_prefill == "2.35"
    assert status.last_scaling is not None and status.last_scaling.role == "prefill"
    properties = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"][
        "properties"]
    assert properties["prefillDecodeRatio"]["properties"]["reason"]["enum"] == ["Measured", "NoProfile",
                                                                                "AwaitingTraffic"]
    assert properties["lastScaling"]["properties"]["role"]["enum"] == ["prefill", "decode"]
