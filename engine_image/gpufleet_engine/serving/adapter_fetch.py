"""An adapter's files onto this replica: the guard's adapter agent calls ``fetch`` on a thread.

A ``path`` source (a mounted claim) is read in place. A ``uri`` is a tar archive (gzip or not)
of the adapter's folder, over http, https or from a file; it is extracted into
``<adapter dir>/<name>/`` only when every member is a plain file or folder inside that folder:
no absolute paths, no ``..``, no links or devices (an archive a user can point the guard at
must not write anywhere else in the pod). A ``huggingFace`` source is downloaded with
``huggingface_hub.snapshot_download`` at its revision into the same folder, in a child process that
may reach the Hub although the pod runs with ``HF_HUB_OFFLINE=1``. Each replaces what
a previous fetch of that name left, atomically: a half-fetched folder is never handed to vLLM.

Failures are ``AdapterProblem``: SourceUnreachable (network, HTTP, Hub; the agent retries
with backoff) or MissingFiles (nothing there, or not an archive it may extract).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Callable

from gpufleet_api.guard.adapters import AdapterSpec
from gpufleet_engine.serving.adapter_check import CONFIG_FILE, AdapterProblem

DOWNLOAD_TIMEOUT_SECONDS = 60.0
HUB_TIMEOUT_SECONDS = 600.0   # a large adapter from the Hub
UNREACHABLE, MISSING = "SourceUnreachable", "MissingFiles"

Download = Callable[..., str]  # huggingface_hub.snapshot_download's signature


def fetch(spec: AdapterSpec, adapter_dir: Path, *, download: Download | None = None) -> Path:
    """The folder holding ``spec``'s adapter on this replica, fetched if it must be."""
    source = spec.source
    if source.path is not None:
        path = Path(source.path)
        if not path.is_dir():
            raise AdapterProblem(MISSING, f"no folder at {source.path} (source.path)")
        return path
    target = adapter_dir / spec.name
    if source.uri is not None:
        return _into(target, lambda tmp: _fetch_archive(source.uri or "", tmp))
    if source.hugging_face is not None:
        hub = source.hugging_face
        return _into(target, lambda tmp: _fetch_hub(hub.name, hub.revision, tmp, download))
    raise AdapterProblem(MISSING, "the adapter has no source (huggingFace, path or uri)")


def _into(target: Path, fill: Callable[[Path], Path]) -> Path:
    """Fill a new folder beside ``target`` and put it in ``target``'s place; the adapter's folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        inner = fill(tmp)
        relative = inner.relative_to(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
        return target / relative
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove(spec: AdapterSpec, adapter_dir: Path) -> None:
    """Delete what ``fetch`` put on this replica for ``spec`` (a ``path`` source is not ours)."""
    if spec.source.path is None:
        shutil.rmtree(adapter_dir / spec.name, ignore_errors=True)


def _fetch_archive(uri: str, into: Path) -> Path:
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme not in ("http", "https", "file"):
        raise AdapterProblem(MISSING, f"source.uri {uri!r}: only http, https and file URLs of a tar archive "
                                      f"are fetched")
    archive = into / ".archive"
    try:
        with urllib.request.urlopen(uri, timeout=DOWNLOAD_TIMEOUT_SECONDS) as resp, archive.open("wb") as out:
            shutil.copyfileobj(resp, out, 1 << 20)
    except urllib.error.HTTPError as e:
        raise AdapterProblem(UNREACHABLE, f"{uri} answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        if scheme == "file" and not Path(urllib.parse.urlsplit(uri).path).exists():
            raise AdapterProblem(MISSING, f"no file at {uri}") from None
        raise AdapterProblem(UNREACHABLE, f"cannot read {uri}: {getattr(e, 'reason', e)}") from None
    folder = into / "adapter"
    extract(archive, folder)
    archive.unlink()
    return adapter_root(folder)


def extract(archive: Path, folder: Path) -> None:
    """Extract a tar archive into ``folder``: every member a plain file or folder inside it, else
    MissingFiles naming the first one that is not (nothing is extracted then)."""
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                name = PurePosixPath(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise AdapterProblem(MISSING, f"the archive's member {member.name!r} points outside its "
                                                  f"folder; refused")
                if not (member.isfile() or member.isdir()):
                    raise AdapterProblem(MISSING, f"the archive's member {member.name!r} is a link or a device; "
                                                  f"an adapter's archive holds plain files only")
            folder.mkdir(parents=True)
            if hasattr(tarfile, "data_filter"):
                # The "data" filter refuses anything the checks above missed (and drops modes like setuid).
                tar.extractall(folder, members=members, filter="data")
            else:  # Python before 3.11.4 (Debian bookworm's 3.11.2, the engine image's): the checks above, and
                for member in members:  # no mode bits beyond the owner's and read for others
                    member.mode &= 0o755
                tar.extractall(folder, members=members)  # noqa: S202 (members checked above)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise AdapterProblem(MISSING, f"not a tar archive the guard can extract: {e}") from None


def adapter_root(folder: Path) -> Path:
    """Where the adapter's files are: ``folder``, or its one sub-folder holding adapter_config.json
    (an archive made with ``tar -C parent adapter/``)."""
    if (folder / CONFIG_FILE).exists():
        return folder
    subfolders = [p for p in folder.iterdir() if p.is_dir()]
    if len(subfolders) == 1 and (subfolders[0] / CONFIG_FILE).exists():
        return subfolders[0]
    return folder  # the check names what is missing


def _fetch_hub(repo: str, revision: str | None, into: Path, download: Download | None) -> Path:
    folder = into / "adapter"
    try:
        (download or _download_online)(repo_id=repo, revision=revision, local_dir=str(folder))
    except Exception as e:  # the Hub's errors (not found, gated, network) all mean: not fetched
        raise AdapterProblem(UNREACHABLE, f"cannot download {repo}"
                                          f"{'@' + revision if revision else ''} from the Hub: "
                                          f"{type(e).__name__}: {e}") from None
    return folder


def _download_online(*, repo_id: str, revision: str | None, local_dir: str) -> str:
    """huggingface_hub's snapshot_download in a child process with HF_HUB_OFFLINE=0: the pod runs with
    HF_HUB_OFFLINE=1 (vLLM and the guard read the base model from what model-fetch cached, and
    huggingface_hub reads the switch once, at import), while an adapter is downloaded on purpose, at
    run time. HF_ENDPOINT and HF_TOKEN pass through (a mirror, a private adapter)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}
    code = ("import sys; from huggingface_hub import snapshot_download; "
            "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3])")
    done = subprocess.run([sys.executable, "-c", code, repo_id, revision or "", local_dir], env=env,
                          capture_output=True, text=True, timeout=HUB_TIMEOUT_SECONDS)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(last[-500:])
    return local_dir
