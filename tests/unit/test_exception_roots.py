"""One exception root per component (docs/operator-design.md): every exception class a component defines
derives from its root, so a caller can catch what a component raises on purpose in one clause, and the
component translates others' errors at its boundary."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from gpufleet.errors import OperatorError
from gpufleet_api.errors import ContractError
from gpufleet_engine.errors import GuardError
from gpufleet_kit.errors import KitError
from gpufleet_router.errors import RouterError

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = {  # package → (its folder, its root)
    "gpufleet_api": (ROOT / "api" / "gpufleet_api", ContractError),
    "gpufleet_kit": (ROOT / "kit" / "gpufleet_kit", KitError),
    "gpufleet_router": (ROOT / "router" / "gpufleet_router", RouterError),
    "gpufleet": (ROOT / "operator" / "gpufleet", OperatorError),
    "gpufleet_engine": (ROOT / "engine_image" / "gpufleet_engine", GuardError),
}
# Modules that must import nothing of their package, so their exceptions cannot derive from its root.
STANDALONE = {
    # Copied alone into the engine image's build to prepare the models (engine_image/Dockerfile.cpu).
    "gpufleet_engine.local.models",
}
EXCEPTION_BASES = {"Exception", "ValueError", "RuntimeError", "KeyError", "TypeError", "LookupError", "OSError"}


def exception_classes(package: str, folder: Path) -> list[tuple[str, str]]:
    """(module, class) of each class whose bases name a builtin exception, found without importing."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        module = ".".join((package, *path.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in EXCEPTION_BASES
                                                      for b in node.bases):
                found.append((module, node.name))
    return found


@pytest.mark.parametrize("package", sorted(COMPONENTS))
def test_every_exception_a_component_defines_derives_from_its_root(package):
    folder, root = COMPONENTS[package]
    classes = exception_classes(package, folder)
    assert classes, f"no exception classes found in {folder}"
    strays = [f"{module}.{name}" for module, name in classes if module not in STANDALONE
              and not issubclass(getattr(importlib.import_module(module), name), root)]
    assert not strays, (f"{strays} do not derive from {root.__module__}.{root.__name__}: add it to their bases "
                        f"(keep a builtin base such as ValueError beside it where callers catch that)")
