"""spec.engine.lora and the InferenceAdapter kind: what the API server takes and refuses, and what
the engine pod and guard.json get."""
import celpy
import pytest
import yaml

from gpufleet.manifests import children
from gpufleet_api import SpecError, parse, parse_spec, to_api
from gpufleet_api.crd import ADAPTER, build_crd, crd_file_name, render_yaml
from gpufleet_api.guard import guard_config as contract
from gpufleet_api.guard.adapters import ADAPTER_DIR, ADAPTER_DIR_ENV, ADAPTER_VOLUME
from gpufleet_api.v1alpha1 import InferenceAdapterSpec
from tests.unit.test_api_disaggregation import ROOT, checked, refusals

ADAPTER_ROOT = build_crd(ADAPTER)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
ENV = celpy.Environment()


def adapter_refusals(spec: dict) -> list[str]:
    return refusals(ADAPTER_ROOT["spec"], to_api(parse(InferenceAdapterSpec, spec)))


def isvc(**spec):
    return {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "generation": 1},
            "spec": {"model": {"name": "org/m"}, **spec}}


def test_committed_adapter_crd_matches_the_types_and_the_chart_copy():
    committed = (ROOT / "crds" / crd_file_name(ADAPTER)).read_text()
    assert committed == render_yaml(ADAPTER), "run `gpufleet crd --kind InferenceAdapter -o crds/...`"
    assert (ROOT / "charts" / "gpufleet" / "crds" / crd_file_name(ADAPTER)).read_text() == committed


