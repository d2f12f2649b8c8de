"""The ``engine`` section of ``guard.json`` → vLLM's command line and environment.

Pure: the entrypoint and ``LocalEngine`` execute what this returns, and the
unit tests pin it. vLLM is started as ``python -m vllm.entrypoints.openai.api_server``
because the ``vllm`` console script of the CPU wheel is broken.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from gpufleet_api.guard.engine_flags import RUNTIME_LORA_ENV
from gpufleet_api.guard.guard_config import EngineConfig, KVTransferConfig, LoraConfig
from gpufleet_api.tracing import ENGINE_SERVICE_NAME, TracingConfig, http_traces_url

VLLM_MODULE = "vllm.entrypoints.openai.api_server"

@dataclass(frozen=True)
class EngineLaunch:
    argv: tuple[str, ...]
    env: dict[str, str]  # added to the inherited environment


def vllm_launch(engine: EngineConfig, *, python: str = "python3", cpu_count: int = 1,
                cpu_cores: str | None = None, tracing: TracingConfig | None = None) -> EngineLaunch:
    """The command that starts vLLM's OpenAI server for ``engine``.

    ``cpu_count`` only matters for the ``vllm-cpu`` runtime, whose OpenMP
    threads are bound to cores 0..cpu_count-1.
    """
    cpu = engine.runtime == "vllm-cpu"
    argv = [
        python, "-m", VLLM_MODULE,
        "--model", engine.model,
        "--served-model-name", engine.served_model_name or engine.model,
        "--host", engine.host,
        "--port", str(engine.port),
        # Unset, vLLM serves the model's own context; the guard reads it from /v1/models.
        *(("--max-model-len", str(engine.max_model_len)) if engine.max_model_len is not None else ()),
        "--block-size", str(engine.block_size),
        "--kv-cache-dtype", engine.kv_cache_dtype,
        # vLLM's CPU kernels are slow or missing in half precision for small
        # models; float32 is the documented choice there.
        "--dtype", "float32" if cpu and engine.dtype == "auto" else engine.dtype,
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--max-num-seqs", str(engine.max_num_seqs),
        # The guard logs requests; vLLM's per-request access log doubles the noise.
        "--disable-uvicorn-access-log",
    ]
    if engine.revision:
        # The tokenizer comes from the same repository, so it is pinned to the same revision.
        argv += ["--revision", engine.revision, "--tokenizer-revision", engine.revision]
    if not cpu:
        argv += ["--tensor-parallel-size", str(engine.tensor_parallel_size),
                 "--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    if engine.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.quantization:
        argv += ["--quantization", engine.quantization]
    if engine.speculative:
        argv += ["--speculative-config", json.dumps(
            {"model": engine.speculative.model, "num_speculative_tokens": engine.speculative.num_tokens},
            sort_keys=True)]
    if engine.num_gpu_blocks_override is not None:
        argv += ["--num-gpu-blocks-override", str(engine.num_gpu_blocks_override)]
    if engine.kv_transfer:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_document(engine.kv_transfer), sort_keys=True)]
    if engine.kv_events:
        # The guard follows these to tell the router what the prefix cache holds (serving/kv_subscriber.py).
        argv += ["--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": engine.kv_events.endpoint,
             "topic": engine.kv_events.topic}, sort_keys=True)]
    if engine.lora:
        argv += lora_flags(engine.lora)
    argv += list(engine.extra_args)

    env: dict[str, str] = {}
    if tracing is not None and tracing.engine_spans:
        # vLLM's own request spans, parented by the guard's traceparent (docs/tracing.md).
        argv += ["--otlp-traces-endpoint", tracing_endpoint(tracing)]
        env.update(engine_tracing_env(tracing))
    if cpu:
        env.update(_cpu_env(engine, cpu_count, cpu_cores))
    if engine.lora:
        # The guard loads and unloads adapters through vLLM's runtime API (serving/adapters.py),
        # which vLLM serves only with this set.
        env[RUNTIME_LORA_ENV] = "True"
    return EngineLaunch(tuple(argv), env)


def engine_tracing_env(tracing: TracingConfig) -> dict[str, str]:
    """vLLM's OpenTelemetry settings beside its flag. The sampler: vLLM 0.32 starts a trace of its own
    for a request that came without a ``traceparent`` (the SDK's default samples every root), so every
    request a guard without tracing passed on would be exported; following the parent only, vLLM's
    spans exist exactly where the guard's sampled (or a client's sampled) context asked for them."""
    return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": tracing.protocol,
            "OTEL_SERVICE_NAME": ENGINE_SERVICE_NAME,
            "OTEL_TRACES_SAMPLER": "parentbased_always_off"}


def tracing_endpoint(tracing: TracingConfig) -> str:
    """vLLM's --otlp-traces-endpoint: its HTTP exporter takes the whole traces URL, its gRPC one host:port."""
    return http_traces_url(tracing.endpoint) if tracing.protocol == "http/protobuf" else tracing.endpoint


