"""spec.model → engine settings that mean what the docs say, and weights cached once."""
from __future__ import annotations

import json

import celpy
import pytest

from gpufleet.manifests import children, guard_config, model_cache
from gpufleet.reconcile.desired import desired_children
from gpufleet.reconcile.validation import validate
from gpufleet_api import parse_spec
from gpufleet_api import v1alpha1 as t
from gpufleet_api.schema import openapi
from gpufleet_engine.launch.flags import vllm_launch

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "generation": 3}}
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def spec(model=None, **over):
    return parse_spec({"model": {"name": LLAMA, **(model or {})}, **over})


def pod(s) -> dict:
    _, h = children.build_configmap(ISVC, s)
    return children.build_deployment(ISVC, s, 2, h["unified"])["spec"]["template"]["spec"]


def mounts(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container["volumeMounts"]}


def volumes(p: dict) -> dict[str, dict]:
    return {v["name"]: v for v in p["volumes"]}


def test_without_max_model_len_vllm_gets_no_length_and_the_guard_learns_it():
    config = guard_config.build_guard_config("chat", "ml", spec())
    assert config.engine.max_model_len is None and config.max_context_tokens is None
    assert not [a for a in vllm_launch(config.engine).argv if "max-model-len" in a]
    document = json.loads(guard_config.render(config))
    assert document["engine"]["maxModelLen"] is None and document["maxContextTokens"] is None


def test_a_set_max_model_len_is_passed_and_bounds_the_guard():
    config = guard_config.build_guard_config("chat", "ml", spec({"maxModelLen": 16384}))
    argv = vllm_launch(config.engine).argv
    assert argv[argv.index("--max-model-len") + 1] == "16384" and config.max_context_tokens == 16384


def test_the_revision_reaches_vllm_and_the_guards_tokenizer_not_an_unread_variable():
    s = spec({"source": {"huggingFace": {"revision": "0e9e39f249a16976918f6564b8830bc894c89659"}}})
    config = guard_config.build_guard_config("chat", "ml", s)
    argv = vllm_launch(config.engine).argv
    assert argv[argv.index("--revision") + 1] == argv[argv.index("--tokenizer-revision") + 1] == \
        "0e9e39f249a16976918f6564b8830bc894c89659"
    assert config.tokenizer_revision == "0e9e39f249a16976918f6564b8830bc894c89659"
    for container in pod(s)["containers"]:
        assert "GPUFLEET_MODEL_REVISION" not in {e["name"] for e in container["env"]}


