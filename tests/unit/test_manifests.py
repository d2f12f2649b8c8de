"""Builders: spec → Deployment, Service, PDB, ConfigMap, PodMonitor."""
import copy
import json

import msgspec
import pytest

from gpufleet.manifests import children, guard_config, names, revision
from gpufleet.reconcile.desired import desired_children
from gpufleet.reconcile.validation import validate
from gpufleet_api import parse_spec

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "generation": 3}}


def spec(**over):
    base = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}
    base.update(over)
    return parse_spec(base)


def deployment(s, replicas=2):
    cm, h = children.build_configmap(ISVC, s)
    return children.build_deployment(ISVC, s, replicas, h["unified"])


def test_children_have_deterministic_names_and_an_owner():
    objs = desired_children(ISVC, spec(), {"unified": 1}, with_podmonitor=True)
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("ConfigMap", "chat-guard"), ("Deployment", "chat-engine"), ("Service", "chat"),
        ("PodDisruptionBudget", "chat-engine"), ("PodMonitor", "chat-engine")]
    for o in objs:
        ref, = o["metadata"]["ownerReferences"]
        assert ref["uid"] == "u-1" and ref["controller"] is True
    assert desired_children(ISVC, spec(), {"unified": 1}, with_podmonitor=True) == objs  # pure and stable


