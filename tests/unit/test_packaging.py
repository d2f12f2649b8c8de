"""The runtime images carry only what they run: no plotting or certificate
libraries in the operator, no operator or development code in the engine."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV_ONLY = ("cryptography", "matplotlib")
# The router's endpoint picker makes its self-signed TLS certificate at start (router/gpufleet_router/epp/tls.py,
# as GIE's picker does): a runtime dependency of the image the router shares with the operator, imported only
# there, so the operator process still runs without it (below).
RUNTIME_TOO = ("cryptography",)


def run_without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing any of ``blocked`` fails."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT)


def test_runtime_dependencies_leave_development_libraries_to_the_dev_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    assert not [lib for lib in DEV_ONLY if lib in runtime and lib not in RUNTIME_TOO]
    assert {lib for lib in DEV_ONLY if any(d.startswith(lib) for d in project["optional-dependencies"]["dev"])} \
        == set(DEV_ONLY)


def test_the_operator_runs_without_development_libraries():
    done = run_without(DEV_ONLY, (
        "import gpufleet.wiring.handlers, gpufleet.wiring.runtime, gpufleet.fleet, gpufleet.cli.audit\n"
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
    done = run_without(("gpufleet", "gpufleet_router", "gpufleet_dev", *DEV_ONLY), (
        "import gpufleet_engine.serving.server, gpufleet_engine.launch.entrypoint\n"
        "from gpufleet_engine.cli import engine\n"
        "engine(['serve', '--help'], standalone_mode=False)\n"))
    assert done.returncode == 0, done.stderr


def _copy_as_the_dockerfile_does(dockerfile: Path, dest: Path) -> None:
    """Copy what ``dockerfile``'s COPY lines copy (sources relative to the repository) into ``dest``,
    leaving out the plain paths the root .dockerignore excludes (as docker's build context does)."""
    import shutil
    excluded = {ROOT / line for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line and not line.startswith(("#", "!")) and "*" not in line}

    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if Path(folder, n) in excluded} | {n for n in names if n == "__pycache__"
                                                                    or n.endswith(".pyc")}
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, target = line.split()[1:]
        for src in sources:
            out = dest / (target.removeprefix("./") if not target.endswith("/") else target + Path(src).name)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, out, ignore=ignore)
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / src, out)


def test_the_operator_image_carries_the_api_kit_router_and_operator_and_runs_with_them(tmp_path):
    # What operator/Dockerfile copies is all the operator and the router may use: the API, the kit, the
    # router and the operator; none of the guard's code, no development tools (gpufleet_dev stays out
    # through .dockerignore).
    _copy_as_the_dockerfile_does(ROOT / "operator" / "Dockerfile", tmp_path)
    assert not (tmp_path / "engine_image").exists()
    assert not (tmp_path / "operator" / "gpufleet_dev").exists()
    roots = [str(tmp_path / d) for d in ("api", "kit", "router", "operator")]
    code = (
        "import sys\n"
        # Only the copied tree: not the checkout's editable install.
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path[:0] = {roots!r}\n"
        "sys.modules['gpufleet_dev'] = None\n"
        "sys.modules['gpufleet_engine'] = None\n"
        "import gpufleet.wiring.handlers, gpufleet.wiring.runtime, gpufleet.fleet, gpufleet.cli.audit\n"
        "import gpufleet_api, gpufleet_router.server\n"
        f"assert gpufleet_api.__file__.startswith({str(tmp_path)!r}), gpufleet_api.__file__\n"
        "from gpufleet.cli import main\n"
        "main(['run', '--help'], standalone_mode=False)\n"
        "main(['router', '--help'], standalone_mode=False)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Run the operator." in done.stdout