def test_weights_downloaded_into_the_pod_get_a_sized_emptydir_and_an_ephemeral_storage_request():
    p = pod(spec({"cache": {"ephemeralStorage": "40Gi"}}))
    vllm = p["containers"][0]
    assert volumes(p)["cache"]["emptyDir"] == {"sizeLimit": "40Gi"}
    assert vllm["resources"]["requests"]["ephemeral-storage"] == "40Gi"
    assert "model-cache" not in volumes(p)
    assert pod(spec())["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "50Gi"  # the default


@pytest.mark.parametrize("source", [{"uri": "/opt/models/tiny"}, {"pvc": {"claimName": "weights"}}])
def test_weights_read_in_place_download_nothing_and_request_no_disk(source):
    p = pod(spec({"source": source}))
    assert "ephemeral-storage" not in p["containers"][0]["resources"]["requests"]
    assert volumes(p)["cache"]["emptyDir"] == {} and "model-cache" not in volumes(p)


def test_an_existing_claim_holds_the_hugging_face_cache_of_every_replica():
    s = spec({"cache": {"persistentVolumeClaim": {"claimName": "llama-weights"}}})
    p = pod(s)
    vllm, guard = p["containers"]
    assert volumes(p)["model-cache"] == {"name": "model-cache",
                                         "persistentVolumeClaim": {"claimName": "llama-weights"}}
    fetch, = p["initContainers"]
    # The init container is the one writer; vLLM and the guard read it, offline.
    assert mounts(fetch)["model-cache"] == {"name": "model-cache", "mountPath": "/cache/huggingface",
                                            "readOnly": False}
    assert mounts(vllm)["model-cache"]["readOnly"] is True and mounts(guard)["model-cache"]["readOnly"] is True
    assert {"name": "HF_HOME", "value": model_cache.HF_HOME} in vllm["env"]
    assert "ephemeral-storage" not in vllm["resources"]["requests"]
    assert p["securityContext"]["fsGroup"] == children.RUN_AS_USER
    assert p["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    kinds = [o["kind"] for o in desired_children(ISVC, s, {"unified": 1}, with_podmonitor=False)]
    assert kinds.count("PersistentVolumeClaim") == 0


def test_hub_weights_are_downloaded_before_vllm_starts_and_read_offline():
    s = spec({"source": {"huggingFace": {"revision": "v1", "credentialsSecretRef": {"name": "hf"}}}})
    p = pod(s)
    fetch, = p["initContainers"]
    assert fetch["name"] == "model-fetch" and fetch["image"] == p["containers"][0]["image"]
    assert fetch["command"] == ["gpufleet-engine", "fetch-model", "--config", "/etc/gpufleet/guard.json"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in fetch["env"]
    assert mounts(fetch)["cache"]["mountPath"] == "/cache" and not mounts(fetch)["cache"].get("readOnly")
    assert fetch["securityContext"] == children.container_security_context()
    for container in p["containers"]:
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]


@pytest.mark.parametrize("source", [{"uri": "/opt/models/tiny"}, {"pvc": {"claimName": "weights"}}])
def test_weights_read_in_place_need_no_download(source):
    p = pod(spec({"source": source}))
    assert "initContainers" not in p
    assert all(e["name"] != "HF_HUB_OFFLINE" for c in p["containers"] for e in c["env"])


def test_the_operator_creates_and_owns_a_claim_given_its_size():
    s = spec({"cache": {"persistentVolumeClaim": {"size": "200Gi", "storageClassName": "filestore"}}})
    objs = desired_children(ISVC, s, {"unified": 1}, with_podmonitor=False)
    claim = objs[0]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == "chat-model-cache"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "filestore",
                             "resources": {"requests": {"storage": "200Gi"}}}
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert volumes(pod(s))["model-cache"]["persistentVolumeClaim"] == {"claimName": "chat-model-cache"}


def test_a_node_local_cache_mounts_an_existing_directory():
    p = pod(spec({"cache": {"hostPath": {"path": "/var/lib/gpufleet/models"}}}))
    assert volumes(p)["model-cache"]["hostPath"] == {"path": "/var/lib/gpufleet/models", "type": "Directory"}
    assert "fsGroup" not in p["securityContext"]  # no effect on hostPath; the directory is provisioned writable


def test_changing_the_cache_rolls_the_pods():
    a = children.build_deployment(ISVC, spec(), 1, "h")["spec"]["template"]
    b = children.build_deployment(ISVC, spec({"cache": {"hostPath": {"path": "/data"}}}), 1, "h")["spec"]["template"]
    assert a != b


@pytest.mark.parametrize("model, extra, fragment", [
    ({"source": {"uri": "s3://bucket/llama"}}, {},
     "spec.model.source.uri: 's3://bucket/llama' is not an absolute path inside the engine image"),
    ({"source": {"pvc": {"claimName": "w"}}, "cache": {"hostPath": {"path": "/d"}}}, {},
     "spec.model.cache.hostPath: the weights are read in place from spec.model.source.pvc"),
    ({"cache": {"persistentVolumeClaim": {"claimName": "w", "size": "1Gi"}}}, {},
     "spec.model.cache.persistentVolumeClaim: set exactly one of claimName"),
    ({"cache": {"persistentVolumeClaim": {}}}, {}, "spec.model.cache.persistentVolumeClaim: set exactly one"),
    ({"cache": {"persistentVolumeClaim": {"claimName": "w", "storageClassName": "x"}}}, {},
     "storageClassName and accessMode are for the claim the operator creates"),
    ({"cache": {"persistentVolumeClaim": {"size": "1Gi", "accessMode": "ReadWriteOnce"}}},
     {"isolation": {"mode": "Exclusive"}}, "accessMode: ReadWriteOnce attaches to one node"),
    ({}, {"engine": {"kvCache": {"numBlocksOverride": 64, "blockSize": 32}}},
     "spec.model.maxModelLen: required with spec.engine.kvCache.numBlocksOverride; set it to at most 2016"),
])
def test_model_settings_that_cannot_work_are_refused_naming_the_field(model, extra, fragment):
    problems = validate(spec(model, **extra))
    assert any(fragment in p for p in problems), problems


def test_working_model_settings_raise_no_problem():
    for model in ({}, {"cache": {"persistentVolumeClaim": {"size": "100Gi"}}},
                  {"cache": {"persistentVolumeClaim": {"claimName": "w"}}}, {"source": {"uri": "/opt/m"}},
                  {"source": {"huggingFace": {"revision": "main"}}, "cache": {"hostPath": {"path": "/d"}}}):
        assert validate(spec(model)) == [], model


def _rules(cls) -> list[tuple[str, str]]:
    return [(r["rule"], r["message"]) for r in openapi(cls).get("x-kubernetes-validations", [])]


def _holds(rule: str, value: dict) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(rule), functions={})
    return bool(program.evaluate({"self": celpy.json_to_cel(value)}))


