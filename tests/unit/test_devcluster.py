"""Local control plane bookkeeping that needs no running cluster."""
import json
import subprocess

from gpufleet_dev.devcluster import cluster
from gpufleet_dev.devcluster.fleet import build_node, fleet_nodes


def test_crashed_component_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_DEV_DIR", str(tmp_path))
    log = tmp_path / "kube-scheduler.log"
    log.write_text("E1129 scheduler: failed to list nodes\npanic: boom\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "state.json").write_text(json.dumps({
            "server": "https://127.0.0.1:1", "kubeconfig": str(tmp_path / "kubeconfig"), "versions": {},
            "processes": {
                "etcd": {"pid": live.pid, "log": "x", "binary": "/bin/sleep"},
                "kube-scheduler": {"pid": dead.pid, "log": str(log), "binary": "/bin/kube-scheduler"},
            }}))
        healthy, report = cluster.status_report()
        assert not healthy
        assert f"kube-scheduler           CRASHED   (was pid {dead.pid}) log {log}" in report
        assert "panic: boom" in report
        assert "etcd                     running" in report
        assert cluster.is_running()
    finally:
        live.kill()


def test_not_running_without_state(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_DEV_DIR", str(tmp_path))
    healthy, report = cluster.status_report()
    assert not healthy and "gpufleet dev up" in report


def test_simulated_gpu_nodes_look_like_gpu_operator_nodes():
    node = build_node("gpu-node-0", gpus=8, product="NVIDIA-H100-80GB-HBM3", memory_mib=81559, pool="gpu")
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"


def test_fleet_size_is_configurable():
    nodes = fleet_nodes(cluster.FleetSpec(nodes=2, gpus_per_node=4, gpu_product="NVIDIA-A100-SXM4-80GB"))
    gpu = [n for n in nodes if "nvidia.com/gpu" in n["status"]["allocatable"]]
    assert len(gpu) == 2 and gpu[0]["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert gpu[0]["metadata"]["labels"]["nvidia.com/gpu.family"] == "ampere"
