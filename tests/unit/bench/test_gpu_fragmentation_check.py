"""bench/gpu_fragmentation.py, the GPU check, where no GPU is: its pure parts, its refusal without CUDA,
and every phase's code run once against a small simulated caching allocator (``FakeTorch``) so that a
machine lent a GPU does not find a typo. The simulation is not a measurement: the figures come only
from a CUDA device (docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_fragmentation.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_fragmentation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gf = _load()
MIB = 1 << 20


class FakeOOM(RuntimeError):
    pass


class FakeTorch:
    """Enough of torch.cuda for the script: a budget, 512-byte rounding, 2 MiB segments, no reuse model."""

    uint8 = "uint8"
    __version__ = "0.0-fake"

    def __init__(self, total: int = 8 << 30):
        self.total = total
        self.fraction = 1.0
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.retries = 0
        self.live = 0
        self.version = types.SimpleNamespace(cuda="12.8")
        cuda = types.SimpleNamespace()
        cuda.OutOfMemoryError = FakeOOM
        cuda.is_available = lambda: True
        cuda.is_initialized = lambda: True
        cuda.device_count = lambda: 1
        cuda.set_device = lambda d: None
        cuda.synchronize = lambda d=None: None
        cuda.get_device_name = lambda d: "Fake GPU"
        cuda.get_device_properties = lambda d: types.SimpleNamespace(name="Fake GPU", uuid="GPU-fake")
        cuda.set_per_process_memory_fraction = self._set_fraction
        cuda.mem_get_info = lambda d=None: (self.total - self.reserved, self.total)
        cuda.memory_reserved = lambda d=None: self.reserved
        cuda.memory_stats = self._stats
        self.cuda = cuda

    def _set_fraction(self, fraction: float, device: int) -> None:
        self.fraction = fraction

    def _stats(self, device: int = 0) -> dict:
        return {"reserved_bytes.all.current": self.reserved, "reserved_bytes.all.peak": self.peak,
                "allocated_bytes.all.current": self.allocated, "active_bytes.all.current": self.allocated,
                "inactive_split_bytes.all.current": (self.reserved - self.allocated) // 2,
                "num_alloc_retries": self.retries, "num_ooms": 0}

    def empty(self, n: int, dtype: str, device: int) -> object:
        size = gf.rounded(n)
        segment = -(-size // (2 * MIB)) * 2 * MIB
        if self.reserved + segment > self.total * self.fraction:
            self.retries += 1
            raise FakeOOM("budget")
        self.allocated += size
        self.reserved += segment
        self.peak = max(self.peak, self.reserved)
        fake = self

        class Tensor:
            def __del__(self):
                fake.allocated -= size
                fake.reserved -= segment
        return Tensor()


def _args(**over) -> argparse.Namespace:
    args = gf.parser().parse_args(["--steps", "300", "--sample-every", "50", "--sample-repeats", "3",
                                   "--big-mib", "64", "--swiss-gib", "0.25"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_sizes_round_as_the_caching_allocator_books_them():
    assert [gf.rounded(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]


@pytest.mark.parametrize("phase", ["sampling", "swiss-cheese", "engine"])
def test_every_phase_runs_against_a_simulated_allocator(phase, tmp_path):
    torch = FakeTorch()
    run = {"sampling": gf.phase_sampling, "swiss-cheese": gf.phase_swiss_cheese, "engine": gf.phase_engine}[phase]
    result = run(torch, 0, _args(record=str(tmp_path)))
    if phase == "sampling":
        # The plugin reads what the allocator booked, byte for byte, and the device's free memory with it.
        assert result["allocatedMismatchBytes"] == 0 and result["reservedMismatchBytes"] == 0
        assert result["freeVsReservedBytes"] == 0 and result["sampleMicros"] > 0
    elif phase == "swiss-cheese":
        assert result["blocks"] > 10 and result["freedBytes"] > 0 and 0 <= result["reusedShare"] <= 1
    else:
        assert result["steps"] > 0 and 0 <= result["fragmentationMean"] <= 1 and result["series"]
        assert (tmp_path / "default.json").exists()


def _results(**engine_e) -> dict:
    sampling = {"allocatedMismatchBytes": 0, "reservedMismatchBytes": 0, "freeVsReservedBytes": 2 * MIB,
                "sampleMicros": 40.0}
    swiss = {"default": {"fragmentationAfterFree": 0.5, "reusedShare": 0.0, "allocRetries": 3, "ooms": 1},
             "expandable": {"fragmentationAfterFree": 0.3, "reusedShare": 1.0, "allocRetries": 1, "ooms": 0}}
    engine = {"default": {"fragmentationMean": 0.2, "fragmentationMax": 0.4, "allocRetries": 5, "ooms": 0,
                          "steps": 3000},
              "expandable": {"fragmentationMean": 0.05, "fragmentationMax": 0.1, "allocRetries": 0, "ooms": 0,
                             "steps": 3000, **engine_e}}
    return {m: {"sampling": dict(sampling), "swiss-cheese": swiss[m], "engine": engine[m]} for m in gf.MODES}


def test_the_verdict_passes_only_when_the_readings_match_and_expandable_helps():
    assert gf.verdict(_results())[0]
    assert not gf.verdict(_results(fragmentationMean=0.3))[0]
    broken = _results()
    broken["expandable"]["sampling"]["allocatedMismatchBytes"] = 512
    ok, lines = gf.verdict(broken)
    assert not ok and "MISMATCH" in lines[1]


def test_without_cuda_it_says_so_and_exits_2_without_importing_vllm():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stderr
    guard = gf.NoVllm()
    with pytest.raises(ImportError, match="must not import vLLM"):
        guard.find_spec("vllm.engine")
    assert guard.find_spec("torch") is None
