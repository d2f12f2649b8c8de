"""Real PEFT LoRA adapters for the tiny model, made in the test set-up.

Each adapter is what a team would ship: ``peft`` wraps the tiny Llama with a
``LoraConfig`` and ``save_pretrained`` writes ``adapter_config.json`` and
``adapter_model.safetensors``. The weights are random but seeded (the seed
comes from the adapter's name), and scaled up so that greedy decoding through
the adapter visibly leaves the base model's path. Built once per (name, rank)
into the model cache and reused.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
SCALE = 4.0  # random LoRA weights at PEFT's init are too small to change a greedy answer


def adapter_root() -> Path:
    from gpufleet_engine.local.models import cache_root

    return cache_root() / "lora-adapters"


def make_adapter(name: str, *, rank: int = 8, base: Path | None = None, root: Path | None = None) -> Path:
    """The folder of a PEFT LoRA adapter ``name`` of ``rank`` for the tiny model (or ``base``)."""
    from gpufleet_engine.local.models import prepare

    base = base or prepare("tiny").path
    root = root or adapter_root()
    target = root / f"{name}-r{rank}-{_digest(str(base))}"
    if (target / "adapter_model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        _build(name, rank, base, tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def make_adapters(count: int, *, prefix: str = "lora", rank: int = 8) -> dict[str, Path]:
    return {f"{prefix}-{i}": make_adapter(f"{prefix}-{i}", rank=rank) for i in range(count)}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _build(name: str, rank: int, base: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(int(_digest(name), 16))
    model = AutoModelForCausalLM.from_pretrained(str(base))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES),
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.mul_(SCALE)
    peft_model.save_pretrained(str(out))
    for path in out.iterdir():
        path.chmod(0o644)
