"""The Gateway API Inference Extension's InferencePool CRD, as scripts/gie_crd.py puts it into the chart (fetched
through the Go module proxy when it is not there yet), for tests of what the operator renders and the chart installs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gie_crd  # noqa: E402


def crd_path() -> Path:
    if not gie_crd.TARGET.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "gie_crd.py")], check=True)
    return gie_crd.TARGET


def pool_schema() -> dict:
    """The v1 InferencePool's openAPIV3Schema."""
    crd = yaml.safe_load(crd_path().read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]
