"""GPU and model profiles: built-in numbers, lookup by the names users have at
hand, and profile files with errors that name the entry and the field."""
from __future__ import annotations

import pytest

from gpufleet.planning.errors import ProfileError
from gpufleet.planning.profiles import GIB, ProfileSet, load_profile_file


@pytest.mark.parametrize("name, kv_bytes_per_token, weights_gib", [
    ("Llama-3.1-8B", 2 * 32 * 8 * 128 * 2, 14.96),      # 128 KiB per token
    ("Llama-3.1-70B", 2 * 80 * 8 * 128 * 2, 131.42),    # 320 KiB per token
    ("Mistral-7B", 2 * 32 * 8 * 128 * 2, 13.49),
    ("SmolLM2-135M", 2 * 30 * 3 * 64 * 2, 0.25),
])
def test_builtin_models(name, kv_bytes_per_token, weights_gib):
    model = ProfileSet().model(name)
    assert model.kv_bytes_per_token == kv_bytes_per_token
    assert model.weights_bytes / GIB == pytest.approx(weights_gib, abs=0.01)


def test_gpu_found_by_node_label_and_case():
    profiles = ProfileSet()
    assert profiles.gpu("NVIDIA-H100-80GB-HBM3").name == "H100-80GB"
    assert profiles.gpu("a100-80gb").name == "A100-80GB"
    assert profiles.gpu("NVIDIA-L4").memory_bytes == 23034 * 2**20


def test_model_found_by_hugging_face_id():
    profiles = ProfileSet()
    assert profiles.model("meta-llama/Llama-3.1-8B-Instruct").name == "Llama-3.1-8B"
    assert profiles.model("mistralai/Mistral-7B-Instruct-v0.3").name == "Mistral-7B"
    assert profiles.model("HuggingFaceTB/SmolLM2-135M-Instruct").name == "SmolLM2-135M"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ProfileError, match=r"unknown GPU 'B200'; pass --gpu with one of: H100-80GB, .*--profile-file"):
        ProfileSet().gpu("B200")
    with pytest.raises(ProfileError, match=r"unknown model 'Qwen2.5-7B'.*Llama-3.1-8B"):
        ProfileSet().model("Qwen2.5-7B")


PROFILE_FILE = """
gpus:
  MI300X:
    memoryGiB: 192
    hbmBandwidthGBps: 5300
    denseTFLOPS: 1307
models:
  Qwen2.5-7B:
    params: 7.62e9          # PyYAML reads this as a string; it is still a number
    layers: 28
    kvHeads: 4
    headDim: 128
    maxContextTokens: 32768
  Llama-3.1-8B:             # overrides the built-in: an fp8 checkpoint
    params: 8030261248
    layers: 32
    kvHeads: 8
    headDim: 128
    bytesPerParam: 1
"""


def test_profile_file_adds_and_overrides():
    profiles = load_profile_file(PROFILE_FILE, name="fleet.yaml")
    gpu = profiles.gpu("mi300x")
    assert (gpu.memory_bytes, gpu.hbm_bytes_per_s, gpu.dense_flops) == (192 * GIB, 5.3e12, 1.307e15)
    assert gpu.source == "profile file fleet.yaml"
    qwen = profiles.model("Qwen/Qwen2.5-7B-Instruct")
    assert (qwen.params, qwen.kv_bytes_per_token, qwen.max_context_tokens) == (
        7_620_000_000, 2 * 28 * 4 * 128 * 2, 32768)
    assert profiles.model("Llama-3.1-8B").weights_bytes == 8030261248
    assert profiles.gpu("H100-80GB").name == "H100-80GB"       # built-ins remain


@pytest.mark.parametrize("text, message", [
    ("models:\n  X:\n    layers: 2\n    kvHeads: 1\n    headDim: 8\n",
     r"f.yaml: models.X: missing field params; add it"),
    ("models:\n  X:\n    params: 1e9\n    layers: two\n    kvHeads: 1\n    headDim: 8\n",
     r"f.yaml: models.X.layers is 'two'; write a positive number"),
    ("models:\n  X:\n    params: 1e9\n    layers: 2.5\n    kvHeads: 1\n    headDim: 8\n",
     r"models.X.layers is 2.5; write a whole number"),
    ("gpus:\n  G:\n    memoryGiB: 80\n    hbmBandwidth: 2000\n    denseTFLOPS: 100\n",
     r"gpus.G: unknown field\(s\) hbmBandwidth; allowed: denseTFLOPS, hbmBandwidthGBps, memoryGiB"),
    ("gpus: [1, 2]\n", r"gpus must be a mapping"),
    ("hardware: {}\n", r"expected a mapping with keys gpus and/or models"),
    ("gpus: {G: [\n", r"not valid YAML"),
])
def test_profile_file_errors_name_entry_and_field(text, message):
    with pytest.raises(ProfileError, match=message):
        load_profile_file(text, name="f.yaml")
