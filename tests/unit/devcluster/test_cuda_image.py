"""The production image built here (engine_image/Dockerfile.cuda): the official image's layout,
a fully pinned hash-checked set, and a build that happens only when asked for."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpufleet_dev.devcluster import images, prune
from gpufleet_dev.devcluster.wheelhouses import wheelhouse_requirements

REPO = Path(__file__).resolve().parents[3]
IMAGE_DIR = REPO / "engine_image"


def _lines(dockerfile: str, instruction: str) -> list[str]:
    return re.findall(rf"^{instruction} (.+)$", (IMAGE_DIR / dockerfile).read_text(), re.M)


def test_the_cuda_image_lays_out_the_guard_as_the_official_image_does():
    official = [c for c in _lines("Dockerfile", "COPY")]
    assert set(official) <= set(_lines("Dockerfile.cuda", "COPY"))
    for instruction in ("ENTRYPOINT", "CMD", "EXPOSE"):
        assert _lines("Dockerfile", instruction) == _lines("Dockerfile.cuda", instruction)
    text = (IMAGE_DIR / "Dockerfile.cuda").read_text()
    assert "gpufleet:x:65532:65532" in text and "vllm_check/check.py" in text


@pytest.mark.parametrize("image", [images.ENGINE_CUDA, images.ENGINE_CPU, images.OPERATOR], ids=lambda i: i.name)
def test_everything_an_image_copies_is_an_input_of_its_content_hash(image):
    """A file the build copies but the hash leaves out: editing it would not rebuild the image."""
    inputs = [Path(i) for i in image.inputs]
    dockerfile = REPO / image.dockerfile
    copies = re.findall(r"^COPY (.+)$", dockerfile.read_text(), re.M)
    assert copies
    for line in copies:
        for source in line.split()[:-1]:
            path = Path(os.path.normpath(Path(image.context) / source))
            # A folder copied whole may be an input only in the part .dockerignore sends (operator/gpufleet).
            assert any(path == i or i in path.parents or path in i.parents for i in inputs), \
                f"{image.dockerfile} copies {source}, which no input of the image's hash covers"
            assert (REPO / path).exists(), f"{image.dockerfile} copies {source}, which does not exist"


def test_every_package_of_the_cuda_set_is_pinned_with_its_hash():
    reqs = wheelhouse_requirements("engine-cuda")
    assert len(reqs) > 100
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+ --hash=sha256:[0-9a-f]{64}", r) for r in reqs), reqs[:3]
    names = {r.split("==")[0] for r in reqs}
    assert {"vllm", "torch", "aiohttp", "click", "prometheus-client"} <= names
    assert any(n.startswith("nvidia-") for n in names)


def test_the_cuda_image_is_built_only_on_request_and_never_archived_for_the_node():
    assert images.ENGINE_CUDA not in images.IMAGES and images.ENGINE_CUDA in images.ON_REQUEST
    assert not images.ENGINE_CUDA.archived
    assert images.archive_path(images.ENGINE_CUDA, "0123456789ab").name == "engine-cuda-0123456789ab.json"
    # Its own base (a compiler for Triton), so the CPU image's base and hash do not move.
    assert set(images.BASE_PACKAGES) < set(images.ENGINE_CUDA.base_packages)
    assert images.ENGINE_CPU.base_packages == images.BASE_PACKAGES
    assert images.base_hash(images.CUDA_BASE_PACKAGES) != images.base_hash()


def test_an_older_stamp_of_an_image_kept_in_dockerd_is_pruned():
    names = ["engine-cuda-0123456789ab.json", "engine-cuda-aaaaaaaaaaaa.json", "images.json"]
    assert prune.stale_cache_files(names, ["engine-cuda"], {"engine-cuda-0123456789ab.json"}) == [
        "engine-cuda-aaaaaaaaaaaa.json"]


def test_a_cached_cuda_build_leaves_every_other_cache_entry_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_CACHE", str(tmp_path))
    root = images.images_dir()
    root.mkdir(parents=True)
    current = images.archive_path(images.ENGINE_CUDA, images.image_hash(images.ENGINE_CUDA))
    others = ["engine-cpu-0123456789ab.tar", "operator-0123456789ab.tar", "images.json",
              f"base-{images.base_hash()}.rootfs.tar", "base-000000000000.rootfs.tar"]
    for name in [current.name, "engine-cuda-aaaaaaaaaaaa.json", *others]:
        (root / name).write_text("x")
    built = images.build_all(progress=lambda _msg: None, only="engine-cuda")
    assert built == {"engine-cuda": {"ref": f"{images.ENGINE_CUDA.repository()}:{current.stem.rsplit('-', 1)[1]}",
                                     "archive": str(current), "cached": True}}
    assert sorted(p.name for p in root.iterdir()) == sorted([current.name, *others])
