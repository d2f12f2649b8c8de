"""The baseline of the demo: the operator's own engine container, alone, with vLLM on the pod's
address, and nothing of the product's selectors on it."""
from __future__ import annotations

import json

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
