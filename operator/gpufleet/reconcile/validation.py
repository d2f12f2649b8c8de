"""Checks the CRD schema cannot express. Each problem names the field and the fix."""
from __future__ import annotations

import re

from gpufleet_api.guard.engine_flags import extra_args_problems
from gpufleet_api.v1alpha1 import (
    DIRECT,
    DIRECT_DISAGGREGATION_MESSAGE,
    ROLLOUT_DISAGGREGATION_MESSAGE,
    SERVED_NAME_FORBIDDEN,
    SERVED_NAME_MESSAGE,
    STEPS_INCREASING_MESSAGE,
    STEPS_LAST_MESSAGE,
    InferenceServiceSpec,
)

from ..manifests.pools import replica_bounds


def validate(spec: InferenceServiceSpec) -> list[str]:
    problems = []
    for i, problem in extra_args_problems(spec.engine.extra_args):
        problems.append(f"spec.engine.extraArgs[{i}]: {problem}")
    if spec.engine.runtime == "vllm-cpu" and spec.engine.quantization:
        problems.append("spec.engine.quantization: vllm-cpu serves unquantized weights; remove "
                        "quantization or use runtime vllm")
    if spec.engine.runtime == "vllm-cpu" and spec.engine.kv_cache.dtype != "auto":
        problems.append("spec.engine.kvCache.dtype: vllm-cpu supports only auto; set it to auto")
    blocks, block_size = spec.engine.kv_cache.num_blocks_override, spec.engine.kv_cache.block_size
    length = spec.model.max_model_len
    if blocks is not None and length is None:
        # Unset, vLLM takes the model's own context (often 128k tokens) and refuses to start
        # when one request of it does not fit the fixed pool.
        fits = max(0, (blocks - 1) * block_size)
        problems.append(f"spec.model.maxModelLen: required with spec.engine.kvCache.numBlocksOverride; "
                        f"set it to at most {fits} tokens (what {blocks} blocks of {block_size} hold after "
                        f"the one vLLM keeps back)")
    elif blocks is not None and length is not None and length > (blocks - 1) * block_size:
        # vLLM keeps one block back and refuses to start when one request of
        # maxModelLen tokens cannot fit in the rest.
        fits = max(0, (blocks - 1) * block_size)
        problems.append(f"spec.engine.kvCache.numBlocksOverride: {blocks} blocks of {block_size} tokens hold "
                        f"{fits} tokens after the one vLLM keeps back, less than the context length {length}; "
                        f"raise numBlocksOverride to at least {-(-length // block_size) + 1} or set "
                        f"spec.model.maxModelLen to at most {fits}")
    problems += _model_problems(spec)
    problems += rollout_problems(spec)
    if spec.gateway is not None and spec.gateway.data_path == DIRECT and spec.disaggregation is not None:
        problems.append(DIRECT_DISAGGREGATION_MESSAGE)  # the CRD's CEL rule says it at admission
    return problems


def rollout_problems(spec: InferenceServiceSpec) -> list[str]:
    """spec.rollout (the CRD's CEL rules say the same at admission)."""
    rollout = spec.rollout
    if rollout is None:
        return []
    problems = []
    if spec.disaggregation is not None:
        problems.append(ROLLOUT_DISAGGREGATION_MESSAGE)
    weights = [s.weight_percent for s in rollout.steps]
    for i in range(1, len(weights)):
        if weights[i] <= weights[i - 1]:
            problems.append(f"spec.rollout.steps[{i}].weightPercent: {weights[i]} is not above the previous "
                            f"step's {weights[i - 1]}; {STEPS_INCREASING_MESSAGE}")
            break
    if weights and weights[-1] != 100:
        problems.append(f"spec.rollout.steps[{len(weights) - 1}].weightPercent: {weights[-1]}; {STEPS_LAST_MESSAGE}")
    return problems


def _model_problems(spec: InferenceServiceSpec) -> list[str]:
    """The weights' source and cache (the CRD's CEL rules say the same at admission; these also
    catch objects stored before those rules existed)."""
    problems = []
    model = spec.model
    if model.served_name is not None and re.search(SERVED_NAME_FORBIDDEN, model.served_name):
        problems.append(f"{SERVED_NAME_MESSAGE} (got {model.served_name!r})")
    uri = model.source.uri
    if uri is not None and not uri.startswith("/"):
        problems.append(f"spec.model.source.uri: {uri!r} is not an absolute path inside the engine image; "
                        f"remote schemes (s3://, gs://, https://) are not supported: copy the weights into a "
                        f"PersistentVolumeClaim (spec.model.source.pvc) or load them from the Hugging Face Hub "
                        f"(spec.model.source.huggingFace, with spec.model.cache)")
    cache = model.cache
    claim = cache.persistent_volume_claim
    in_place = model.source.pvc is not None or uri is not None
    if in_place and (claim or cache.host_path):
        which = "persistentVolumeClaim" if claim else "hostPath"
        problems.append(f"spec.model.cache.{which}: the weights are read in place from "
                        f"spec.model.source.{'pvc' if model.source.pvc else 'uri'}, nothing is downloaded to "
                        f"cache; remove spec.model.cache.{which}")
    if claim and cache.host_path:
        problems.append("spec.model.cache: set at most one of persistentVolumeClaim and hostPath")
    if claim and (claim.claim_name is None) == (claim.size is None):
        problems.append("spec.model.cache.persistentVolumeClaim: set exactly one of claimName (an existing "
                        "claim) and size (the operator creates the claim <service>-model-cache)")
    if claim and claim.claim_name and (claim.storage_class_name or claim.access_mode):
        problems.append("spec.model.cache.persistentVolumeClaim: storageClassName and accessMode are for the "
                        "claim the operator creates; an existing claim (claimName) has its own, so remove them")
    most = replica_bounds(spec)[1]
    if claim and claim.size is not None and claim.access_mode == "ReadWriteOnce" \
            and spec.isolation.mode == "Exclusive" and most > 1:
        # Exclusive puts each replica on a node of its own; a ReadWriteOnce volume attaches to one node.
        problems.append("spec.model.cache.persistentVolumeClaim.accessMode: ReadWriteOnce attaches to one node, "
                        "but isolation.mode Exclusive puts each of up to "
                        f"{most} replicas on its own node; use ReadWriteMany")
    return problems
