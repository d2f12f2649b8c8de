"""The model-fetch init container: what it downloads of a Hub repository, and what it reports."""
from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

from gpufleet_api.guard.guard_config import EngineConfig
from gpufleet_engine.launch.fetch import fetch, is_hub_model, patterns
from tests.support.fake_hub import FakeHub

LLAMA_FILES = ["config.json", "generation_config.json", "model-00001-of-00004.safetensors",
               "model-00002-of-00004.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "original/consolidated.00.pth",
               "original/params.json", "original/tokenizer.model", "LICENSE", "README.md"]


def test_only_the_safetensors_and_the_support_files_of_a_llama_repository_are_fetched():
    allow, ignore = patterns(LLAMA_FILES)
    assert "*.safetensors" in allow and "*.json" in allow and "*.bin" not in allow
    assert "original/*" in ignore and "*.pth" in ignore


def test_pytorch_bin_weights_are_fetched_only_when_there_are_no_safetensors():
    allow, _ = patterns(["config.json", "pytorch_model.bin", "tokenizer.model"])
    assert "*.bin" in allow and "*.safetensors" not in allow


@pytest.mark.parametrize("model, hub", [("meta-llama/Llama-3.1-8B-Instruct", True), ("/opt/models/tiny", False),
                                        ("./tiny", False)])
def test_a_hub_id_is_told_from_a_folder(model, hub):
    assert is_hub_model(model) is hub


def test_fetch_asks_for_the_engines_revision_and_reports_what_is_in_the_snapshot(tmp_path: Path):
    snapshot = tmp_path / "snapshots" / "abc"
    calls = []

    def download(repo, *, revision, allow_patterns, ignore_patterns):
        calls.append((repo, revision, allow_patterns, ignore_patterns))
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        (snapshot / "model.safetensors").write_bytes(b"\0" * 1000)
        return str(snapshot)

    engine = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", revision="0e9e39f")
    got = fetch(engine, list_files=lambda repo, rev: LLAMA_FILES, download=download)
    assert calls[0][:2] == ("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f")
    assert "*.safetensors" in calls[0][2] and "original/*" in calls[0][3]
    assert got is not None and got.path == str(snapshot) and got.files == 2 and got.bytes == 1002


def test_a_folder_in_the_image_needs_no_download():
    assert fetch(EngineConfig(model="/opt/models/tiny"), list_files=lambda *_: [], download=lambda *_: "") is None


async def test_with_a_shared_cache_the_second_replica_downloads_nothing(tmp_path: Path):
    """The real huggingface_hub against a local Hub: the first fetch sends the weights, the second
    (the next replica on the same cache) only asks for the listing."""
    from huggingface_hub import HfApi, snapshot_download

    hub = FakeHub({"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "tokenizer.json": b'{"v": 1}',
                   "model.safetensors": b"\1" * 50_000, "original/consolidated.00.pth": b"\2" * 90_000})
    url = await hub.start()
    engine = EngineConfig(model="org/m", revision="main")

    def replica_start():
        return fetch(engine, list_files=lambda repo, rev: HfApi(endpoint=url).list_repo_files(repo, revision=rev),
                     download=functools.partial(snapshot_download, endpoint=url, cache_dir=tmp_path / "hub"))
    try:
        first = await asyncio.to_thread(replica_start)
        after_first = hub.sent_bytes
        second = await asyncio.to_thread(replica_start)
    finally:
        await hub.stop()
    assert first is not None and second is not None and first.path == second.path
    assert after_first == 50_000 + len(b'{"architectures": ["LlamaForCausalLM"]}') + len(b'{"v": 1}')
    assert hub.sent_bytes == after_first  # nothing more for the second replica
    assert not [p for p in hub.requested if "original/" in p]
    assert second.bytes == after_first and second.files == 3
