#!/usr/bin/env python3
"""Copy the generated CRD, the rules file and the dashboards into the chart.
`--check` fails when the chart's copies drift (the tests run it)."""
import filecmp
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "gpufleet"
PAIRS = [(ROOT / "crds" / crd, CHART / "crds" / crd)
         for crd in ("inferenceservices.serving.gpufleet.dev.yaml", "inferenceadapters.serving.gpufleet.dev.yaml",
                     "inferencetenants.serving.gpufleet.dev.yaml")]
PAIRS += [(ROOT / "rules" / "gpufleet.rules.yaml", CHART / "files" / "gpufleet.rules.yaml")]
PAIRS += [(p, CHART / "files" / "dashboards" / p.name) for p in sorted((ROOT / "dashboards").glob("*.json"))]


def main() -> int:
    check = "--check" in sys.argv
    stale = [dst for src, dst in PAIRS if not dst.exists() or not filecmp.cmp(src, dst, shallow=False)]
    if check:
        for dst in stale:
            print(f"stale: {dst.relative_to(ROOT)} (run scripts/sync_chart.py)")
        return 1 if stale else 0
    for src, dst in PAIRS:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
