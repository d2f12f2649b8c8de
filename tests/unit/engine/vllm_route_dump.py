"""Prints the routes the installed vLLM's API server registers, as JSON: [[path, [methods]], ...].

Run in a process of its own by test_route_table.py (importing vLLM takes seconds and sets up
logging and torch). The routes are those engine_image/vllm_check/check.py's ``app_routes`` builds
for the production build's check: every optional router switched on (all tasks, dev mode, runtime
LoRA, scale-out, profiling, the tokenizer info endpoint, fault tolerance, a model that pools and
scores), so the table is checked against everything vLLM can serve.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CHECK_DIR = Path(__file__).resolve().parents[3] / "engine_image" / "vllm_check"
sys.path.insert(0, str(CHECK_DIR))

import check  # noqa: E402 - engine_image/vllm_check/check.py, found through the path above

json.dump(sorted([p, sorted(m)] for p, m in check.app_routes().items()), sys.stdout)
