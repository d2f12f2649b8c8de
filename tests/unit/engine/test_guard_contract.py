"""Both ends of guard.json: whatever spec the API accepts, the guard runs.

Specs are generated from the CRD's own schema (types, bounds, enums, patterns),
defaulted the way the API server defaults them, and filtered by the schema's
own CEL rules (evaluated with a CEL interpreter), so a new API field is covered
without touching this test. The examples are derandomized so CI is repeatable;
GPUFLEET_CONTRACT_EXAMPLES=5000 explores further. Each accepted spec is rendered by the operator's
builder, parsed by the guard's reader and turned into vLLM's command line.
"""
from __future__ import annotations

import copy
import json
import os
import string

import celpy
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpufleet.manifests import guard_config as builder
from gpufleet.reconcile.validation import validate
from gpufleet_api import SpecError, parse_spec
from gpufleet_api.crd import build_crd
from gpufleet_api.guard import guard_config
from gpufleet_api.guard.engine_flags import MANAGED_FLAGS, REFUSED_FLAGS, flag_name, refused_flag
from gpufleet_engine.launch.flags import vllm_launch

SPEC_SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
# Flags vLLM accepts that gpufleet leaves to the user, and every managed flag in
# the spellings users type; the schema says only "list of strings".
EXTRA_ARGS = ["--enforce-eager", "--trust-remote-code", "--seed=7", "--disable-log-stats",
              "--max_model_len=8192", "--dtype=half", *sorted(REFUSED_FLAGS)]
LAUNCH_FLAGS_NOT_MANAGED = {"--disable-uvicorn-access-log"}  # fixed, harmless if repeated


def _from_schema(schema: dict, path: str) -> st.SearchStrategy:
    if path.endswith(".extraArgs"):
        return st.lists(st.sampled_from(EXTRA_ARGS), max_size=3)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if schema.get("x-kubernetes-int-or-string"):
        return st.sampled_from(["1", "500m", "4", "16Gi", "32Gi", "1.5", 2])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        fields = {k: _from_schema(v, f"{path}.{k}") for k, v in schema["properties"].items()}
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                     optional={k: v for k, v in fields.items() if k not in required})
    if kind == "object":
        value = _from_schema(schema.get("additionalProperties", {"type": "string"}), path + "[*]")
        return st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=8), value, max_size=2)
    if kind == "array":
        items = _from_schema(schema["items"], path + "[*]")
        keys = schema.get("x-kubernetes-list-map-keys")
        unique = (lambda x: tuple(x[k] for k in keys)) if keys else None
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3),
                        unique_by=unique)
    if kind == "integer":
        low, high = schema.get("minimum", 0), schema.get("maximum", 1 << 20)
        return st.one_of(st.sampled_from([low, high]), st.integers(low, high))
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        if "pattern" in schema:
            text = st.from_regex(schema["pattern"], fullmatch=True)
        else:
            text = st.text(string.ascii_letters + string.digits + "-./", min_size=1, max_size=24)
        low, high = schema.get("minLength", 0), schema.get("maxLength", 64)
        return text.filter(lambda s: low <= len(s) <= high)
    raise AssertionError(f"{path}: the generator has no case for {schema}")


def _defaulted(schema: dict, value):
    """Structural defaulting as the API server does it before validation."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for key, sub in schema["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = _defaulted(sub, out[key])
        return out
    if isinstance(value, list) and "items" in schema:
        return [_defaulted(schema["items"], v) for v in value]
    return value


_CEL = celpy.Environment()
_PROGRAMS: dict[str, celpy.Runner] = {}


def _cel_problems(schema: dict, value, path: str = "spec") -> list[str]:
    found = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _PROGRAMS.get(rule["rule"])
        if program is None:
            program = _PROGRAMS[rule["rule"]] = _CEL.program(_CEL.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            found.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                found += _cel_problems(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += _cel_problems(schema["items"], item, f"{path}[{i}]")
    return found


def rendered(spec: dict) -> guard_config.GuardConfig:
    config = builder.build_guard_config("chat", "ml", parse_spec(spec))
    return guard_config.parse(json.loads(builder.render(config)))


specs = _from_schema(SPEC_SCHEMA, "spec").map(lambda s: _defaulted(SPEC_SCHEMA, s))


@settings(max_examples=int(os.environ.get("GPUFLEET_CONTRACT_EXAMPLES", 300)), deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(specs)
def test_every_spec_the_api_accepts_is_rendered_into_a_config_the_guard_runs(raw):
    if _cel_problems(SPEC_SCHEMA, raw):
        event("refused by a CEL rule")
        return  # the API server refuses it: no guard.json is ever written
    try:
        spec = parse_spec(raw)
    except SpecError as e:
        pytest.fail(f"the CRD accepts a spec the operator cannot parse: {e}\n{json.dumps(raw)}")
    config = builder.build_guard_config("chat", "ml", spec)
    document = json.loads(builder.render(config))
    managed = [a for a in spec.engine.extra_args if refused_flag(a)]
    try:
        parsed = guard_config.parse(document)
    except guard_config.ConfigError as e:
        # The only spec the guard may refuse is one the operator already reports as InvalidSpec.
        assert validate(spec), f"operator accepts what the guard refuses: {e.problems}\n{json.dumps(raw)}"
        event("InvalidSpec on both sides")
        return
    event("rendered, parsed and launched")
    assert not managed, f"the guard runs vLLM with refused flags {managed} in extraArgs"
    assert parsed == config, "what the guard reads differs from what the operator wrote"
    launch = vllm_launch(parsed.engine)
    values = {parsed.engine.model, parsed.engine.served_model_name, *spec.engine.extra_args}
    emitted = {a for a in launch.argv[3:] if a.startswith("--") and a not in values}  # after python -m vllm…
    assert emitted - LAUNCH_FLAGS_NOT_MANAGED <= set(MANAGED_FLAGS), \
        "vllm_launch sets a flag users could also pass through extraArgs: add it to MANAGED_FLAGS"


@pytest.mark.parametrize("arg", ["--dtype=half", "-q", "-sc", "--max_model_len=8192", "--port=9000"])
def test_a_managed_flag_in_extra_args_is_an_invalid_spec_not_a_crashing_pod(arg):
    spec = parse_spec({"model": {"name": "m"}, "engine": {"extraArgs": ["--enforce-eager", arg]}})
    problems = validate(spec)
    assert len(problems) == 1 and problems[0].startswith(f"spec.engine.extraArgs[1]: {flag_name(arg)} is managed")


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


def test_the_document_names_every_field_so_the_configmap_shows_what_runs():
    document = json.loads(builder.render(builder.build_guard_config("chat", "ml", parse_spec(
        {"model": {"name": "m"}}))))
    assert guard_config.parse(document) == guard_config.parse(json.loads(json.dumps(document)))
    assert {"maxQueueLength", "agingSeconds", "retryAfterSeconds", "metricsPollSeconds"} <= set(document)
