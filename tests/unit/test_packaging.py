"""The runtime images carry only what they run: no plotting or certificate
libraries in the operator, no operator or development code in the engine."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV_ONLY = ("cryptography", "matplotlib")


def run_without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing any of ``blocked`` fails."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT)


def test_runtime_dependencies_leave_development_libraries_to_the_dev_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    assert not [lib for lib in DEV_ONLY if lib in runtime]
    assert {lib for lib in DEV_ONLY if any(d.startswith(lib) for d in project["optional-dependencies"]["dev"])} \
        == set(DEV_ONLY)


def test_the_operator_runs_without_development_libraries():
    done = run_without(DEV_ONLY, (
        "import gpufleet.handlers, gpufleet.runtime, gpufleet.fleet, gpufleet.fleet.audit_command\n"
        "from gpufleet.cli import main\n"
        "main(['run', '--help'], standalone_mode=False)\n"))
    assert done.returncode == 0, done.stderr
    assert "Run the operator." in done.stdout


def test_development_commands_say_which_extra_they_need():
    done = run_without(DEV_ONLY, "from gpufleet.cli import main\nmain(['dev', 'up'])\n")
    assert done.returncode == 1
    assert "pip install 'gpufleet[dev]'" in done.stderr and "cryptography" in done.stderr


def test_the_guard_runs_without_the_operator_or_development_code():
    # The engine image copies gpufleet_engine alone (engine_image/Dockerfile).
    done = run_without(("gpufleet", "gpufleet_dev", *DEV_ONLY), (
        "import gpufleet_engine.serving.server, gpufleet_engine.runtime.entrypoint\n"
        "from gpufleet_engine.cli import engine\n"
        "engine(['serve', '--help'], standalone_mode=False)\n"))
    assert done.returncode == 0, done.stderr
