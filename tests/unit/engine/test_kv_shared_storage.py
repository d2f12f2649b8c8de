"""The shared-storage connector's directory kept under its limit: the oldest prompts' folders
removed whole, young ones and anything the connector did not write left alone."""
from __future__ import annotations

import os
from pathlib import Path

from gpufleet_api.guard import guard_config
from gpufleet_engine.vllm import shared_storage
from gpufleet_engine.vllm.shared_storage import PromptFolder, bound, scan, to_remove

NOW = 1_000_000.0
LAYERS = ("model.layers.0.self_attn.attn.safetensors", "model.layers.1.self_attn.attn.safetensors")


def prompt_folder(directory: Path, index: int, age: float, layer_bytes: int = 100) -> str:
    """A folder as ExampleConnector writes it: the prompt's md5 in hex, one file per layer."""
    name = f"{index:032x}"
    folder = directory / name
    folder.mkdir()
    for layer in LAYERS:
        (folder / layer).write_bytes(b"k" * layer_bytes)
    os.utime(folder, (NOW - age, NOW - age))
    return name


def test_the_oldest_folders_go_until_the_rest_fits_and_young_ones_stay_even_over_the_limit():
    folders = [PromptFolder("new", 500, NOW - 10), PromptFolder("old", 500, NOW - 900),
               PromptFolder("older", 500, NOW - 1000), PromptFolder("mid", 500, NOW - 500)]
    assert [f.name for f in to_remove(folders, 1000, NOW)] == ["older", "old"]
    assert [f.name for f in to_remove(folders, 600, NOW)] == ["older", "old", "mid"]  # "new" is too young
    assert to_remove(folders, 2000, NOW) == []


def test_a_pass_removes_whole_folders_oldest_first_and_leaves_every_other_one_complete(tmp_path):
    names = [prompt_folder(tmp_path, i, age=1000 - i) for i in range(5)]  # 200 bytes each, 0 oldest
    done = bound(tmp_path, 450, NOW)
    assert done == shared_storage.Bounded(size_bytes=400, removed=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == names[3:]
    # What the consumer sees: a folder with all its layers, or no folder (then it computes the prompt).
    assert all(sorted(os.listdir(tmp_path / name)) == sorted(LAYERS) for name in left)


def test_only_what_the_connector_writes_is_counted_or_removed(tmp_path):
    prompt_folder(tmp_path, 1, age=1000)
    (tmp_path / "notes").mkdir()                       # not a digest
    (tmp_path / "notes" / "a.safetensors").write_bytes(b"x" * 5000)
    other = tmp_path / f"{2:032x}"                     # a digest's name holding something else
    other.mkdir()
    (other / "data.bin").write_bytes(b"x" * 5000)
    os.utime(other, (NOW - 2000, NOW - 2000))
    (tmp_path / f"{3:064x}").write_bytes(b"x")        # a file, not a folder
    assert [f.name for f in scan(tmp_path)] == [f"{1:032x}"]
    assert bound(tmp_path, 1, NOW).removed == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["notes", f"{2:032x}", f"{3:064x}"])


def test_a_folder_another_pod_removed_first_is_skipped(tmp_path):
    name = prompt_folder(tmp_path, 1, age=1000)
    folder = scan(tmp_path)[0]
    assert shared_storage.remove(tmp_path, folder)
    assert not (tmp_path / name).exists()
    assert not shared_storage.remove(tmp_path, folder)


def test_folders_renamed_away_by_a_bounder_that_died_are_deleted_on_the_next_pass(tmp_path):
    prompt_folder(tmp_path, 1, age=5)
    leftover = tmp_path / ".gpufleet-removing-0123-abcd"
    leftover.mkdir()
    (leftover / LAYERS[0]).write_bytes(b"x")
    assert bound(tmp_path, 1 << 20, NOW).removed == 0
    assert not leftover.exists() and len(scan(tmp_path)) == 1


def engine(kv: dict | None) -> guard_config.EngineConfig:
    return guard_config.EngineConfig(model="m", kv_transfer=None if kv is None else guard_config.KVTransferConfig(**kv))


def test_only_pods_that_write_the_shared_storage_connectors_files_bound_its_directory():
    shared = {"connector": "ExampleConnector", "extra_config": {"shared_storage_path": "/kv"},
              "shared_storage_limit_bytes": 1000}
    assert shared_storage.bounded_directory(engine({**shared, "role": "kv_producer"})) == (Path("/kv"), 1000)
    assert shared_storage.bounded_directory(engine({**shared, "role": "kv_both"})) == (Path("/kv"), 1000)
    assert shared_storage.bounded_directory(engine({**shared, "role": "kv_consumer"})) is None
    assert shared_storage.bounded_directory(engine({"connector": "NixlConnector", "role": "kv_producer"})) is None
    assert shared_storage.bounded_directory(engine(None)) is None
    assert shared_storage.bounded_directory(None) is None
