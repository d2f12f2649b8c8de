"""bench/pd_disaggregation.py's pure parts: the trace every arm shares and the figures it reports. The
measurement itself needs engines and runs as a benchmark (docs/benchmarks.md), not as a test."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "pd_disaggregation.py"


def _load():
    spec = importlib.util.spec_from_file_location("pd_disaggregation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


pd = _load()


def test_the_trace_is_the_same_for_a_seed_and_mixes_both_kinds_in_order_of_arrival():
    one, again = pd.trace(3, 200, rate=2.0), pd.trace(3, 200, rate=2.0)
    assert one == again and one != pd.trace(4, 200, rate=2.0)
    kinds = [r.kind for r in one]
    assert 70 <= kinds.count("long-prompt") <= 130
    assert all(r.max_tokens == (8 if r.kind == "long-prompt" else 128) for r in one)
    assert all(a.at < b.at for a, b in zip(one, one[1:]))
    assert 60 < one[-1].at < 140     # 200 arrivals at 2/s
    assert len({r.prompt for r in one}) == 200   # no prompt repeats: no prefix cache helps


def test_goodput_counts_requests_within_both_objectives_and_errors_apart():
    R = pd.Result
    results = [R("long-prompt", ttft=0.2, gaps=[0.01] * 7, tokens=8),
               R("long-answer", ttft=0.1, gaps=[0.02] * 100 + [0.5] * 27, tokens=128),  # its ITL p99 is 500 ms
               R("long-prompt", ttft=2.0, gaps=[0.01] * 7, tokens=8),                   # TTFT over
               R("long-answer", error="429 busy")]
    s = pd.summary(results, wall=2.0, ttft_slo=1.0, itl_slo=0.1)
    assert (s["ok"], s["errors"], s["good"], s["goodput_rps"]) == (3, 1, 1, 0.5)
    assert s["itl_long_answer_p99_ms"] == 500.0 and s["ttft_p50_ms"] == 200.0
