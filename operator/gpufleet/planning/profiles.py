"""GPU and model profiles: the hardware and architecture numbers the sizing uses.

Built-ins cover common cases; a YAML file adds or overrides profiles::

    gpus:
      MI300X:
        memoryGiB: 192
        hbmBandwidthGBps: 5300
        denseTFLOPS: 1307
    models:
      Qwen2.5-7B:
        params: 7.62e9
        layers: 28
        kvHeads: 4
        headDim: 128
        bytesPerParam: 2          # optional, default 2 (bf16)
        kvBytesPerElement: 2      # optional, default 2 (bf16 KV cache)
        maxContextTokens: 32768   # optional
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import yaml

from .errors import ProfileError

MIB = 1 << 20
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    dense_flops: float          # dense bf16/fp16 tensor FLOP/s (no sparsity)
    source: str
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    name: str
    params: int
    layers: int
    kv_heads: int
    head_dim: int
    source: str
    bytes_per_param: float = 2.0
    kv_bytes_per_element: float = 2.0
    max_context_tokens: int | None = None

    @property
    def weights_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        # A K and a V vector per layer per KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element



# Memory as nvidia-smi reports it (what vLLM's utilization share applies to);
# bandwidth and dense bf16 FLOP/s from NVIDIA's datasheets.
BUILTIN_GPUS: tuple[GpuProfile, ...] = (
    GpuProfile("H100-80GB", 81559 * MIB, 3.35e12, 989e12, "built-in: H100 SXM5 datasheet",
               ("NVIDIA-H100-80GB-HBM3", "H100", "H100-SXM", "H100-SXM5-80GB")),
    GpuProfile("H200", 143771 * MIB, 4.8e12, 989e12, "built-in: H200 SXM datasheet",
               ("NVIDIA-H200", "H200-141GB")),
    GpuProfile("A100-80GB", 81920 * MIB, 2.039e12, 312e12, "built-in: A100 SXM4 80GB datasheet",
               ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB", "A100")),
    GpuProfile("L4", 23034 * MIB, 300e9, 121e12, "built-in: L4 datasheet", ("NVIDIA-L4",)),
)

_CONFIG = "built-in: Hugging Face config.json"

BUILTIN_MODELS: tuple[ModelProfile, ...] = (
    ModelProfile("Llama-3.1-8B", 8_030_261_248, 32, 8, 128, _CONFIG, max_context_tokens=131072),
    ModelProfile("Llama-3.1-70B", 70_553_706_496, 80, 8, 128, _CONFIG, max_context_tokens=131072),
    ModelProfile("Mistral-7B", 7_241_732_096, 32, 8, 128, _CONFIG, max_context_tokens=32768),
    ModelProfile("SmolLM2-135M", 134_515_008, 30, 3, 64, _CONFIG, max_context_tokens=8192),
)


@dataclasses.dataclass(frozen=True)
class ProfileSet:
    gpus: tuple[GpuProfile, ...] = BUILTIN_GPUS
    models: tuple[ModelProfile, ...] = BUILTIN_MODELS

    def gpu(self, name: str) -> GpuProfile:
        return _find(name, self.gpus, "GPU", "--gpu")

    def model(self, name: str) -> ModelProfile:
        return _find(name, self.models, "model", "--model")


def _key(name: str) -> str:
    return name.strip().lower()


def _model_key(name: str) -> str:
    # "meta-llama/Llama-3.1-8B-Instruct" has the architecture of "Llama-3.1-8B".
    base = _key(name).rsplit("/", 1)[-1]
    return base.split("-instruct", 1)[0]


def _find(name: str, profiles, kind: str, flag: str):
    wanted = _key(name)
    # Later entries (from a profile file) override built-ins of the same name.
    for p in reversed(profiles):
        if wanted == _key(p.name) or wanted in (_key(a) for a in getattr(p, "aliases", ())):
            return p
    if kind == "model":
        for p in reversed(profiles):
            if _model_key(name) == _model_key(p.name):
                return p
    known = ", ".join(p.name for p in profiles)
    raise ProfileError(f"unknown {kind} {name!r}; pass {flag} with one of: {known} "
                       "(or describe it in a file given with --profile-file)")


def load_profile_file(text: str, *, name: str, base: ProfileSet | None = None) -> ProfileSet:
    """Profiles from YAML text, added after (and so overriding) ``base``."""
    base = base or ProfileSet()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProfileError(f"{name}: not valid YAML: {e}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict) or set(doc) - {"gpus", "models"}:
        raise ProfileError(f"{name}: expected a mapping with keys gpus and/or models, each a mapping "
                           "of profile name to fields (see docs/planning.md)")
    gpus = tuple(_gpu_from(n, f, name) for n, f in _entries(doc, "gpus", name))
    models = tuple(_model_from(n, f, name) for n, f in _entries(doc, "models", name))
    return ProfileSet(gpus=base.gpus + gpus, models=base.models + models)


def _entries(doc: dict, section: str, file: str):
    entries = doc.get(section) or {}
    if not isinstance(entries, dict):
        raise ProfileError(f"{file}: {section} must be a mapping of profile name to fields")
    for profile_name, fields in entries.items():
        if not isinstance(fields, dict):
            raise ProfileError(f"{file}: {section}.{profile_name} must be a mapping of fields")
        yield str(profile_name), fields


class _Fields:
    """Reads typed fields of one profile entry, naming the entry and field in errors."""

    def __init__(self, fields: Mapping[str, Any], where: str, allowed: set[str]):
        unknown = set(fields) - allowed
        if unknown:
            raise ProfileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                               f"allowed: {', '.join(sorted(allowed))}")
        self.fields = fields
        self.where = where

    def number(self, key: str, default: float | None = None, *, integer: bool = False) -> float:
        value = self.optional(key, integer=integer)
        if value is not None:
            return value
        if default is None:
            raise ProfileError(f"{self.where}: missing field {key}; add it (a positive number)")
        return default

    def whole(self, key: str) -> int:
        return int(self.number(key, integer=True))

    def optional(self, key: str, *, integer: bool = False) -> float | None:
        value = self.fields.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            # PyYAML reads 7.62e9 (no sign in the exponent) as a string.
            try:
                value = float(value)
            except ValueError:
                raise ProfileError(f"{self.where}.{key} is {value!r}; write a positive number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0:
            raise ProfileError(f"{self.where}.{key} is {value!r}; write a positive number")
        if integer and not float(value).is_integer():
            raise ProfileError(f"{self.where}.{key} is {value!r}; write a whole number")
        return int(value) if integer else float(value)


def _gpu_from(name: str, fields: Mapping[str, Any], file: str) -> GpuProfile:
    f = _Fields(fields, f"{file}: gpus.{name}", {"memoryGiB", "hbmBandwidthGBps", "denseTFLOPS"})
    return GpuProfile(name=name, memory_bytes=int(f.number("memoryGiB") * GIB),
                      hbm_bytes_per_s=f.number("hbmBandwidthGBps") * 1e9,
                      dense_flops=f.number("denseTFLOPS") * 1e12, source=f"profile file {file}")


def _model_from(name: str, fields: Mapping[str, Any], file: str) -> ModelProfile:
    f = _Fields(fields, f"{file}: models.{name}",
                {"params", "layers", "kvHeads", "headDim", "bytesPerParam", "kvBytesPerElement",
                 "maxContextTokens"})
    max_context = f.optional("maxContextTokens", integer=True)
    return ModelProfile(name=name, params=f.whole("params"), layers=f.whole("layers"), kv_heads=f.whole("kvHeads"),
                        head_dim=f.whole("headDim"), source=f"profile file {file}",
                        bytes_per_param=f.number("bytesPerParam", 2.0),
                        kv_bytes_per_element=f.number("kvBytesPerElement", 2.0),
                        max_context_tokens=int(max_context) if max_context is not None else None)
