"""`gpufleet tenants new-key` and `add-key`: the key shown once on stdout, a Secret manifest that holds
only its record (the router's KeyTable identifies the key from it), labelled for the router's watch; a
rotation adds a record and keeps the others."""
from __future__ import annotations

import base64

import pytest
import yaml
from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.cli.tenants import add_record, new_record
from gpufleet_api.tenants.identity import Identified
from gpufleet_api.tenants.keys import KEY_PREFIX, KeyTable
from gpufleet_api.tenants.usage import KEYS_SECRET_LABEL


def run(*args: str):
    return CliRunner().invoke(main, ["tenants", *args], catch_exceptions=False)


def table_of(manifest: dict, data_key: str = "keys") -> KeyTable:
    return KeyTable.parse({"search": manifest["stringData"][data_key]})


def test_new_key_prints_the_key_once_and_a_secret_of_its_hash_only(tmp_path):
    out = tmp_path / "keys.yaml"
    result = run("new-key", "--tenant", "search", "--namespace", "ml", "-o", str(out))
    assert result.exit_code == 0, result.output
    key = result.stdout.strip()
    assert key.startswith(KEY_PREFIX) and "\n" not in key  # stdout is the key alone: KEY=$(gpufleet ...)
    assert "only time the key is shown" in result.stderr
    assert "keys: {name: search-api-keys, key: keys}" in result.stderr
    text = out.read_text()
    assert key not in text
    manifest = yaml.safe_load(text)
    assert manifest["kind"] == "Secret" and manifest["metadata"]["namespace"] == "ml"
    assert manifest["metadata"]["name"] == "search-api-keys"
    assert manifest["metadata"]["labels"][KEYS_SECRET_LABEL] == "true"
    assert table_of(manifest).identify(f"Bearer {key}") == Identified("search")


def test_without_output_the_manifest_follows_the_key_on_stdout():
    result = run("new-key", "--tenant", "search", "-n", "ml", "--secret", "search-keys", "--key", "hashes")
    key, manifest = result.stdout.split("\n---\n")
    manifest = yaml.safe_load(manifest)
    assert manifest["metadata"]["name"] == "search-keys"
    assert table_of(manifest, "hashes").identify(f"Bearer {key.strip()}") == Identified("search")


def test_two_keys_are_never_the_same():
    assert len({new_record()[0] for _ in range(20)}) == 20


@pytest.mark.parametrize("args, fragment", [
    (["--tenant", "Search", "-n", "ml"], "'Search' is not a DNS label"),
    (["--tenant", "search", "-n", "ml_x"], "'ml_x' is not a namespace name"),
    (["--tenant", "search"], "Missing option '--namespace'"),
])
def test_bad_names_are_refused_naming_the_option(args, fragment):
    result = CliRunner().invoke(main, ["tenants", "new-key", *args])
    assert result.exit_code == 2 and fragment in result.output


def test_add_key_rotates_keeping_the_old_record(tmp_path):
    out = tmp_path / "keys.yaml"
    old = run("new-key", "--tenant", "search", "-n", "ml", "-o", str(out)).stdout.strip()
    new = run("add-key", str(out)).stdout.strip()
    assert new != old and new.startswith(KEY_PREFIX)
    table = table_of(yaml.safe_load(out.read_text()))
    assert len(table) == 2
    assert table.identify(f"Bearer {old}") == table.identify(f"Bearer {new}") == Identified("search")
    assert new not in out.read_text() and old not in out.read_text()


def test_add_key_reads_base64_data_and_labels_the_secret():
    _, first = new_record()
    manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "k"},
                "data": {"keys": base64.b64encode(first.encode()).decode()}}
    _, second = new_record()
    out = add_record(manifest, second, None, source="k.yaml")
    assert "data" not in out and out["stringData"]["keys"] == first + second
    assert out["metadata"]["labels"][KEYS_SECRET_LABEL] == "true"


@pytest.mark.parametrize("manifest, fragment", [
    ({"kind": "ConfigMap"}, "is not a Secret manifest"),
    ({"kind": "Secret", "stringData": {"a": "", "b": ""}}, "name the one holding the records with --key"),
    ({"kind": "Secret", "metadata": {"name": "k"}, "stringData": {"keys": "gfk_pasted-by-mistake\n"}},
     "line 1 of k.yaml, key keys is not a key record"),
])
def test_add_key_refuses_what_it_cannot_add_to_naming_the_fix(manifest, fragment):
    with pytest.raises(Exception) as e:
        add_record(manifest, new_record()[1], None, source="k.yaml")
    assert fragment in str(e.value.message)
    assert "pasted-by-mistake" not in str(e.value.message)
