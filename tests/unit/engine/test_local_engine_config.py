"""LocalEngine's guard.json: vLLM started --enforce-eager, and the same engine section after a reload of
the guard's own fields (a changed engine section means a vLLM restart pending, reload.py)."""
from __future__ import annotations

import json
from pathlib import Path

from gpufleet_engine.local import runner
from gpufleet_engine.local.models import PreparedModel


def engine(tmp_path: Path, monkeypatch, **kwargs) -> runner.LocalEngine:
    monkeypatch.setattr(runner, "prepare", lambda name: PreparedModel(name, tmp_path / name, 4096))
    (tmp_path / "work").mkdir(exist_ok=True)
    return runner.LocalEngine("tiny", work_dir=tmp_path / "work", guard_port=18080, engine_port=18000, **kwargs)


def test_vllm_starts_eager_and_keeps_the_extra_args_given(tmp_path, monkeypatch):
    assert engine(tmp_path, monkeypatch).config_dict["engine"]["extraArgs"] == ["--enforce-eager"]
    given = engine(tmp_path, monkeypatch, guard={"engine": {"extraArgs": ["--seed", "7"]}})
    assert given.config_dict["engine"]["extraArgs"] == ["--enforce-eager", "--seed", "7"]
    already = engine(tmp_path, monkeypatch, guard={"engine": {"extraArgs": ["--enforce-eager"]}})
    assert already.config_dict["engine"]["extraArgs"] == ["--enforce-eager"]


def test_a_guard_update_keeps_the_engine_section_it_started_with(tmp_path, monkeypatch):
    eng = engine(tmp_path, monkeypatch, guard={"kvWatermarkPercent": 5})
    started = eng.config_dict["engine"]
    eng.update_guard({"kvWatermarkPercent": 30})
    written = json.loads(eng.config_path.read_text())
    assert written["kvWatermarkPercent"] == 30 and written["engine"] == started
