#!/usr/bin/env python3
"""Put the Gateway API Inference Extension's InferencePool CRD (GIE_VERSION in api/gpufleet_api/gateway_api.py)
into the chart, where gateway.crds=true installs it (charts/gpufleet/templates/gateway-crds.yaml).

The CRD is GIE's, not ours, so it is not kept in this repository: it is taken from GIE's Go module through the Go
module proxy with the ordinary client (`go mod download`, which checks the module against the checksum database),
and written to a git-ignored path of the chart. `make generate` runs this; so does any test that needs the file."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "api"))

from gpufleet_api import gateway_api as gie  # noqa: E402

MODULE = "sigs.k8s.io/gateway-api-inference-extension"
SOURCE = f"config/crd/bases/{gie.INFERENCE_POOL_GROUP}_{gie.INFERENCE_POOL_PLURAL}.yaml"
TARGET = ROOT / "charts" / "gpufleet" / "files" / "gateway-api-inference-extension" / f"{gie.INFERENCE_POOL_CRD}.yaml"


def module_dir() -> Path:
    """The module's files, downloaded (or found in the module cache) by `go mod download`."""
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"}
    out = subprocess.run(["go", "mod", "download", "-json", f"{MODULE}@{gie.GIE_VERSION}"], cwd="/",
                         env=env, check=True, capture_output=True, text=True).stdout
    return Path(json.loads(out)["Dir"])


def main() -> int:
    source = module_dir() / SOURCE
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, TARGET)
    TARGET.chmod(0o644)  # the module cache's files are read-only
    print(f"wrote {TARGET.relative_to(ROOT)} from {MODULE}@{gie.GIE_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
