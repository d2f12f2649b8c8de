"""guard.json: the fixture shared with the operator's builder parses, and bad
files fail with messages that name the field and the fix."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from gpufleet_api.guard import guard_config
from gpufleet_api.guard.guard_config import ConfigError

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "guard.json"
DOC = Path(__file__).resolve().parents[3] / "docs" / "guard-config.md"


def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def problems(raw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        guard_config.parse(raw)
    return e.value.problems


def test_the_shared_fixture_parses_into_the_documented_values():
    cfg = guard_config.load(FIXTURE)
    assert cfg.service == "chat" and cfg.served_model_name == "chat"
    assert cfg.kv_watermark_percent == 5 and cfg.block_size == 32
    assert [(c.name, c.level, c.max_queue_seconds) for c in cfg.queue_classes] == [
        ("interactive", 1, 2.0), ("standard", 2, 10.0), ("background", 3, 60.0)]
    assert cfg.default_class_by_route == {"/v1/chat/completions": "interactive",
                                          "/v1/completions": "standard", "/v1/embeddings": "background"}
    assert cfg.engine is not None and cfg.engine.model == "/models/chat"
    assert cfg.engine.enable_prefix_caching is True and cfg.engine.speculative is None


def test_the_doc_example_is_the_fixture():
    text = DOC.read_text()
    example = text.split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(example) == fixture()


def test_a_minimal_file_gets_the_documented_defaults():
    cfg = guard_config.parse({"servedModelName": "m", "tokenizer": "/t"})
    assert cfg.listen_port == 8080 and cfg.kv_watermark_percent == 5
    assert cfg.over_length_policy == "Reject" and cfg.engine is None
    assert cfg.queue_class("background").level == 3


def test_tokenizer_and_model_name_default_to_the_engine_model():
    cfg = guard_config.parse({"engine": {"model": "/models/x"}})
    assert cfg.tokenizer == "/models/x" and cfg.served_model_name == "/models/x"


def test_a_misspelled_field_is_named_instead_of_silently_defaulted():
    raw = fixture()
    raw["kvWatermarkPercnt"] = 20
    assert problems(raw) == ["kvWatermarkPercnt: unknown field; check the spelling against docs/guard-config.md"]


def test_every_problem_is_reported_at_once():
    raw = fixture()
    raw["overLengthPolicy"] = "Truncate"
    raw["kvWatermarkPercent"] = 150
    raw["engine"]["blockSize"] = 16
    found = problems(raw)
    assert any(p.startswith("overLengthPolicy: 'Truncate' is not one of Reject, TruncateLeft") for p in found)
    assert any(p.startswith("kvWatermarkPercent: 150 is out of range; use a value between 0 and 99")
               for p in found)
    assert any(p.startswith("blockSize: 32 differs from engine.blockSize 16") for p in found)


def test_context_limit_above_the_engine_length_is_refused():
    raw = fixture()
    raw["maxContextTokens"] = 8192
    assert any("lower maxContextTokens or raise engine.maxModelLen" in p for p in problems(raw))


def test_a_route_default_must_name_a_configured_class():
    raw = fixture()
    raw["defaultClassByRoute"]["/v1/completions"] = "batch"
    assert any(p.startswith("defaultClassByRoute['/v1/completions']: class 'batch' is not in queueClasses")
               for p in problems(raw))


def test_duplicate_and_malformed_queue_classes_are_named():
    raw = fixture()
    raw["queueClasses"].append({"name": "standard", "level": 2, "maxQueueSeconds": 5})
    raw["queueClasses"].append({"name": "x", "level": 0, "maxQueueSeconds": -1})
    found = problems(raw)
    assert "queueClasses: class 'standard' appears twice; class names must be unique" in found
    assert any(p.startswith("queueClasses[4].level: 0 is out of range") for p in found)
    assert any(p.startswith("queueClasses[4].maxQueueSeconds: -1 must be greater than 0") for p in found)


def test_extra_args_may_not_override_derived_flags():
    raw = fixture()
    raw["engine"]["extraArgs"] = ["--port=9000", "--enforce-eager"]
    assert problems(raw) == ["engine.extraArgs: --port is managed by gpufleet; remove it and "
                             "leave it to the pod layout"]


def test_cpu_pool_too_small_for_the_model_length_says_how_big_it_may_be():
    raw = fixture()
    raw["engine"].update(runtime="vllm-cpu", numGpuBlocksOverride=64)
    raw["maxContextTokens"] = 1024
    found = problems(raw)
    assert any("lower maxModelLen to at most 2016 or raise numGpuBlocksOverride" in p for p in found)


def test_missing_file_and_bad_json_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="file not found; mount the <service>-guard ConfigMap"):
        guard_config.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        guard_config.load(bad)


def test_wrong_types_are_named():
    raw = copy.deepcopy(fixture())
    raw["maxConcurrency"] = "64"
    raw["engine"]["enablePrefixCaching"] = "yes"
    found = problems(raw)
    assert "maxConcurrency: must be an integer, got '64'" in found
    assert "engine.enablePrefixCaching: must be true or false, got 'yes'" in found


def kv_transfer(role: str, connector: str = "NixlConnector", **extra: str) -> dict:
    return {"connector": connector, "role": role, "extraConfig": extra}


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("prefill", "kv_both"),
                                               ("decode", "kv_consumer"), ("decode", "kv_both")])
def test_each_disaggregated_role_takes_the_kv_roles_that_fit_it(role, kv_role):
    raw = fixture()
    raw["role"] = role
    raw["engine"]["kvTransfer"] = kv_transfer(kv_role)
    assert guard_config.parse(raw).role == role


def test_a_role_whose_connector_hands_kv_the_wrong_way_is_refused_by_name():
    raw = fixture()
    raw["role"] = "decode"
    raw["engine"]["kvTransfer"] = kv_transfer("kv_producer")
    assert problems(raw) == ["engine.kvTransfer.role: 'kv_producer' does not fit role 'decode'; "
                             "use kv_consumer or kv_both"]
    del raw["engine"]["kvTransfer"]
    assert problems(raw) == ["engine.kvTransfer: required with role 'decode'; a decode pod hands KV over "
                             "through vLLM's KV connector (kvTransfer.role kv_consumer or kv_both)"]


def test_the_shared_storage_connector_needs_an_absolute_directory_and_is_bounded_by_default():
    raw = fixture()
    raw["engine"]["kvTransfer"] = kv_transfer("kv_producer", "ExampleConnector")
    assert problems(raw) == [
        "engine.kvTransfer.extraConfig.shared_storage_path: ExampleConnector needs the absolute path of a "
        "directory that the service's pods share and nothing else uses, got ''"]
    raw["engine"]["kvTransfer"] = kv_transfer("kv_producer", "ExampleConnector", shared_storage_path="/kv")
    kv = guard_config.parse(raw).engine.kv_transfer
    assert kv.shared_storage_limit_bytes == guard_config.DEFAULT_SHARED_STORAGE_LIMIT_BYTES == 4 << 30
    raw["engine"]["kvTransfer"]["sharedStorageLimitBytes"] = 1 << 20
    assert guard_config.parse(raw).engine.kv_transfer.shared_storage_limit_bytes == 1 << 20