def lora_flags(lora: LoraConfig) -> list[str]:
    """vLLM's LoRA flags for ``engine.lora``: adapters are loaded at run time, none on the command line."""
    argv = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return argv


def kv_transfer_document(kv: KVTransferConfig) -> dict:
    """vLLM's KVTransferConfig, as --kv-transfer-config takes it."""
    return {"kv_connector": kv.connector, "kv_role": kv.role,
            "kv_connector_extra_config": dict(kv.extra_config),
            "kv_load_failure_policy": kv.load_failure_policy}


def _cpu_env(engine: EngineConfig, cpu_count: int, cpu_cores: str | None = None) -> dict[str, str]:
    if engine.cpu_kv_cache_space_gib is not None:
        space = engine.cpu_kv_cache_space_gib
    else:
        # Without VLLM_CPU_KVCACHE_SPACE vLLM-CPU sizes the pool from free
        # memory and may refuse to start; 1 GiB covers any small local pool.
        space = 1
    # Always set, so --gpu-memory-utilization (not rendered here) is never consulted: vLLM's CPU
    # worker (v1/worker/cpu_worker.py) claims that share of the host's memory only when no KV size
    # is given, and refuses to start when less is free, which its default (0.92) is once another
    # engine runs on the host. So prefill and decode engines with a KV connector share one host
    # without it (tests/engine/test_pd_handoff.py starts two).
    cores = max(1, cpu_count)
    bind = cpu_cores or ("0" if cores == 1 else f"0-{cores - 1}")
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(space),
        # Several engines on one host each get their own cores (``cpu_cores``, e.g. "1"):
        # OpenMP threads spin, and two engines bound to the same cores starve each other.
        # "nobind" (a budget smaller than the node, see cpu_budget.py): vLLM leaves the
        # threads unbound and their number to OMP_NUM_THREADS.
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        # The default reserves one core for the API server, leaving a
        # two-core machine one core for the model.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # The model runs in the engine-core process, as on one GPU, not in a third process:
        # vLLM-CPU otherwise turns the one-process executor into its multiprocessing one, which
        # imports torch and vLLM once more (20-30 s of every start on two cores) and spins on a
        # shared-memory queue between the two (decode measured twice as slow beside it).
        # docs/dev-cluster.md, "Where the tiers' time goes".
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    if bind == "nobind":
        env["OMP_NUM_THREADS"] = str(cores)
    else:
        # What vLLM's multiprocessing executor sets for its worker (utils/ompmultiprocessing.py),
        # set here for the engine core: as many OpenMP threads as cores, kept on those cores.
        ids = core_ids(bind)
        env["OMP_NUM_THREADS"] = str(len(ids))
        env["OMP_PLACES"] = "{" + ",".join(str(i) for i in ids) + "}"
        env["OMP_PROC_BIND"] = "true"
    return env


def core_ids(cores: str) -> list[int]:
    """A CPU list as Linux and VLLM_CPU_OMP_THREADS_BIND write it ("0-2,5") → [0, 1, 2, 5]."""
    ids: list[int] = []
    for part in cores.split(","):
        first, _, last = part.strip().partition("-")
        ids += range(int(first), int(last or first) + 1)
    return ids
