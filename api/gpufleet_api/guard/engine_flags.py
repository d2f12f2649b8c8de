"""vLLM flags gpufleet sets from typed fields, with the field that sets each.

The operator refuses them in ``spec.engine.extraArgs`` (InvalidSpec, naming the
field to set instead) and the guard refuses them in ``engine.extraArgs``:
passed twice, the last one on vLLM's command line would silently win over the
field (and over the guard's admission arithmetic).
"""
from __future__ import annotations

# flag → what to do instead
MANAGED_FLAGS: dict[str, str] = {
    "--model": "set spec.model.name or spec.model.source",
    "--served-model-name": "set spec.model.servedName",
    "--host": "leave it to the pod layout",
    "--port": "leave it to the pod layout",
    "--max-model-len": "set spec.model.maxModelLen",
    "--revision": "set spec.model.source.huggingFace.revision",
    "--tokenizer-revision": "set spec.model.source.huggingFace.revision",
    "--tensor-parallel-size": "set spec.engine.tensorParallelSize",
    "-tp": "set spec.engine.tensorParallelSize",
    "--gpu-memory-utilization": "set spec.engine.gpuMemoryUtilizationPercent",
    "--block-size": "set spec.engine.kvCache.blockSize",
    "--kv-cache-dtype": "set spec.engine.kvCache.dtype",
    "--dtype": "set spec.engine.dtype",
    "--enable-prefix-caching": "set spec.engine.prefixCaching",
    "--no-enable-prefix-caching": "set spec.engine.prefixCaching",
    "--max-num-seqs": "set spec.engine.maxNumSeqs",
    "--max-num-batched-tokens": "set spec.engine.maxNumBatchedTokens",
    "--quantization": "set spec.engine.quantization",
    "-q": "set spec.engine.quantization",
    "--speculative-config": "set spec.engine.speculative",
    "-sc": "set spec.engine.speculative",
    "--num-gpu-blocks-override": "set spec.engine.kvCache.numBlocksOverride",
    "--kv-transfer-config": "set spec.engine.kvTransfer",
    "--enable-lora": "set spec.engine.lora",
    "--max-loras": "set spec.engine.lora.maxAdaptersPerBatch",
    "--max-lora-rank": "set spec.engine.lora.maxRank",
    "--max-cpu-loras": "set spec.engine.lora.cpuCacheAdapters",
    "--lora-modules": "declare an InferenceAdapter for each adapter",
}

# vLLM's switch for its runtime LoRA API (/v1/load_lora_adapter, /v1/unload_lora_adapter): the
# entrypoint sets it when engine.lora is set.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def flag_name(arg: str) -> str:
    """The flag an argument sets, as vLLM's parser sees it: ``--max_model_len=8`` is
    ``--max-model-len`` (vLLM accepts underscores in long options)."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def managed_flags_in(args: list[str] | tuple[str, ...]) -> list[tuple[int, str]]:
    """(index, flag) of each argument that sets a managed flag."""
    return [(i, flag_name(a)) for i, a in enumerate(args) if flag_name(a) in MANAGED_FLAGS]


# The vllm container's CPU request in whole cores (Downward API requests.cpu, divisor 1), set by
# the operator; the entrypoint sizes vLLM-CPU's threads to it (cpu_budget.py).
CPU_REQUEST_ENV = "GPUFLEET_CPU_REQUEST"