def test_adapter_crd_has_status_subresource_short_name_and_oncall_columns():
    crd = build_crd(ADAPTER)
    assert crd["spec"]["names"]["shortNames"] == ["iad"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols[:2] == ["Service", "Ready"] and {"Loaded", "Desired", "Age"} <= set(cols)
    assert ADAPTER_ROOT["metadata"]["properties"]["name"]["maxLength"] == 63


def test_lora_defaults_and_flags_in_guard_json():
    spec = parse_spec({"model": {"name": "m"}, "engine": {"lora": {}}})
    assert (spec.engine.lora.max_adapters_per_batch, spec.engine.lora.max_rank, spec.engine.lora.max_adapters) == \
        (4, 16, 32)
    cm, _ = children.build_configmap(isvc(engine={"lora": {"maxAdaptersPerBatch": 2, "maxRank": 64,
                                                           "cpuCacheAdapters": 8, "maxAdapters": 10}}),
                                     parse_spec({"model": {"name": "org/m"}, "engine": {"lora": {
                                         "maxAdaptersPerBatch": 2, "maxRank": 64, "cpuCacheAdapters": 8,
                                         "maxAdapters": 10}}}))
    loaded = contract.parse(yaml.safe_load(cm["data"]["guard.json"]))
    assert loaded.engine.lora == contract.LoraConfig(max_loras=2, max_lora_rank=64, max_cpu_loras=8,
                                                     max_adapters=10)


def test_without_lora_guard_json_has_none_and_the_pod_no_adapter_folder():
    spec = parse_spec({"model": {"name": "org/m"}})
    cm, _ = children.build_configmap(isvc(), spec)
    assert contract.parse(yaml.safe_load(cm["data"]["guard.json"])).engine.lora is None
    pod = children.build_deployment(isvc(), spec, 1, "h")["spec"]["template"]["spec"]
    assert ADAPTER_VOLUME not in {v["name"] for v in pod["volumes"]}


def test_lora_mounts_the_adapter_folder_writable_for_the_guard_and_read_only_for_vllm():
    raw = {"model": {"name": "org/m"}, "engine": {"lora": {"maxAdapters": 8, "adapterClaims": ["loras"]}}}
    pod = children.build_deployment(isvc(**raw), parse_spec(raw), 1, "h")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[ADAPTER_VOLUME] == {"name": ADAPTER_VOLUME, "emptyDir": {"sizeLimit": "2048Mi"}}
    assert volumes["adapter-claim-0"]["persistentVolumeClaim"] == {"claimName": "loras", "readOnly": True}
    vllm, guard = pod["containers"]
    for container, read_only in ((vllm, True), (guard, False)):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts[ADAPTER_VOLUME] == {"name": ADAPTER_VOLUME, "mountPath": ADAPTER_DIR, "readOnly": read_only}
        assert mounts["adapter-claim-0"]["readOnly"] is True
        assert {"name": ADAPTER_DIR_ENV, "value": ADAPTER_DIR} in container["env"]


def test_adapter_storage_overrides_the_derived_size():
    raw = {"model": {"name": "org/m"}, "engine": {"lora": {"adapterStorage": "20Gi"}}}
    pod = children.build_deployment(isvc(**raw), parse_spec(raw), 1, "h")["spec"]["template"]["spec"]
    assert {"name": ADAPTER_VOLUME, "emptyDir": {"sizeLimit": "20Gi"}} in pod["volumes"]


@pytest.mark.parametrize("spec, fragment", [
    ({"disaggregation": {}, "engine": {"lora": {}, "kvTransfer": {}}},
     "engine.lora cannot be combined with spec.disaggregation"),
    ({"engine": {"lora": {}, "kvTransfer": {}}}, "engine.lora cannot be combined with engine.kvTransfer"),
    ({"engine": {"lora": {"maxAdaptersPerBatch": 8, "cpuCacheAdapters": 4}}},
     "engine.lora.cpuCacheAdapters must be at least engine.lora.maxAdaptersPerBatch"),
    ({"engine": {"lora": {}}, "pod": {"volumes": [{"name": "adapters", "emptyDir": {}}]}},
     "kv-store, adapters, guard-admin are gpufleet's"),
    ({"engine": {"lora": {}}, "pod": {"volumes": [{"name": "adapter-claim-0", "emptyDir": {}}]}},
     "names starting adapter-claim- are gpufleet's"),
])
def test_lora_misuse_is_refused_naming_the_field_and_the_fix(spec, fragment):
    problems = checked(**spec)
    assert any(fragment in p for p in problems), problems


def test_lora_on_a_unified_service_is_taken():
    assert checked(engine={"lora": {"cpuCacheAdapters": 8}}) == []


def test_a_rank_vllm_does_not_take_is_refused_by_the_types():
    with pytest.raises(SpecError) as e:
        parse_spec({"model": {"name": "m"}, "engine": {"lora": {"maxRank": 12}}})
    assert e.value.path == "spec.engine.lora.maxRank"


@pytest.mark.parametrize("spec", [
    {"service": "chat", "source": {"uri": "https://example.com/a.tar.gz"}},
    {"service": "chat", "source": {"uri": "http://adapters.example.com/a.tar"}},
    {"service": "chat", "source": {"huggingFace": {"name": "org/a-lora", "revision": "main"}},
     "placement": {"minReplicas": 1, "maxReplicas": 2}},
    {"service": "chat", "source": {"pvc": {"claimName": "loras", "path": "/a"}}, "baseModel": "org/m"},
])
def test_adapters_that_work_are_taken(spec):
    assert adapter_refusals(spec) == []


@pytest.mark.parametrize("spec, fragment", [
    ({"service": "chat", "source": {}}, "set exactly one of source.huggingFace, source.pvc, source.uri"),
    ({"service": "chat", "source": {"uri": "https://x/a.tar", "pvc": {"claimName": "c"}}},
     "set exactly one of source.huggingFace"),
    ({"service": "chat", "source": {"uri": "https://x/a.tar"}, "placement": {"minReplicas": 3, "maxReplicas": 2}},
     "placement.minReplicas must be at most placement.maxReplicas"),
    ({"service": "chat", "source": {"pvc": {"claimName": "c", "path": "/a/../../etc"}}},
     "source.pvc.path must stay inside the volume"),
])
def test_adapter_misuse_is_refused_with_a_clear_message(spec, fragment):
    problems = adapter_refusals(spec)
    assert any(fragment in p for p in problems), problems


def test_a_file_uri_is_refused_at_the_api_server_naming_the_fix():
    """The guard does not fetch file:// (an adapter in the image or on a volume is source.pvc)."""
    with pytest.raises(SpecError) as e:
        parse(InferenceAdapterSpec, {"service": "chat", "source": {"uri": "file:///opt/adapters/a.tar"}})
    assert e.value.path == "spec.source.uri"
    rules = ADAPTER_ROOT["spec"]["properties"]["source"]["properties"]["uri"]["x-kubernetes-validations"]
    assert "(file:// is not fetched); for a folder on a volume use source.pvc" in rules[0]["message"]
    program = ENV.program(ENV.compile(rules[0]["rule"]))
    assert not program.evaluate({"self": celpy.celtypes.StringType("file:///opt/adapters/a.tar")})
    assert program.evaluate({"self": celpy.celtypes.StringType("https://x/a.tar")})


def test_adapter_names_and_service_are_dns_labels():
    pattern = ADAPTER_ROOT["metadata"]["properties"]["name"]["pattern"]
    assert ADAPTER_ROOT["spec"]["properties"]["service"]["pattern"] == pattern
    with pytest.raises(SpecError) as e:
        parse(InferenceAdapterSpec, {"service": "Chat_1", "source": {"uri": "https://x/a.tar"}})
    assert e.value.path == "spec.service"
