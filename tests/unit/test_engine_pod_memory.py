"""The engine pod and GPU memory: the guard has no GPU and sees none, vLLM's plugin
hands its reports to the guard through a shared emptyDir (no port), and vLLM's
allocator gets expandable segments unless the spec says otherwise."""
import pytest

from gpufleet.manifests import children
from gpufleet_api import parse_spec
from gpufleet_api.guard import gpu_memory
from gpufleet_api.v1alpha1 import RESERVED_VOLUMES

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "generation": 3}}


def containers(engine=None, gpus=1):
    s = parse_spec({"model": {"name": "m"}, "resources": {"gpusPerReplica": gpus}, "engine": engine or {}})
    pod = children.build_deployment(ISVC, s, 1, "hash")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    return by_name["vllm"], by_name["guard"], pod


def env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_guard_requests_no_gpu_and_sees_none():
    vllm, guard, _ = containers(gpus=2, engine={"tensorParallelSize": 2})
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert not any("gpu" in k for part in guard["resources"].values() for k in part)
    assert env(guard)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "NVIDIA_VISIBLE_DEVICES" not in env(vllm)


def test_vllms_memory_reports_reach_the_guard_through_a_shared_volume_not_a_port():
    vllm, guard, pod = containers()
    assert env(vllm)[gpu_memory.ENV_DIR] == env(guard)[gpu_memory.ENV_DIR] == gpu_memory.MOUNT_PATH
    mounts = {c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in (vllm, guard)}
    assert mounts["vllm"][gpu_memory.VOLUME]["mountPath"] == gpu_memory.MOUNT_PATH
    assert not mounts["vllm"][gpu_memory.VOLUME].get("readOnly")
    assert mounts["guard"][gpu_memory.VOLUME] == {"name": gpu_memory.VOLUME, "mountPath": gpu_memory.MOUNT_PATH,
                                                  "readOnly": True}
    volume, = [v for v in pod["volumes"] if v["name"] == gpu_memory.VOLUME]
    assert "emptyDir" in volume
    assert [p["name"] for p in guard["ports"]] == ["http"] and "ports" not in vllm
    assert gpu_memory.VOLUME in RESERVED_VOLUMES  # a user's pod.volumes cannot take the name


@pytest.mark.parametrize("engine, expected", [
    ({}, "expandable_segments:True"),
    ({"cudaAllocatorConfig": "max_split_size_mb:512,garbage_collection_threshold:0.8"},
     "max_split_size_mb:512,garbage_collection_threshold:0.8"),
    ({"cudaAllocatorConfig": ""}, None),
], ids=["default-expandable-segments", "spec-options-replace-it", "empty-leaves-pytorchs-defaults"])
def test_vllms_allocator_gets_expandable_segments_unless_the_spec_sets_other_options(engine, expected):
    vllm, guard, _ = containers(engine=engine)
    assert env(vllm).get(gpu_memory.ALLOCATOR_ENV) == expected
    assert gpu_memory.ALLOCATOR_ENV not in env(guard)