def test_deployment_runs_vllm_and_guard_with_gpus_and_probes_on_the_guard():
    d = deployment(spec(resources={"gpusPerReplica": 2}, engine={"tensorParallelSize": 2}))
    pod = d["spec"]["template"]["spec"]
    vllm, guard = pod["containers"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in guard["resources"]["limits"]
    assert guard["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert guard["ports"][0]["containerPort"] == names.GUARD_PORT
    assert d["spec"]["replicas"] == 2


def test_grace_period_covers_the_request_timeout_and_both_containers_drain():
    d = deployment(spec(admission={"requestTimeoutSeconds": 120}))
    pod = d["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 150
    for c in pod["containers"]:
        assert "drain-wait" in c["lifecycle"]["preStop"]["exec"]["command"]


def test_dedicated_isolation_repels_other_models_on_the_node():
    d = deployment(spec())
    term, = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    exprs = term["labelSelector"]["matchExpressions"]
    own = d["spec"]["template"]["metadata"]["labels"][names.LABEL_MODEL]
    assert {"key": names.LABEL_MODEL, "operator": "NotIn", "values": [own]} in exprs


def test_exclusive_isolation_repels_every_managed_pod_and_shared_has_none():
    ex = deployment(spec(isolation={"mode": "Exclusive"}))
    term, = ex["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchExpressions"] == [{"key": names.LABEL_MODEL, "operator": "Exists"}]
    assert "affinity" not in deployment(spec(isolation={"mode": "Shared"}))["spec"]["template"]["spec"]


def test_pool_product_and_mig_become_scheduling_constraints():
    d = deployment(spec(isolation={"nodePool": "a100", "tolerations": [{"key": "team", "value": "ml",
                                                                       "effect": "NoSchedule"}]},
                        resources={"gpuProduct": "NVIDIA-A100-SXM4-80GB", "migProfile": "1g.10gb"}))
    pod = d["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpufleet.dev/node-pool": "a100", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "1"


def test_an_engine_change_changes_the_pod_template_hash():
    a = deployment(spec())
    b = deployment(spec(model={"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192}))
    key = names.ANNOTATION_CONFIG_HASH
    assert a["spec"]["template"]["metadata"]["annotations"][key] != \
        b["spec"]["template"]["metadata"]["annotations"][key]


@pytest.mark.parametrize("admission", [
    {"kvWatermarkPercent": 20}, {"maxConcurrency": 8, "maxQueueLength": 10}, {"reservation": "FullBudget"},
    {"overLengthPolicy": "TruncateLeft", "maxContextTokens": 2048},
    {"queueClasses": [{"name": "only", "level": 1, "maxQueueSeconds": 5}],
     "routeClasses": [{"route": "/v1/completions", "defaultClass": "only"}]}])
def test_an_admission_change_updates_the_configmap_but_not_the_pod_template(admission):
    """Tuning the guard must not restart vLLM: the running guards reload guard.json (reload.py)."""
    before, after = spec(), spec(admission=admission)
    assert children.build_configmap(ISVC, before)[0]["data"] != children.build_configmap(ISVC, after)[0]["data"]
    assert deployment(before)["spec"]["template"] == deployment(after)["spec"]["template"]


def test_guard_config_is_derived_from_the_spec():
    s = spec(model={"name": "m", "maxModelLen": 8192, "servedName": "chat"},
             admission={"kvWatermarkPercent": 20, "overLengthPolicy": "TruncateLeft"},
             engine={"kvCache": {"blockSize": 32}})
    cfg = guard_config.build_guard_config("chat", "ml", s)
    assert cfg.kv_watermark_percent == 20 and cfg.block_size == 32
    assert cfg.max_context_tokens == 8192  # defaults to the model length
    assert cfg.over_length_policy == "TruncateLeft"
    assert cfg.served_model_name == "chat"
    assert cfg.engine is not None and cfg.engine.gpu_memory_utilization == 0.9
    assert cfg.default_class_by_route["/v1/chat/completions"] == "interactive"
    doc = json.loads(guard_config.render(cfg))
    assert doc["kvWatermarkPercent"] == 20 and doc["engine"]["gpuMemoryUtilization"] == 0.9


def test_route_classes_and_the_class_header_policy_reach_the_guard():
    cfg = guard_config.build_guard_config("chat", "ml", spec())
    assert cfg.class_header_policy == "LowerOnly"          # by default a client cannot raise its class
    assert [c.name for c in cfg.classes_allowed("/v1/completions")] == ["standard", "background"]
    s = spec(admission={"classHeaderPolicy": "Trusted",
                        "routeClasses": [{"route": "/v1/completions", "defaultClass": "background"}]})
    doc = json.loads(guard_config.render(guard_config.build_guard_config("chat", "ml", s)))
    assert doc["classHeaderPolicy"] == "Trusted"
    assert doc["defaultClassByRoute"] == {"/v1/chat/completions": "interactive",
                                          "/v1/completions": "background", "/v1/embeddings": "background"}


POD_SETTINGS = {"labels": {"team": "search"},
                "annotations": {"cost-center": "ml-42", names.ANNOTATION_CONFIG_HASH: "mine"},
                "imagePullSecrets": [{"name": "registry"}], "priorityClassName": "gpu-serving",
                "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
                "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}]}


def test_pod_settings_reach_the_engine_pods_and_ours_win_on_a_clash():
    d = deployment(spec(pod=POD_SETTINGS))
    template = d["spec"]["template"]
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}] and pod["priorityClassName"] == "gpu-serving"
    assert {"name": "certs", "secret": {"secretName": "ca"}} in pod["volumes"]
    vllm, guard = pod["containers"]
    assert {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True} in vllm["volumeMounts"]
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["gpufleet.dev/service"] == "chat"      # the selector stays ours
    assert template["metadata"]["annotations"]["cost-center"] == "ml-42"
    assert template["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH] != "mine"
    plain = deployment(spec())["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in plain and "priorityClassName" not in plain


def test_pvc_source_is_mounted_read_only_and_hf_token_comes_from_a_secret():
    s = spec(model={"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"}}})
    d = deployment(s)
    vol = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"][0]
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert guard_config.model_location(s) == "/models/llama"
    s2 = spec(model={"name": "m", "source": {"huggingFace": {"credentialsSecretRef": {"name": "hf"}}}})
    fetch, = deployment(s2)["spec"]["template"]["spec"]["initContainers"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in fetch["env"]


@pytest.mark.parametrize("args, fragment", [
    (["--port=9000"], "spec.engine.extraArgs[0]: --port is managed"),
    (["--enable-chunked-prefill", "--tensor-parallel-size", "2"],
     "spec.engine.extraArgs[1]: --tensor-parallel-size is managed by gpufleet; remove it and set "
     "spec.engine.tensorParallelSize"),
])
def test_managed_engine_flags_are_refused_with_the_fix(args, fragment):
    problems = validate(spec(engine={"extraArgs": args}))
    assert any(fragment in p for p in problems), problems


def test_model_label_is_a_valid_label_value():
    v = names.model_label("meta-llama/Llama-3.1-405B-Instruct-FP8:with-a-very-long-suffix-that-goes-on")
    assert len(v) <= 63 and all(ch.isalnum() or ch in "-_." for ch in v)
    assert names.model_label("a/b") != names.model_label("a-b")


def test_guard_reads_the_models_tokenizer_from_the_same_place_as_the_engine():
    s = spec(model={"name": "m", "source": {"pvc": {"claimName": "weights", "path": "/llama"},
                                            "huggingFace": None}})
    d = deployment(s)
    guard = d["spec"]["template"]["spec"]["containers"][1]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in guard["volumeMounts"]
    assert {"name": "HF_HOME", "value": "/cache/huggingface"} in guard["env"]


def test_the_podmonitor_carries_the_labels_prometheus_selects_on():
    # kube-prometheus-stack selects monitors labelled release=<its release>; without the label
    # nothing from the engines is scraped.
    s = spec(monitoring={"podMonitorLabels": {"team": "ml", "release": "prom-b"}})
    pm = children.build_podmonitor(ISVC, s, {"release": "prom-a", "app.kubernetes.io/name": "x"})
    labels = pm["metadata"]["labels"]
    assert labels["release"] == "prom-b" and labels["team"] == "ml"  # the service's own win
    assert labels["app.kubernetes.io/name"] != "x"  # ours win: the operator finds its children by them
    assert children.build_podmonitor(ISVC, spec())["metadata"]["labels"] == names.common_labels("chat")



def test_the_operator_takes_podmonitor_labels_as_key_value_options():
    from click.testing import CliRunner

    from gpufleet.cli import main
    from gpufleet.cli.run import label_pairs
    assert label_pairs(("release=prom", "team=a=b")) == {"release": "prom", "team": "a=b"}
    result = CliRunner().invoke(main, ["run", "--podmonitor-label", "release"])
    assert result.exit_code == 2 and "is not KEY=VALUE" in result.output


def test_the_engine_learns_its_cpu_request_in_whole_cores():
    vllm = deployment(spec(resources={"cpu": "250m"}))["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in vllm["env"]}
    from gpufleet_engine.launch.cpu_budget import REQUEST_ENV
    assert env[REQUEST_ENV]["valueFrom"] == {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}


def test_a_hub_mirror_reaches_the_download():
    d = deployment(spec(model={"name": "org/m", "source": {"huggingFace": {"endpoint": "http://hub.mirror:8080"}}}))
    fetch, = d["spec"]["template"]["spec"]["initContainers"]
    assert {"name": "HF_ENDPOINT", "value": "http://hub.mirror:8080"} in fetch["env"]


def test_a_templates_revision_leaves_out_its_own_label_and_the_template_as_it_was(monkeypatch):
    d = deployment(spec())
    template = d["spec"]["template"]
    before = json.dumps(template, sort_keys=True)

    def deepcopy(_obj, _memo=None):
        raise AssertionError("the template is deep-copied on every apply")
    monkeypatch.setattr(copy, "deepcopy", deepcopy)
    assert template["metadata"]["labels"][names.LABEL_REVISION] == revision.of_template(template) == "7282be7bc8"
    assert json.dumps(template, sort_keys=True) == before
    assert revision.of_template({"spec": {}}) == "53aa778a9b"  # no metadata: hashed as it is


def test_building_the_children_does_not_read_the_guard_configs_field_list_each_time(monkeypatch):
    """Every apply hashes each pool's restart fields: msgspec.structs.fields (about a millisecond,
    it evaluates the annotations) is read once at import, not per hash."""
    s = spec()
    expected = desired_children(ISVC, s, {"unified": 1}, with_podmonitor=False)

    def fields(_cls):
        raise AssertionError("msgspec.structs.fields read while building children")
    monkeypatch.setattr(msgspec.structs, "fields", fields)
    assert desired_children(ISVC, s, {"unified": 1}, with_podmonitor=False) == expected
