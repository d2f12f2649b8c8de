"""The baseline of the demo: the operator's own engine container, alone, with vLLM on the pod's
address, and nothing of the product's selectors on it."""
from __future__ import annotations

import json

import pytest

from gpufleet.manifests import children, names
from gpufleet_api import parse_spec
from gpufleet_api.guard import guard_config
from gpufleet_dev.demo import vllm_alone
from gpufleet_dev.demo.run import demo_service
from gpufleet_engine.launch.flags import vllm_launch

STATE = {"fleet": {"real_node": True}, "images": {"engine-cpu": "localhost/gpufleet/engine-cpu:abc"}}


def test_the_baseline_runs_the_operators_engine_container_with_vllm_on_its_own_port(tmp_path):
    svc = demo_service("smollm2", STATE)
    config_map, pod = vllm_alone.build(svc)
    operator_pod = children.build_deployment({**svc, "metadata": {**svc["metadata"], "uid": "u"}},
                                             parse_spec(svc["spec"]), 1, "")["spec"]["template"]["spec"]
    operator_engine = next(c for c in operator_pod["containers"] if c["name"] == "vllm")
    [engine] = pod["spec"]["containers"]
    # The same image, command, environment and resources; the same placement.
    for key in ("image", "command", "env", "resources", "volumeMounts", "securityContext"):
        assert engine[key] == operator_engine[key], key
    assert pod["spec"]["nodeSelector"] == operator_pod["nodeSelector"]
    assert pod["spec"]["tolerations"] == operator_pod["tolerations"]
    assert engine["ports"] == [{"name": "vllm", "containerPort": names.ENGINE_PORT}]
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "vllm"}
    assert "lifecycle" not in engine  # no guard to drain
    assert pod["spec"]["restartPolicy"] == "Never"  # start() sees a failed vLLM as the pod's phase
    # Its own ConfigMap: the operator's guard.json but for the address vLLM listens on.
    assert {"name": "guard-config", "configMap": {"name": "chat-vllm-alone"}} in pod["spec"]["volumes"]
    path = tmp_path / "guard.json"
    path.write_text(config_map["data"]["guard.json"])
    ours = vllm_launch(guard_config.load(str(path)).engine).argv
    theirs_doc = json.loads(config_map["data"]["guard.json"])
    assert theirs_doc["engine"]["host"] == "0.0.0.0"
    theirs_doc["engine"]["host"] = "127.0.0.1"
    path.write_text(json.dumps(theirs_doc))
    operators = vllm_launch(guard_config.load(str(path)).engine).argv
    assert [a for a in ours if a != "0.0.0.0"] == [a for a in operators if a != "127.0.0.1"]
    assert ours[ours.index("--host") + 1] == "0.0.0.0" and "--num-gpu-blocks-override" in ours


def test_nothing_of_the_product_selects_the_baseline():
    config_map, pod = vllm_alone.build(demo_service("smollm2", STATE))
    labels = pod["metadata"]["labels"]
    assert labels == config_map["metadata"]["labels"] == {"gpufleet.dev/demo-run": "vllm-alone",
                                                          "app.kubernetes.io/part-of": "gpufleet-demo"}
    assert names.LABEL_NAME not in labels and names.LABEL_SERVICE not in labels
    assert "ownerReferences" not in pod["metadata"]
    assert vllm_alone.selector() == "gpufleet.dev/demo-run=vllm-alone"


class FakeKube:
    """An API server's objects by (kind, namespace, name); a created Pod is Ready at once, or Failed."""

    def __init__(self, fail: bool = False):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.fail = fail
        self.calls: list[tuple[str, str]] = []

    def _key(self, kind, name, namespace):
        return kind, namespace, name

    async def apply(self, obj, field_manager):
        self.calls.append(("apply", obj["kind"]))
        self.objects[self._key(obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"])] = obj

    async def create(self, obj):
        self.calls.append(("create", obj["kind"]))
        status = ({"phase": "Failed"} if self.fail else
                  {"phase": "Running", "podIP": "10.88.0.7", "conditions": [{"type": "Ready", "status": "True"}]})
        self.objects[self._key(obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"])] = {
            **obj, "status": status}

    async def get_or_none(self, api_version, kind, name, namespace=None):
        return self.objects.get(self._key(kind, name, namespace))

    async def delete(self, api_version, kind, name, namespace=None, **_):
        self.calls.append(("delete", kind))
        return self.objects.pop(self._key(kind, name, namespace), None) is not None


async def test_start_waits_for_vllm_and_stop_removes_the_pod_and_its_config():
    kube = FakeKube()
    svc = demo_service("smollm2", STATE)
    pod = await vllm_alone.start(kube, svc)
    assert vllm_alone.endpoint(pod) == "http://10.88.0.7:8000"
    assert ("ConfigMap", "demo", "chat-vllm-alone") in kube.objects
    await vllm_alone.stop(kube, "demo", "chat-vllm-alone")
    assert kube.objects == {}


async def test_a_vllm_that_exits_fails_the_start_with_where_to_look():
    kube = FakeKube(fail=True)
    with pytest.raises(RuntimeError, match="kubectl -n demo logs chat-vllm-alone"):
        await vllm_alone.start(kube, demo_service("smollm2", STATE))
