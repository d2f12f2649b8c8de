"""guard.json's engine section → the vLLM command the container runs."""
from __future__ import annotations

import json
from pathlib import Path

from gpufleet_api.guard import guard_config
from gpufleet_engine.launch.cpu_budget import CpuBudget
from gpufleet_engine.launch.entrypoint import plan
from gpufleet_engine.launch.flags import vllm_launch

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "guard.json"


def engine_cfg(**engine_overrides):
    raw = json.loads(FIXTURE.read_text())
    raw["engine"].update(engine_overrides)
    return guard_config.parse(raw)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_the_fixture_becomes_the_gpu_command_line():
    launch = vllm_launch(engine_cfg().engine, python="python3")
    assert launch.argv == (
        "python3", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/chat", "--served-model-name", "chat",
        "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "4096",
        "--block-size", "32", "--kv-cache-dtype", "auto", "--dtype", "auto",
        "--enable-prefix-caching", "--max-num-seqs", "256", "--disable-uvicorn-access-log",
        "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
        "--max-num-batched-tokens", "8192",
    )
    assert launch.env == {}


def test_the_cpu_runtime_adds_its_environment_and_float32():
    cfg = engine_cfg(runtime="vllm-cpu", numGpuBlocksOverride=200, cpuKvCacheSpaceGiB=2)
    launch = vllm_launch(cfg.engine, python="py", cpu_count=2)
    assert launch.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                          "OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    assert flag(launch.argv, "--dtype") == "float32"
    assert flag(launch.argv, "--num-gpu-blocks-override") == "200"
    assert "--gpu-memory-utilization" not in launch.argv and "--tensor-parallel-size" not in launch.argv


def test_cpu_runtime_keeps_an_explicit_dtype_and_binds_one_core_alone():
    cfg = engine_cfg(runtime="vllm-cpu", dtype="bfloat16", numGpuBlocksOverride=200)
    launch = vllm_launch(cfg.engine, cpu_count=1)
    assert flag(launch.argv, "--dtype") == "bfloat16"
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_optional_features_map_to_their_flags():
    cfg = engine_cfg(quantization="fp8", speculative={"model": "/models/draft", "numTokens": 4},
                     enablePrefixCaching=False, tensorParallelSize=2, extraArgs=["--enforce-eager"])
    argv = vllm_launch(cfg.engine).argv
    assert flag(argv, "--quantization") == "fp8"
    assert json.loads(flag(argv, "--speculative-config")) == {"model": "/models/draft", "num_speculative_tokens": 4}
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert argv[-1] == "--enforce-eager"


def test_a_kv_connector_becomes_vllms_kv_transfer_config():
    cfg = engine_cfg(kvTransfer={"connector": "ExampleConnector", "role": "kv_producer",
                                 "extraConfig": {"shared_storage_path": "/kv"}})
    assert json.loads(flag(vllm_launch(cfg.engine).argv, "--kv-transfer-config")) == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/kv"}, "kv_load_failure_policy": "recompute"}
    assert "--kv-transfer-config" not in vllm_launch(engine_cfg().engine).argv


def test_the_kv_connector_is_a_managed_flag():
    try:
        engine_cfg(extraArgs=["--kv-transfer-config", "{}"])
    except guard_config.ConfigError as e:
        assert "set spec.engine.kvTransfer" in str(e)
    else:
        raise AssertionError("--kv-transfer-config in extraArgs was accepted")


def test_the_entrypoint_runs_vllm_and_the_guard_from_the_same_file():
    launch, guard_argv = plan(engine_cfg(), "/etc/gpufleet/guard.json", "/usr/bin/python3",
                              CpuBudget(8, "0-7", "cores"))
    assert launch.argv[0] == "/usr/bin/python3"
    assert guard_argv == ["/usr/bin/python3", "-m", "gpufleet_engine", "serve",
                          "--config", "/etc/gpufleet/guard.json"]


def test_the_entrypoint_needs_an_engine_section():
    raw = json.loads(FIXTURE.read_text())
    del raw["engine"]
    cfg = guard_config.parse(raw)
    try:
        plan(cfg, "/x", "py", CpuBudget(1, "0", "cores"))
    except guard_config.ConfigError as e:
        assert "engine: required by the container entrypoint" in str(e)
    else:
        raise AssertionError("plan accepted a config without an engine section")


def test_without_max_model_len_vllm_serves_the_models_own_context():
    argv = vllm_launch(engine_cfg(maxModelLen=None).engine).argv
    assert not [a for a in argv if a.startswith("--max-model-len") or a.startswith("--max_model_len")]


def test_a_revision_pins_the_weights_and_the_tokenizer():
    argv = vllm_launch(engine_cfg(revision="a1b2c3d").engine).argv
    assert flag(argv, "--revision") == "a1b2c3d" and flag(argv, "--tokenizer-revision") == "a1b2c3d"
    assert "--revision" not in vllm_launch(engine_cfg().engine).argv


def test_the_guard_loads_the_tokenizer_at_the_engines_revision():
    raw = json.loads(FIXTURE.read_text())
    raw["engine"]["revision"] = "v2"
    assert guard_config.parse(raw).tokenizer_revision == "v2"


def test_cpu_engines_with_a_kv_connector_size_their_pool_explicitly_so_two_share_a_host():
    # vLLM's CPU worker claims --gpu-memory-utilization (default 0.92) of the host only when no KV
    # size is given; with VLLM_CPU_KVCACHE_SPACE always set, a producer and a consumer start side
    # by side on one host without that flag (tests/engine/test_pd_handoff.py starts them).
    for role in ("kv_producer", "kv_consumer"):
        cfg = engine_cfg(runtime="vllm-cpu", numGpuBlocksOverride=200, kvTransfer={
            "connector": "ExampleConnector", "role": role, "extraConfig": {"shared_storage_path": "/kv"}})
        launch = vllm_launch(cfg.engine, cpu_count=1)
        assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert "--gpu-memory-utilization" not in launch.argv
        assert json.loads(flag(launch.argv, "--kv-transfer-config"))["kv_role"] == role


def test_lora_renders_vllms_flags_and_its_runtime_api_switch():
    cfg = engine_cfg(runtime="vllm-cpu", lora={"maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 3})
    launch = vllm_launch(cfg.engine, cpu_count=1)
    argv = launch.argv
    assert "--enable-lora" in argv
    assert (flag(argv, "--max-loras"), flag(argv, "--max-lora-rank"), flag(argv, "--max-cpu-loras")) == ("2", "8", "3")
    assert "--lora-modules" not in argv  # adapters come at run time (PUT /adapters), never on the command line
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_lora_defaults_leave_the_cpu_cache_to_vllm():
    argv = vllm_launch(engine_cfg(lora={}).engine).argv
    assert (flag(argv, "--max-loras"), flag(argv, "--max-lora-rank")) == ("4", "16")
    assert "--max-cpu-loras" not in argv


def test_without_lora_nothing_of_it_is_rendered():
    launch = vllm_launch(engine_cfg().engine)
    assert not [a for a in launch.argv if "lora" in a]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in launch.env


def test_a_cpu_cache_smaller_than_a_batch_is_refused():
    import pytest
    with pytest.raises(guard_config.ConfigError, match="maxCpuLoras"):
        engine_cfg(lora={"maxLoras": 4, "maxCpuLoras": 2})
