"""The engine image's Dockerfile: pinned base, real sources, the commands the operator's pod runs."""
from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from gpufleet.manifests import children
from gpufleet_api import parse_spec
from gpufleet_api.engine_release import DEFAULT_ENGINE_IMAGE
from gpufleet_engine.cli import engine

IMAGE_DIR = Path(__file__).resolve().parents[3] / "engine_image"
DOCKERFILE = (IMAGE_DIR / "Dockerfile").read_text()


def test_the_base_image_is_pinned_to_the_vllm_version_the_operator_names():
    version = re.search(r"^ARG VLLM_VERSION=(v\d+\.\d+\.\d+)$", DOCKERFILE, re.M).group(1)
    assert re.search(r"^FROM vllm/vllm-openai:\$\{VLLM_VERSION\}$", DOCKERFILE, re.M)
    assert DEFAULT_ENGINE_IMAGE.endswith(f"-vllm{version[1:]}")


def test_everything_the_dockerfile_copies_exists():
    # Built from the repository root (.dockerignore there sends what the Dockerfiles copy).
    for source in re.findall(r"^COPY (\S+) ", DOCKERFILE, re.M):
        assert (IMAGE_DIR.parent / source).exists(), source
    assert "exec python3 -m gpufleet_engine" in (IMAGE_DIR / "bin" / "gpufleet-engine").read_text()


def test_the_commands_of_the_operators_pod_exist_in_the_image_cli():
    pod = children.build_deployment(
        {"metadata": {"name": "chat", "namespace": "ml", "uid": "u"}, "apiVersion": "v", "kind": "k"},
        parse_spec({"model": {"name": "m"}}), 1, "hash")["spec"]["template"]["spec"]
    commands = [c["command"] for c in pod["containers"]]
    commands += [c["lifecycle"]["preStop"]["exec"]["command"] for c in pod["containers"]]
    for command in commands:
        assert command[0] == "gpufleet-engine"
        result = CliRunner().invoke(engine, [command[1], "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert "--config" in result.output


def test_the_model_preparation_the_image_copies_alone_imports_nothing_of_gpufleet():
    """Dockerfile.cpu copies local/models.py on its own (so editing the guard does not rebuild the models):
    an import of any gpufleet package there fails the image's build, not a test."""
    import ast
    source = IMAGE_DIR / "gpufleet_engine" / "local" / "models.py"
    assert f"COPY engine_image/{source.relative_to(IMAGE_DIR)} " in (IMAGE_DIR / "Dockerfile.cpu").read_text()
    tree = ast.parse(source.read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
        [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0]
    assert not [m for m in imported if m.split(".")[0].startswith("gpufleet")], imported
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
