"""promtool for the observability tests: its absence is a failure, unless
GPUFLEET_ALLOW_MISSING_TOOLS=1 turns it into a skip."""
from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path:
        return path
    message = "promtool is not installed: run scripts/install-prometheus.sh"
    if os.environ.get("GPUFLEET_ALLOW_MISSING_TOOLS") == "1":
        pytest.skip(message)
    pytest.fail(message)
