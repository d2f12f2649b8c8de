"""The operator's side of issue 44's adapter bounds: guard.json caps each adapter's fetch at its
share of engine.lora.adapterStorage, private sources only with the platform admin's flag, and no
InferenceAdapter status or log line shows a source's credentials or presigned signature."""
from __future__ import annotations

import logging

import pytest
import yaml

from gpufleet.adapters import status as adapter_status
from gpufleet.adapters.desired import Refusal
from gpufleet.cli.run import run
from gpufleet.manifests import children
from gpufleet.manifests.lora import quantity_bytes
from gpufleet_api import parse_spec
from gpufleet_api.guard import guard_config as contract
from gpufleet_api.guard.adapters import AdapterReport, AdapterState

SECRET = "X-Amz-Signature=0123456789abcdef"


def isvc(**spec):
    return {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "generation": 1},
            "spec": {"model": {"name": "org/m"}, **spec}}


def guard_json(engine: dict, **kwargs) -> contract.GuardConfig:
    spec = parse_spec({"model": {"name": "org/m"}, "engine": engine})
    cm, _ = children.build_configmap(isvc(engine=engine), spec, **kwargs)
    return contract.parse(yaml.safe_load(cm["data"]["guard.json"]))


@pytest.mark.parametrize("lora,share", [({}, 256 << 20),                                 # 32 x 256Mi / 32
                                        ({"maxAdapters": 4, "adapterStorage": "8Gi"}, 2 << 30),
                                        ({"maxAdapters": 10, "adapterStorage": "1G"}, 10 ** 8)])
def test_each_adapters_fetch_is_capped_at_its_share_of_the_adapter_storage(lora, share):
    config = guard_json({"lora": lora})
    assert config.adapters.max_bytes == share and not config.adapters.allow_private_sources


def test_without_lora_the_default_cap_stands():
    assert guard_json({}).adapters == contract.AdapterFetchConfig()


def test_private_sources_only_with_the_operators_flag_and_without_a_restart():
    off, on = guard_json({"lora": {}}), guard_json({"lora": {}}, allow_private_sources=True)
    assert not off.adapters.allow_private_sources and on.adapters.allow_private_sources
    assert "adapters" in contract.LIVE_FIELDS and contract.restart_changes(off, on) == []


def test_the_flag_is_off_unless_given():
    from click.testing import CliRunner
    text = CliRunner().invoke(run, ["--help"]).output
    assert "--adapter-private-sources" in text
    from gpufleet.cli.run import settings_from_flags
    from tests.unit.test_settings import FLAGS
    assert not settings_from_flags(**FLAGS).adapter_private_sources
    assert settings_from_flags(**FLAGS, adapter_private_sources=True).adapter_private_sources


@pytest.mark.parametrize("text,value", [("512Mi", 512 << 20), ("2Gi", 2 << 30), ("1G", 10 ** 9), (1024, 1024),
                                        ("1e3", 1000), ("1.5Ki", 1536), ("x", None)])
def test_quantities_of_bytes(text, value):
    assert quantity_bytes(text) == value


def test_no_status_shows_a_presigned_signature_or_credentials(caplog):
    uri = f"https://user:pa55word@bucket.s3.amazonaws.com/a.tgz?{SECRET}"
    failed = AdapterState(name="a", state="Failed", reason="SourceUnreachable",
                          message=f"{uri} answered HTTP 403 Forbidden")
    seen = adapter_status.Observed(holders=("p1",), reports={"p1": AdapterReport(adapters=(failed,), max_adapters=4)})
    with caplog.at_level(logging.DEBUG):
        ready = adapter_status.adapter_status("a", "chat", 1, seen)["conditions"][0]
    assert "https://bucket.s3.amazonaws.com/a.tgz?<redacted>" in ready["message"]
    refused = adapter_status.adapter_status("a", "chat", 1, adapter_status.Observed(
        refusal=Refusal("SourceUnreachable", f"cannot place {uri}")))["conditions"][0]
    for shown in (ready["message"], refused["message"], caplog.text):
        assert "0123456789abcdef" not in shown and "pa55word" not in shown
