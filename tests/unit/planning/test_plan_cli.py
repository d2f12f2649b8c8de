"""`gpufleet plan` as a user runs it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.cli.plan import EXIT_SLO_UNREACHABLE

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "samples" / "requests.jsonl"


def run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


@pytest.fixture
def const_log(tmp_path, constant_load, as_lines):
    path = tmp_path / "const.jsonl"
    path.write_text("\n".join(as_lines(constant_load(10, 60, 500, 100, 2.0))) + "\n")
    return path


def test_sample_log_report_has_every_section_and_assumption():
    result = run("--log", str(SAMPLE))
    assert result.exit_code == 0, result.output
    out = result.output
    for section in ("REQUEST DISTRIBUTION", "KV CACHE", "ONE REPLICA", "REPLICAS NEEDED", "DISAGGREGATED SERVING",
                    "ASSUMPTIONS"):
        assert section in out
    assert "request log" in out and "(jsonl, 300 requests)" in out
    for assumption in ("GPU memory", "HBM bandwidth", "dense bf16 compute", "KV bytes per token", "tensor parallel",
                       "GPU memory utilization", "KV watermark", "TTFT p99 SLO", "ITL p99 SLO", "MFU",
                       "HBM bandwidth efficiency", "percentiles", "rate window", "concurrent tokens", "TTFT",
                       "prefill:decode"):
        assert f"\n  {assumption}" in out, assumption
    assert "[InferenceService default spec.slo.ttftP99Milliseconds]" in out
    assert "[default of --gpu]" in out


def test_json_output_of_a_known_load(const_log):
    result = run("--log", str(const_log), "--gpu", "NVIDIA-H100-80GB-HBM3", "--model",
                 "meta-llama/Llama-3.1-8B-Instruct", "--ttft-p99-ms", "500", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["concurrency"]["requests_peak"] == 20
    assert plan["concurrency"]["tokens_peak"] == 12_000
    assert plan["fleet"]["kv_demand_bytes"] == 12_000 * 131_072
    assert plan["traffic"]["rps_peak"] == 10
    assert plan["fleet"]["replicas"] == 1
    sources = {a["name"]: a["source"] for a in plan["assumptions"]}
    assert sources["TTFT p99 SLO"] == "--ttft-p99-ms"
    assert sources["GPU"] == "--gpu"


def test_fp8_kv_halves_the_kv_demand(const_log):
    result = run("--log", str(const_log), "--kv-cache-dtype", "fp8", "--json")
    plan = json.loads(result.output)
    assert plan["fleet"]["kv_demand_bytes"] == 12_000 * 65_536
    assert {a["name"]: a["source"] for a in plan["assumptions"]}["KV bytes per element"] == "--kv-cache-dtype fp8"


def test_profile_file(tmp_path, const_log):
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text("gpus:\n  Lab-GPU:\n    memoryGiB: 48\n    hbmBandwidthGBps: 900\n    denseTFLOPS: 180\n")
    result = run("--log", str(const_log), "--gpu", "lab-gpu", "--profile-file", str(profiles))
    assert result.exit_code == 0, result.output
    assert f"[profile file {profiles}]" in result.output


def test_bad_line_is_reported_with_line_and_field(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"timestamp": 1, "prompt_tokens": 5, "output_tokens": 1}\n{"timestamp": 2, "output_tokens": 1}\n')
    result = run("--log", str(log))
    assert result.exit_code == 1
    assert f'Error: {log} line 2: missing field "prompt_tokens"' in result.output


def test_skip_invalid_is_reported_in_notes(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"timestamp": 1, "prompt_tokens": 5, "output_tokens": 1}\nnot json\n')
    result = run("--log", str(log), "--skip-invalid")
    assert result.exit_code == 0, result.output
    assert "1 line(s) skipped: invalid (--skip-invalid)" in result.output
    assert "line 2: not valid JSON" in result.output


def test_unreachable_slo_prints_the_plan_and_exits_3(const_log):
    result = run("--log", str(const_log), "--ttft-p99-ms", "10", "--gpu", "L4")
    assert result.exit_code == EXIT_SLO_UNREACHABLE
    assert "REPLICAS NEEDED" in result.output
    assert "cannot be met by adding replicas" in result.output


@pytest.mark.parametrize("args, message", [
    ((), "pass exactly one of --log PATH or --prometheus URL"),
    (("--prometheus", "http://localhost:9090"), "--prometheus needs --service NAME"),
    (("--log", str(SAMPLE), "--rps-window", "soon"), "'soon' is not a duration"),
    (("--log", str(SAMPLE), "--gpu", "B200"), "unknown GPU 'B200'; pass --gpu with one of"),
])
def test_usage_errors(args, message):
    result = run(*args)
    assert result.exit_code in (1, 2)
    assert message in result.output


def test_durations_accept_compound_forms(const_log):
    plan = json.loads(run("--log", str(const_log), "--rps-window", "1m30s", "--json").output)
    assert plan["traffic"]["window_seconds"] == 90


def test_sample_log_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location("generate_requests", ROOT / "samples" / "generate_requests.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert SAMPLE.read_text(encoding="utf-8") == "\n".join(generator.generate()) + "\n"
