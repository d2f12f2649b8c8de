"""Whether a fetched folder is a LoRA adapter this replica can serve, before vLLM is asked to load it.

vLLM's own answer to a bad adapter is a 400 with a stack-trace-like message, or worse, a
model whose layers it does not recognise loaded without a word. The guard reads the PEFT files
itself and names the problem with one of the contract's reasons (contract/adapters.py
FAILURE_REASONS). Reads two small files; no network.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpufleet_engine.errors import GuardError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterProblem(GuardError):
    """An adapter this replica cannot serve: ``reason`` is one of FAILURE_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class CheckedAdapter:
    path: Path
    rank: int
    base_model: str | None   # adapter_config.json's base_model_name_or_path


def check(path: Path, *, max_rank: int, served_model: str, base_model: str | None = None) -> CheckedAdapter:
    """The adapter in ``path``, or AdapterProblem: MissingFiles, RankTooHigh, WrongBaseModel.

    ``served_model``: the base model this replica serves (engine.model, the path or Hub id vLLM
    loaded); ``base_model``: what the adapter's declaration says it was trained on."""
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterProblem("MissingFiles", f"{path} is not a folder")
    missing = [name for name in (CONFIG_FILE,) if not (path / name).is_file()]
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        raise AdapterProblem("MissingFiles", f"{path} has no {', no '.join(missing)}: not a PEFT LoRA adapter")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterProblem("MissingFiles", f"{config_path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterProblem("MissingFiles", f"{config_path} is not a JSON object")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterProblem("MissingFiles", f"{config_path} has no LoRA rank (r): {rank!r}")
    if rank > max_rank:
        raise AdapterProblem("RankTooHigh", f"the adapter's rank is {rank}, above this service's maximum "
                                            f"of {max_rank} (spec.engine.lora.maxRank)")
    declared = config.get("base_model_name_or_path")
    declared = declared if isinstance(declared, str) and declared else None
    for source, named in (("spec.baseModel", base_model), (f"{CONFIG_FILE} base_model_name_or_path", declared)):
        if named and not same_model(named, served_model):
            raise AdapterProblem("WrongBaseModel", f"the adapter was made for {named!r} ({source}), but this "
                                                   f"service serves {served_model!r}")
    return CheckedAdapter(path, rank, declared)


def same_model(a: str, b: str) -> bool:
    """Whether two names may be the same model. Lenient: only names that clearly differ are
    different. A Hub id compares by its name without the organisation, case, dashes and dots
    (``meta-llama/Meta-Llama-3.1-8B`` and ``Llama-3.1-8B`` may be one model: one contains the
    other; ``Llama-3.1-8B`` and ``Llama-3.1-70B`` are not). A Hub cache folder
    (``.../models--org--name/snapshots/<commit>``) is its Hub id; any other local folder says
    nothing of the model in it, so it matches all."""
    ka, kb = _model_key(a), _model_key(b)
    if a.strip().rstrip("/") == b.strip().rstrip("/") or not ka or not kb:
        return True
    return ka in kb or kb in ka


def _model_key(name: str) -> str:
    """The model's name, normalised; "" when the name says nothing of the model."""
    parts = [p for p in PurePosixPath(name.strip().rstrip("/")).parts if p not in ("/", ".", "..")]
    hub = next((p for p in parts if p.startswith("models--")), None)
    if hub is not None:
        return _normal(hub.split("--")[-1])
    if name.startswith(("/", ".", "~")) or len(parts) > 2 or not parts:
        return ""  # a local folder
    return _normal(parts[-1])


def _normal(text: str) -> str:
    return "".join(c for c in text.lower() if c.isalnum())