@pytest.mark.parametrize("claim, ok", [({"claimName": "w"}, True), ({"size": "1Gi"}, True), ({}, False),
                                        ({"claimName": "w", "size": "1Gi"}, False),
                                        ({"claimName": "w", "accessMode": "ReadWriteOnce"}, False),
                                        ({"size": "1Gi", "storageClassName": "x"}, True)])
def test_the_api_server_refuses_a_claim_it_cannot_use(claim, ok):
    assert all(_holds(rule, claim) for rule, _ in _rules(t.CacheClaim)) is ok


@pytest.mark.parametrize("uri, ok", [("/opt/models/x", True), ("s3://b/x", False), ("https://x", False)])
def test_the_api_server_takes_only_paths_inside_the_image_as_uri(uri, ok):
    rule, = openapi(t.ModelSource)["properties"]["uri"]["x-kubernetes-validations"]
    assert _holds(rule["rule"], uri) is ok and "model.source.uri" in rule["message"]


SERVED_NAMES_NO_CLIENT_CAN_SEND = ["my model", " chat", "chat\t", "a\nb", "a\rb", "nul\x00", "bell\x07",
                                   "del\x7f", "c1\x85", "nbsp\xa0x"]
SERVED_NAMES_CLIENTS_SEND = [LLAMA, "org/model:tag", "my_model.v2", "chat", "Qwen2.5-7B@main", "é-模型",
                             "a" * 256]


def _served_name_rule():
    rule, = openapi(t.ModelSpec)["properties"]["servedName"]["x-kubernetes-validations"]
    return rule


@pytest.mark.parametrize("name", SERVED_NAMES_NO_CLIENT_CAN_SEND)
def test_a_served_name_no_client_can_send_is_refused_naming_the_field(name):
    rule = _served_name_rule()
    assert not _holds(rule["rule"], name)
    assert rule["message"].startswith("spec.model.servedName must not contain whitespace or control characters")
    problems = validate(spec({"servedName": name}))     # a spec stored past the CRD's rule
    assert [p for p in problems if p.startswith(rule["message"])], problems


@pytest.mark.parametrize("name", SERVED_NAMES_CLIENTS_SEND)
def test_served_names_clients_send_are_accepted(name):
    assert _holds(_served_name_rule()["rule"], name)
    assert validate(spec({"servedName": name})) == []
