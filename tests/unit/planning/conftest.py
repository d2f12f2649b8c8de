"""Synthetic profiles with round numbers and request-log builders, so that
every expected answer in these tests can be worked out by hand."""
from __future__ import annotations

import json

import pytest

from gpufleet.planning.profiles import GpuProfile, ModelProfile
from gpufleet.planning.sizing import Settings

T0 = 1_750_000_000.0  # an arbitrary epoch second


@pytest.fixture
def round_gpu() -> GpuProfile:
    # 100 GB, 1 TB/s, 1 PFLOP/s.
    return GpuProfile("Round-GPU", 100_000_000_000, 1e12, 1e15, "test profile")


@pytest.fixture
def round_model() -> ModelProfile:
    # 10 B params × 2 bytes = 20 GB of weights; KV 2 × 10 × 5 × 100 × 2 = 20,000 bytes per token.
    return ModelProfile("Round-10B", 10_000_000_000, layers=10, kv_heads=5, head_dim=100, source="test profile")


@pytest.fixture
def round_settings() -> Settings:
    """pool = 100 GB × 0.8 − 20 GB = 60 GB; usable after 25 % = 45 GB = 2,250,000 tokens.
    prefill = 1e15 × 0.5 ÷ (2 × 1e10) = 25,000 tok/s; decode bandwidth = 1e12 × 0.5 = 5e11 B/s."""
    return Settings(gpu_memory_utilization=0.8, kv_watermark_percent=25, ttft_p99_seconds=2.0,
                    itl_p99_seconds=0.1, max_num_seqs=250, max_concurrency=1000, mfu=0.5,
                    bandwidth_efficiency=0.5, tensor_parallel=1)


def _constant_load(rps: int, seconds: int, prompt: int, output: int, duration: float | None,
                   start: float = T0) -> list[dict]:
    rows = []
    for i in range(rps * seconds):
        row = {"timestamp": start + i / rps, "prompt_tokens": prompt, "output_tokens": output}
        if duration is not None:
            row["latency_seconds"] = duration
        rows.append(row)
    return rows


@pytest.fixture
def constant_load():
    """constant_load(rps, seconds, prompt, output, duration) → log rows with
    arrivals exactly 1/rps apart, all alike."""
    return _constant_load


@pytest.fixture
def as_lines():
    """Log rows → JSONL lines."""
    return lambda rows: [json.dumps(r) for r in rows]
