"""vLLM flags ``extraArgs`` may not carry, with what to do instead.

The operator refuses them in ``spec.engine.extraArgs`` (InvalidSpec, naming the
field to set instead) and the guard refuses them in ``engine.extraArgs``, both
through ``extra_args_problems``:

- ``MANAGED_FLAGS``: gpufleet sets them from typed fields; passed twice, the
  last one on vLLM's command line would silently win over the field (and over
  the guard's admission arithmetic).
- ``SECRET_FLAGS``: they carry a credential, which ``extraArgs`` would write in
  plain text into guard.json, the guard ConfigMap and vLLM's logged command line.
- ``UNSUPPORTED_FLAGS``: no field sets them, and vLLM would run in a shape the
  pod and the guard do not account for (more engines or GPUs than the pod has,
  a KV pool sized past the operator's arithmetic, a transport the guard cannot
  call).

vLLM's parser accepts ``--flag_name`` for ``--flag-name``, ``--flag=value``,
``--json-flag.key value`` and any unambiguous prefix of a long flag
(``--api-k``); ``refused_flag`` sees each spelling as the flag it sets.
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
    "--kv-events-config": "leave it to gpufleet: vLLM's KV events are on wherever spec.engine.prefixCaching "
                          "is Enabled (the guard follows them for the router)",
    "--enable-lora": "set spec.engine.lora",
    "--max-loras": "set spec.engine.lora.maxAdaptersPerBatch",
    "--max-lora-rank": "set spec.engine.lora.maxRank",
    "--max-cpu-loras": "set spec.engine.lora.cpuCacheAdapters",
    "--lora-modules": "declare an InferenceAdapter for each adapter",
}

_CREDENTIAL = ("carries a credential, which extraArgs would write in plain text into guard.json, the "
               "guard ConfigMap and vLLM's logged command line; remove it and ")
SECRET_FLAGS: dict[str, str] = {
    "--api-key": _CREDENTIAL + "leave vLLM without a key: the guard calls vLLM's /v1/models, /metrics "
                 "and LoRA routes without one (they would fail), and vLLM listens only on the pod's "
                 "loopback, behind the guard. Authenticating clients is the guard's job, not yet built",
    "--hf-token": _CREDENTIAL + "put the token in a Secret and set "
                  "spec.model.source.huggingFace.credentialsSecretRef",
}

_ONE_ENGINE = ("one pod runs one vLLM engine on spec.engine.tensorParallelSize GPUs, and the guard "
               "admits against that one engine's KV pool; scale out with replicas (spec.replicas, "
               "spec.autoscaling)")
_WORLD = ("the pod requests spec.engine.tensorParallelSize GPUs, and this flag multiplies the GPUs "
          "vLLM needs past them; set spec.engine.tensorParallelSize instead")
_TRANSPORT = "the guard calls vLLM over plain HTTP on the pod's loopback port; leave vLLM's listener to gpufleet"
UNSUPPORTED_FLAGS: dict[str, str] = {
    **{flag: _ONE_ENGINE for flag in (
        "--data-parallel-size", "-dp", "--data-parallel-size-local", "-dpl",
        "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr",
        "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp",
        "--data-parallel-backend", "-dpb", "--data-parallel-hybrid-lb", "-dph",
        "--data-parallel-external-lb", "-dpe", "--data-parallel-multi-port-external-lb", "-dpm",
        "--nnodes", "-n", "--node-rank", "-r", "--headless")},
    "--pipeline-parallel-size": _WORLD,
    "-pp": _WORLD,
    "--prefill-context-parallel-size": _WORLD,
    "-pcp": _WORLD,
    "--decode-context-parallel-size": "it spreads each request's KV cache over the tensor-parallel "
                                      "ranks, so a block holds other than spec.engine.kvCache.blockSize "
                                      "tokens of a request and the guard's admission counts wrong",
    "-dcp": "it spreads each request's KV cache over the tensor-parallel ranks, so a block holds other "
            "than spec.engine.kvCache.blockSize tokens of a request and the guard's admission counts wrong",
    "--kv-cache-memory-bytes": "it overrides spec.engine.gpuMemoryUtilizationPercent, from which the "
                               "operator sizes each replica's KV pool; set gpuMemoryUtilizationPercent, "
                               "or spec.engine.kvCache.numBlocksOverride for a fixed pool",
    "--config": "it reads more flags from a file, past these checks; put each flag in spec.engine.extraArgs",
    "--uds": _TRANSPORT,
    "--grpc": _TRANSPORT,
    "--ssl-keyfile": _TRANSPORT + "; terminate TLS in front of the guard",
    "--ssl-certfile": _TRANSPORT + "; terminate TLS in front of the guard",
}

REFUSED_FLAGS: frozenset[str] = frozenset({*MANAGED_FLAGS, *SECRET_FLAGS, *UNSUPPORTED_FLAGS})

# vLLM 0.32's options that are a proper prefix of a refused flag: given in full they are themselves,
# not an abbreviation (tests/unit/engine/test_extra_args_boundary.py checks this against vLLM's parser).
VLLM_PREFIX_OPTIONS: frozenset[str] = frozenset({"--tokenizer", "-dc"})


def _resolve(name: str) -> str | None:
    """The refused flag an option name sets, as vLLM's argparse resolves it: itself, the flag it
    abbreviates (``--api-k``, ``-t`` for ``-tp``), or a short flag with its value attached (``-qawq``)."""
    if name in REFUSED_FLAGS:
        return name
    if name in VLLM_PREFIX_OPTIONS or len(name) < 2:
        return None
    long = name.startswith("--")
    if long and len(name) < 3:
        return None
    # argparse prefers an exact match, then the one option the name is a prefix of (else: ambiguous,
    # refused by vLLM); a prefix of a refused flag is refused here whichever it would pick.
    candidates = sorted(f for f in REFUSED_FLAGS if f.startswith(name) and f.startswith("--") == long)
    if candidates:
        return candidates[0]
    if not long and name[:2] in REFUSED_FLAGS:  # -n2, -qawq: a one-letter flag and its value
        return name[:2]
    return None


def refused_flag(arg: str) -> str | None:
    """The refused flag ``arg`` sets, or None (a value, or a flag left to the user)."""
    if not arg.startswith("-") or _is_number(arg):
        return None
    return _resolve(flag_name(arg))


def refusal(flag: str) -> str:
    """Why ``flag`` may not be in extraArgs, and what to do instead."""
    if flag in MANAGED_FLAGS:
        return f"{flag} is managed by gpufleet; remove it and {MANAGED_FLAGS[flag]}"
    if flag in SECRET_FLAGS:
        return f"{flag} {SECRET_FLAGS[flag]}"
    return f"{flag} is not supported: {UNSUPPORTED_FLAGS[flag]}"


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def extra_args_problems(args: list[str] | tuple[str, ...]) -> list[tuple[int, str]]:
    """(index, problem) for each entry of ``extraArgs`` vLLM would run with other than as gpufleet
    accounts for: a refused flag in any spelling vLLM accepts, or a value in a place vLLM would read
    as its positional model argument (extraArgs follow gpufleet's own flags on the command line)."""
    problems: list[tuple[int, str]] = []
    takes_value = False   # the previous entry is a flag without "=", which may take this entry
    for i, arg in enumerate(args):
        if not arg.startswith("-") or _is_number(arg):
            if not takes_value:
                problems.append((i, f"{arg!r} is not a flag, and follows no flag that takes it: vLLM "
                                    f"would read it as its positional model argument; write a flag "
                                    f"(--name or --name=value) with its value in the same entry or the next"))
            continue
        name = arg.split("=", 1)[0]
        if any(c.isspace() for c in name):
            problems.append((i, f"{arg!r} holds more than one word before any '=': vLLM would read it as "
                                f"its positional model argument; put each flag in its own entry"))
            takes_value = False
            continue
        flag = refused_flag(arg)
        if flag is not None:
            spelled = flag_name(arg)
            problems.append((i, refusal(flag) if spelled == flag else
                             f"{spelled} abbreviates {refusal(flag)} (vLLM accepts any unambiguous prefix)"))
        takes_value = "=" not in arg
    return problems


# vLLM's switch for its runtime LoRA API (/v1/load_lora_adapter, /v1/unload_lora_adapter): the
# entrypoint sets it when engine.lora is set.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def flag_name(arg: str) -> str:
    """The flag an argument sets, as vLLM's parser sees it: ``--max_model_len=8`` is
    ``--max-model-len`` (vLLM accepts underscores in long options)."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    # --speculative-config.method=ngram sets --speculative-config (vLLM's dotted JSON keys)
    return "--" + name[2:].split(".", 1)[0].replace("_", "-")


# The vllm container's CPU request in whole cores (Downward API requests.cpu, divisor 1), set by
# the operator; the entrypoint sizes vLLM-CPU's threads to it (cpu_budget.py).
CPU_REQUEST_ENV = "GPUFLEET_CPU_REQUEST"
