"""GPU memory from inside vLLM: the plugin's sampling (on torch.cuda.memory_stats()
dictionaries in torch's own key layout), the files it hands the guard, and what
the guard exports and reports from them."""
from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_api.guard import gpu_memory as gm
from gpufleet_api.guard import guard_metrics as m
from gpufleet_engine.serving.memory_report import assemble
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_engine.vllm import plugin as vllm_plugin
from gpufleet_engine.vllm.gpu_memory import GpuMemoryReader

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "torch_memory_stats"
GiB = 1 << 30


def recorded(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def fake_torch(devices: dict[int, dict], *, cuda: str | None = "12.8", initialized: bool = True):
    """A torch whose CUDA calls answer from memory_stats() dictionaries, per device index."""
    unused = {"reserved_bytes.all.peak": 0}

    def stats(i):
        return devices[i]["stats"] if i in devices else unused

    cuda_ns = types.SimpleNamespace(
        is_initialized=lambda: initialized, device_count=lambda: max(devices, default=-1) + 2,
        memory_stats=stats,
        mem_get_info=lambda i: (devices[i]["free_bytes"], devices[i]["total_bytes"]),
        get_device_properties=lambda i: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{i}"),
        is_available=lambda: pytest.fail("is_available() initializes CUDA; the plugin must not call it"))
    return types.SimpleNamespace(__version__="2.8.0", version=types.SimpleNamespace(cuda=cuda), cuda=cuda_ns)


def test_fragmentation_is_inactive_split_over_reserved():
    assert gm.fragmentation_ratio(21 * GiB, 84 * GiB) == 0.25
    assert gm.fragmentation_ratio(0, 70 * GiB) == 0.0
    assert gm.fragmentation_ratio(5, 0) is None  # nothing reserved: nothing to say


def test_a_worker_reports_the_devices_it_allocated_on_and_no_other():
    steady, frag = recorded("worker-steady.json"), recorded("worker-fragmented.json")
    reports, no_cuda = vllm_plugin.sample(fake_torch({0: steady, 2: frag}), pid=7, now=100.0)
    assert no_cuda is None
    assert [r["device"] for r in reports] == [0, 2]  # device 1 (and 3) have no allocation of this process
    r = reports[1]
    s = frag["stats"]
    assert r["reservedBytes"] == s["reserved_bytes.all.current"]
    assert r["allocatedBytes"] == s["allocated_bytes.all.current"]
    assert r["activeBytes"] == s["active_bytes.all.current"]
    assert r["inactiveSplitBytes"] == s["inactive_split_bytes.all.current"]
    assert (r["allocRetries"], r["ooms"]) == (37, 2)
    assert (r["freeBytes"], r["totalBytes"]) == (frag["free_bytes"], frag["total_bytes"])
    assert r["fragmentationRatio"] == pytest.approx(
        s["inactive_split_bytes.all.current"] / s["reserved_bytes.all.current"])
    assert 0.27 < r["fragmentationRatio"] < 0.29 and reports[0]["fragmentationRatio"] < 0.01
    assert r["uuid"] == "GPU-2" and r["pid"] == 7 and r["time"] == 100.0


def test_a_process_that_has_not_touched_the_gpu_reports_nothing():
    assert vllm_plugin.sample(fake_torch({0: recorded("worker-steady.json")}, initialized=False),
                              pid=1, now=0.0) == ([], None)


def test_a_torch_without_cuda_says_so():
    reports, no_cuda = vllm_plugin.sample(fake_torch({}, cuda=None), pid=3, now=5.0)
    assert reports == [] and no_cuda["cuda"] is False and "built without CUDA" in no_cuda["reason"]


def write_reports(tmp_path: Path, monkeypatch, devices: dict[int, dict], now: float) -> list[Path]:
    monkeypatch.setitem(__import__("sys").modules, "torch", fake_torch(devices))
    return vllm_plugin.Sampler(tmp_path, clock=lambda: now).once()


def test_the_guard_exports_each_device_from_the_plugins_files(tmp_path, monkeypatch):
    written = write_reports(tmp_path, monkeypatch, {0: recorded("worker-steady.json"),
                                                    1: recorded("worker-fragmented.json")}, 1000.0)
    assert sorted(p.name for p in written) == ["gpu-0.json", "gpu-1.json"]
    metrics = GuardMetrics(["interactive"], gpu_memory=GpuMemoryReader(tmp_path, clock=lambda: 1002.0))
    series = {(s.name, s.labels.get("device")): s.value
              for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    frag = recorded("worker-fragmented.json")["stats"]
    assert series[(m.GPU_MEMORY_INACTIVE_SPLIT_BYTES, "1")] == frag["inactive_split_bytes.all.current"]
    assert series[(m.GPU_MEMORY_RESERVED_BYTES, "1")] == frag["reserved_bytes.all.current"]
    assert series[(m.GPU_MEMORY_ALLOC_RETRIES + "_total", "1")] == 37
    assert series[(m.GPU_MEMORY_OOMS + "_total", "0")] == 0
    assert series[(m.GPU_MEMORY_FRAGMENTATION_RATIO, "1")] > 0.25 > series[(m.GPU_MEMORY_FRAGMENTATION_RATIO, "0")]
    assert series[(m.GPU_MEMORY_REPORT_AGE_SECONDS, "0")] == 2.0


def test_stale_and_broken_files_are_skipped_with_a_reason(tmp_path, monkeypatch):
    write_reports(tmp_path, monkeypatch, {0: recorded("worker-steady.json")}, 1000.0)
    (tmp_path / "gpu-1.json").write_text("{not json")
    view = GpuMemoryReader(tmp_path, clock=lambda: 1000.0 + gm.STALE_AFTER_SECONDS + 1).read()
    assert view.devices == []
    assert any("gpu-0.json: older than" in p for p in view.problems)
    assert any(p.startswith("gpu-1.json:") for p in view.problems)
    assert "no fresh report" in view.unavailable


def test_audit_on_a_cpu_engine_says_there_is_no_cuda_device(tmp_path):
    reason = "no CUDA device: torch 2.13.0+cpu is built without CUDA"
    (tmp_path / gm.NO_CUDA_FILE).write_text(json.dumps(gm.no_cuda_report(reason, pid=1, time=50.0)))
    device = GpuMemoryReader(tmp_path, clock=lambda: 51.0).read().as_report()
    report = assemble("svc", "ns", device, {"available": False, "reason": "engine down"})
    assert report["fragmentationRatio"] is None and report["allocRetries"] is None
    assert report["unavailable"] == [f"device: {reason}", "kv: engine down"]


def test_audit_takes_the_worst_device_and_sums_retries(tmp_path, monkeypatch):
    write_reports(tmp_path, monkeypatch, {0: recorded("worker-steady.json"),
                                          1: recorded("worker-fragmented.json")}, 10.0)
    report = assemble("s", "n", GpuMemoryReader(tmp_path, clock=lambda: 11.0).read().as_report(),
                      {"available": True})
    assert 0.27 < report["fragmentationRatio"] < 0.29
    assert (report["allocRetries"], report["ooms"]) == (37, 2) and report["unavailable"] == []


def test_without_the_directory_the_guard_says_reporting_is_off():
    view = GpuMemoryReader(None).read()
    assert gm.ENV_DIR in view.unavailable and view.as_report()["available"] is False


def test_the_plugin_is_off_without_its_directory(monkeypatch):
    monkeypatch.delenv(gm.ENV_DIR, raising=False)
    started = []
    monkeypatch.setattr(vllm_plugin, "_start", started.append)
    vllm_plugin.register()
    assert started == []
    monkeypatch.setenv(gm.ENV_DIR, "/somewhere")
    vllm_plugin.register()
    assert started == [Path("/somewhere")]


def test_vllm_finds_the_plugin_where_the_images_put_the_package(tmp_path):
    """The engine images copy gpufleet_engine onto PYTHONPATH with engine_image/dist-info
    beside it; the entry point there is the one pyproject.toml registers."""
    import importlib.metadata
    import shutil
    import tomllib

    image = Path(__file__).resolve().parents[3] / "engine_image"
    shutil.copytree(image / "dist-info", tmp_path / "gpufleet_engine-0.1.0.dist-info")
    found = {d.metadata["Name"]: d for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    eps = found["gpufleet-engine"].entry_points.select(group="vllm.general_plugins")
    project = tomllib.loads((image.parent / "pyproject.toml").read_text())["project"]
    assert {e.name: e.value for e in eps} == project["entry-points"]["vllm.general_plugins"]
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        assert "COPY engine_image/dist-info /opt/gpufleet/gpufleet_engine-0.1.0.dist-info" in \
            (image / dockerfile).read_text()
    assert os.path.exists(image / "gpufleet_engine" / "vllm" / "plugin.py")
