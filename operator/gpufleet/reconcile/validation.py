"""Checks the CRD schema cannot express. Each problem names the field and the fix."""
from __future__ import annotations

from ..api.v1alpha1 import InferenceServiceSpec

# vLLM flags derived from typed fields: setting them through extraArgs would
# silently fight the operator (and the guard's admission arithmetic).
MANAGED_FLAGS = {
    "--port": "it is fixed by the pod layout",
    "--host": "it is fixed by the pod layout",
    "--model": "set spec.model.name or spec.model.source",
    "--served-model-name": "set spec.model.servedName",
    "--tensor-parallel-size": "set spec.engine.tensorParallelSize",
    "-tp": "set spec.engine.tensorParallelSize",
    "--block-size": "set spec.engine.kvCache.blockSize",
    "--kv-cache-dtype": "set spec.engine.kvCache.dtype",
    "--max-model-len": "set spec.model.maxModelLen",
    "--gpu-memory-utilization": "set spec.engine.gpuMemoryUtilizationPercent",
    "--max-num-seqs": "set spec.engine.maxNumSeqs",
    "--max-num-batched-tokens": "set spec.engine.maxNumBatchedTokens",
    "--num-gpu-blocks-override": "set spec.engine.kvCache.numBlocksOverride",
    "--quantization": "set spec.engine.quantization",
    "--enable-prefix-caching": "set spec.engine.prefixCaching",
    "--no-enable-prefix-caching": "set spec.engine.prefixCaching",
    "--speculative-config": "set spec.engine.speculative",
}


def validate(spec: InferenceServiceSpec) -> list[str]:
    problems = []
    for i, arg in enumerate(spec.engine.extra_args):
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            problems.append(f"spec.engine.extraArgs[{i}]: {flag} is managed by gpufleet; remove it and "
                            f"{MANAGED_FLAGS[flag]}")
    if spec.engine.runtime == "vllm-cpu" and spec.engine.quantization:
        problems.append("spec.engine.quantization: vllm-cpu serves unquantized weights; remove "
                        "quantization or use runtime vllm")
    if spec.engine.runtime == "vllm-cpu" and spec.engine.kv_cache.dtype != "auto":
        problems.append("spec.engine.kvCache.dtype: vllm-cpu supports only auto; set it to auto")
    return problems
