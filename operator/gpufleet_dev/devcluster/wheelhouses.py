"""The wheelhouses the image builds install from: each a folder of wheels for one pinned
requirement set, downloaded once on the host (cached outside the clone under a key of the set)
and served on 127.0.0.1 while the builds run (images.py), so a build downloads nothing.

Kinds: ``operator`` (pyproject.toml's build requirements and dependencies, resolved by pip),
``engine`` (requirements-cpu.txt, pinned in full, the CPU torch wheel from a local folder) and
``engine-cuda`` (requirements-cuda.txt: PyPI's CUDA vLLM with its torch and NVIDIA runtime
wheels, pinned in full with their hashes).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from .binaries import cache_root

Progress = Callable[[str], None]

REPO = Path(__file__).resolve().parents[3]


WHEELHOUSE_FILES = {"engine": "requirements-cpu.txt", "engine-cuda": "requirements-cuda.txt"}


def wheelhouse_requirements(kind: str) -> list[str]:
    """The pinned set a wheelhouse holds (its cache key)."""
    if kind in ("engine", "engine-cuda"):
        lines = (REPO / "engine_image" / WHEELHOUSE_FILES[kind]).read_text().splitlines()
        return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    import tomllib
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return sorted(pyproject["build-system"]["requires"]) + sorted(pyproject["project"]["dependencies"])


def wheelhouse_dir(kind: str) -> Path:
    key = hashlib.sha256("\n".join(wheelhouse_requirements(kind)).encode()).hexdigest()[:12]
    return cache_root() / "wheelhouse" / f"{kind}-{key}"


def torch_wheels() -> Path:
    return Path(os.environ.get("GPUFLEET_WHEELS", REPO.parent / "shared" / "wheels"))


def ensure_wheelhouse(kind: str, progress: Progress) -> Path:
    dest = wheelhouse_dir(kind)
    if (dest / ".complete").exists():
        return dest
    tmp = dest.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.monotonic()
    progress(f"downloading the {kind} image's wheelhouse (first time for this requirement set)")
    reqs = wheelhouse_requirements(kind)
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(tmp)]
    env = None
    if kind == "engine":
        # Pinned in full: no resolution, and the CPU torch wheel from the local folder.
        argv += ["--no-deps", "--find-links", str(torch_wheels()), *reqs]
    elif kind == "engine-cuda":
        # Wheels only, hash checked, from the index alone (the local CPU torch must not match).
        argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(tmp),
                "-r", str(REPO / "engine_image" / WHEELHOUSE_FILES[kind])]
        env = {**os.environ, "PIP_FIND_LINKS": ""}
    else:
        argv += reqs
    subprocess.run(argv, check=True, env=env)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    progress(f"wheelhouse {dest.name}: {len(list(dest.glob('*.whl')))} wheels, {size:.0f} MiB, "
             f"in {time.monotonic() - started:.0f}s")
    return dest


# The wheel server's address is part of every build's arguments (PIP_FIND_LINKS), and dockerd's
# layer cache keys a RUN step on its build arguments: a port that changed every run made each
# rebuild reinstall every wheel (278 s for the CPU engine image after a one-line guard edit). A
# fixed port keeps the install layers cached while the requirement set and base are unchanged. Below
# Linux's ephemeral range (32768-60999), so an outgoing connection's local port never holds it.
WHEEL_SERVER_PORT = 17815


def _bind(handler) -> http.server.ThreadingHTTPServer:
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_SERVER_PORT), handler)
    except OSError:  # taken (another build running?): any port; this build's install layers miss the cache
        return http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)


@contextlib.contextmanager
def serve_wheelhouses(dirs: dict[str, Path]) -> Iterator[dict[str, str]]:
    """Serve each wheelhouse at http://127.0.0.1:<port>/<kind>/ (pip's --find-links reads the listing)."""
    root = cache_root() / "wheelhouse"
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = _bind(handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        yield {kind: f"http://127.0.0.1:{port}/{d.name}/" for kind, d in dirs.items()}
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass
