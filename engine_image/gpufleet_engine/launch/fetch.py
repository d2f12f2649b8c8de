"""The weights in the Hugging Face cache before vLLM starts: the engine pod's ``model-fetch`` init container.

vLLM would download a Hub model itself, but then the pod reports only "not
ready" for the tens of minutes a 140 GB download takes, and vLLM needs the
cache writable. The init container downloads first (the pod shows
``Init:0/1`` and the InferenceService ``Ready=False, reason=DownloadingModel``),
then vLLM and the guard run with ``HF_HUB_OFFLINE=1`` on what it fetched, the
persistent cache (``spec.model.cache``) mounted read-only.

With a shared cache the first replica downloads and the others find every
file present: ``snapshot_download`` compares the cache with the Hub's listing
and fetches only what is missing (huggingface_hub locks each file while it
downloads it, so replicas starting together fetch it once). Only what vLLM
loads is fetched: the safetensors weights (``.bin`` only when there are
none), configs and tokenizer files, not the ``original/`` checkpoints that
double a Llama repository.
"""
from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from gpufleet_api.guard.guard_config import EngineConfig

log = logging.getLogger("gpufleet_engine.launch.fetch")

# What vLLM and the guard read besides the weights: configs, tokenizers, chat templates, remote code.
SUPPORT_FILES = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py")
IGNORED = ("original/*", "*.pth", "*.gguf", "*.msgpack", "*.h5", "*.onnx")


@dataclass(frozen=True)
class Fetched:
    repo: str
    revision: str | None
    path: str           # the snapshot folder vLLM loads
    files: int
    bytes: int
    seconds: float


def is_hub_model(model: str) -> bool:
    """A Hub id (``org/name``), not a folder in the image or on a volume."""
    return not model.startswith(("/", ".", "~"))


def patterns(files: Sequence[str]) -> tuple[list[str], list[str]]:
    """(allow, ignore) patterns for ``snapshot_download``: the weight format vLLM will load plus the
    support files."""
    kept = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in IGNORED)]
    if any(f.endswith(".safetensors") for f in kept):
        weights = ["*.safetensors"]
    elif any(f.endswith(".bin") for f in kept):
        weights = ["*.bin"]
    else:
        weights = ["*.pt"]
    return [*weights, *SUPPORT_FILES], list(IGNORED)


def _size(folder: str) -> tuple[int, int]:
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)  # the snapshot links resolve to the blobs


def fetch(engine: EngineConfig, *, list_files: Callable[[str, str | None], list[str]] | None = None,
          download: Callable[..., str] | None = None) -> Fetched | None:
    """Download what vLLM will load of ``engine.model`` at ``engine.revision`` into the cache
    (``HF_HOME``); None when the model is a local folder (nothing to download)."""
    if not is_hub_model(engine.model):
        log.info("%s is a local folder; nothing to download", engine.model)
        return None
    if list_files is None or download is None:
        from huggingface_hub import HfApi, snapshot_download  # in the engine image with vLLM

        list_files = list_files or (lambda repo, rev: HfApi().list_repo_files(repo, revision=rev))
        download = download or snapshot_download
    started = time.monotonic()
    allow, ignore = patterns(list_files(engine.model, engine.revision))
    log.info("downloading %s%s (%s) into the cache; files already there are kept", engine.model,
             f"@{engine.revision}" if engine.revision else "", ", ".join(allow))
    path = download(engine.model, revision=engine.revision, allow_patterns=allow, ignore_patterns=ignore)
    files, size = _size(path)
    took = time.monotonic() - started
    log.info("%s ready in %s: %d files, %.1f GB, %.0fs", engine.model, path, files, size / 1e9, took)
    return Fetched(engine.model, engine.revision, path, files, size, took)
