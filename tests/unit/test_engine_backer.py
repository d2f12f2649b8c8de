"""The engine backer's pods are separate engines: each guard listens on its own pod IP."""
import json

from gpufleet.manifests import children
from gpufleet_api import parse_spec
from gpufleet_dev.devcluster.engines import guard_overrides


def test_a_backed_guard_keeps_its_pod_ip_not_the_operators_wildcard():
    isvc = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}
    cm, _ = children.build_configmap(isvc, parse_spec({"model": {"name": "tiny-llama"}}))
    rendered = json.loads(cm["data"]["guard.json"])
    assert rendered["listenHost"] == "0.0.0.0"   # right in a pod, which has an address of its own
    overrides = guard_overrides(rendered)
    assert "listenHost" not in overrides and "listenPort" not in overrides
    assert rendered["adminSocket"] and "adminSocket" not in overrides  # the pod's emptyDir is not on the host
    assert overrides["servedModelName"] == "tiny-llama"
