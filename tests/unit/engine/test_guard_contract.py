"""Both ends of guard.json: what the operator's builder renders, the guard accepts."""
from __future__ import annotations

import json

from gpufleet.api import parse_spec
from gpufleet.manifests import guard_config as builder

from gpufleet_engine import config as guard_config
from gpufleet_engine.flags import vllm_launch


def rendered(spec: dict) -> guard_config.GuardConfig:
    doc = builder.build_guard_config("chat", "ml", parse_spec(spec))
    return guard_config.parse(json.loads(builder.render(doc)))


def test_the_shortest_manifest_yields_a_config_the_guard_runs():
    cfg = rendered({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}})
    assert cfg.kv_watermark_percent == 5 and cfg.listen_port == 8080
    argv = vllm_launch(cfg.engine).argv
    assert argv[argv.index("--model") + 1] == "meta-llama/Llama-3.1-8B-Instruct"


def test_a_local_cpu_service_yields_cpu_flags():
    cfg = rendered({"model": {"name": "tiny", "maxModelLen": 1024},
                    "engine": {"runtime": "vllm-cpu",
                               "kvCache": {"blockSize": 32, "numBlocksOverride": 64, "cpuKvCacheSpaceGiB": 1}},
                    "admission": {"overLengthPolicy": "TruncateLeft", "maxConcurrency": 8}})
    launch = vllm_launch(cfg.engine, cpu_count=2)
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert launch.argv[launch.argv.index("--num-gpu-blocks-override") + 1] == "64"
    assert cfg.over_length_policy == "TruncateLeft" and cfg.max_concurrency == 8
