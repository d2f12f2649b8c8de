"""Checks the CRD schema cannot express. Each problem names the field and the fix."""
from __future__ import annotations

from gpufleet_engine.contract.engine_flags import MANAGED_FLAGS, managed_flags_in
from gpufleet_engine.contract.guard_config import EngineConfig

from ..api.v1alpha1 import InferenceServiceSpec


def validate(spec: InferenceServiceSpec) -> list[str]:
    problems = []
    for i, flag in managed_flags_in(spec.engine.extra_args):
        problems.append(f"spec.engine.extraArgs[{i}]: {flag} is managed by gpufleet; remove it and "
                        f"{MANAGED_FLAGS[flag]}")
    if spec.engine.runtime == "vllm-cpu" and spec.engine.quantization:
        problems.append("spec.engine.quantization: vllm-cpu serves unquantized weights; remove "
                        "quantization or use runtime vllm")
    if spec.engine.runtime == "vllm-cpu" and spec.engine.kv_cache.dtype != "auto":
        problems.append("spec.engine.kvCache.dtype: vllm-cpu supports only auto; set it to auto")
    context = spec.admission.max_context_tokens
    if spec.model.max_model_len is None and context is not None and context > EngineConfig.max_model_len:
        # Unset, the engine is started with the contract's default length (CEL
        # cannot compare with a default it does not know).
        problems.append(f"spec.admission.maxContextTokens: {context} exceeds the engine's context length "
                        f"{EngineConfig.max_model_len} (spec.model.maxModelLen is unset); set "
                        f"spec.model.maxModelLen to at least {context}")
    blocks, block_size = spec.engine.kv_cache.num_blocks_override, spec.engine.kv_cache.block_size
    length = spec.model.max_model_len or EngineConfig.max_model_len
    if blocks is not None and length > (blocks - 1) * block_size:
        # vLLM keeps one block back and refuses to start when one request of
        # maxModelLen tokens cannot fit in the rest.
        fits = max(0, (blocks - 1) * block_size)
        problems.append(f"spec.engine.kvCache.numBlocksOverride: {blocks} blocks of {block_size} tokens hold "
                        f"{fits} tokens after the one vLLM keeps back, less than the context length {length}; "
                        f"raise numBlocksOverride to at least {-(-length // block_size) + 1} or set "
                        f"spec.model.maxModelLen to at most {fits}")
    return problems
