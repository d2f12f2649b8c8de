"""The demo's side-by-side table: each cell from its source (the clients' records, or the PromQL
query of vLLM's or the guard's series), a run without vLLM's series failing the report, the guard's
guarantees worded from the figures, and the chart of both runs."""
from __future__ import annotations

import pytest

from gpufleet_dev.demo import comparison_chart as chart
from gpufleet_dev.demo.comparison import (
    MissingSeries,
    RunWindow,
    engine_queries,
    guarantees,
    render_table,
    run_figures,
    table_rows,
)
from gpufleet_dev.demo.load import RequestResult
from gpufleet_dev.demo.report import render_comparison

SLO = 2.0
ALONE = RunWindow("vllm-alone", "vLLM alone", 1000.0, 1100.0, guarded=False)
FLEET = RunWindow("gpufleet", "gpufleet", 2000.0, 2100.0, guarded=True)


def served(t, ttft, refusals=0):
    return RequestResult(t, t + 5, "e", 200, ttft=ttft, tokens=64, refusals=refusals, attempts=refusals + 1)


ALONE_RESULTS = [served(0, 0.5), served(1, 3.0), served(2, 9.0),
                 RequestResult(3, 13, "e", 0, gave_up=True, patient=False, error="gave up"),
                 RequestResult(4, 94, "e", 200, ttft=40.0, tokens=10, timed_out=True, error="client timeout")]
FLEET_RESULTS = [served(0, 0.2), served(1, 0.4), served(2, 1.5, refusals=1), served(3, 2.5, refusals=2),
                 RequestResult(4, 7, "e", 429, retry_after="1", refusals=3, attempts=3),
                 RequestResult(5, 15, "e", 0, gave_up=True, refusals=1, patient=False, error="gave up")]


class FakePrometheus:
    """Answers the demo's queries from recorded figures, per run label and metric; remembers what
    was asked and when."""

    def __init__(self, figures: dict[tuple[str, str], float]):
        self.figures = figures
        self.asked: list[tuple[str, float]] = []

    def query(self, expr: str, at: float) -> list[dict]:
        self.asked.append((expr, at))
        for (run, name), value in self.figures.items():
            if f'run="{run}"' in expr and expr == engine_queries(ALONE if run == "vllm-alone" else FLEET)[name]:
                return [{"metric": {}, "value": [at, str(value)]}]
        return []


FIGURES = {("vllm-alone", "preemptions"): 37, ("vllm-alone", "kv_peak"): 1.0,
           ("vllm-alone", "replicas_min"): 1, ("vllm-alone", "replicas_max"): 1,
           ("gpufleet", "preemptions"): 0, ("gpufleet", "kv_peak"): 0.83,
           ("gpufleet", "replicas_min"): 1, ("gpufleet", "replicas_max"): 2, ("gpufleet", "guard_refusals"): 11}


def both(prom=None):
    prom = prom or FakePrometheus(FIGURES)
    return [run_figures(prom.query, ALONE, ALONE_RESULTS, SLO), run_figures(prom.query, FLEET, FLEET_RESULTS, SLO)]


def cells(runs) -> dict[str, tuple[list[str], str]]:
    return {label.strip(): (values, source) for label, values, source in table_rows(runs, SLO)}


def test_every_cell_comes_from_the_clients_records_or_its_prometheus_query():
    prom = FakePrometheus(FIGURES)
    c = cells(both(prom))
    # The clients' own records: counted per user request, whatever its retries.
    assert c["user requests"] == (["5", "6"], "clients' records")
    assert c["completed"][0] == ["3 (60%)", "4 (67%)"]
    assert c["completed with TTFT within the SLO (2000 ms)"][0] == ["1 (20%)", "3 (50%)"]
    assert c["refused with 429 + Retry-After (users)"][0] == ["0", "4"]
    assert c["of them, served on a later try"][0] == ["0", "2"]
    assert c["of them, never served"][0] == ["0", "2"]
    assert c["gave up waiting for a first token"][0] == ["1", "1"]
    assert c["failed or timed out"][0] == ["1", "0"]
    assert c["TTFT p50 of completions (from first ask)"][0] == ["3000 ms", "400 ms"]
    assert c["TTFT p99 of completions (from first ask)"][0] == ["9000 ms", "2500 ms"]
    # Tokens of completed streams only (not the timed-out one's 10), over each run's 100 s.
    assert c["output tokens/s of completed streams"][0] == ["2", "3"]
    # vLLM's and the guard's counters, through Prometheus.
    assert c["vLLM preemptions"] == (["37", "0"], "Prometheus: vllm:num_preemptions_total")
    assert c["vLLM KV usage peak"] == (["100%", "83%"], "Prometheus: vllm:kv_cache_usage_perc")
    assert c["guard refusals (its counter)"] == (["- (no guard)", "11"], "Prometheus: gpufleet_guard_rejections_total")
    assert c["replicas serving (min-max)"][0] == ["1", "1-2"]
    # Each query at its own run's end, over its own run's window and series.
    assert {at for expr, at in prom.asked if 'run="vllm-alone"' in expr} == {1100.0}
    assert {at for expr, at in prom.asked if 'run="gpufleet"' in expr} == {2100.0}
    assert all("[100s" in expr for expr, _ in prom.asked)
    assert not any("gpufleet_guard" in expr for expr, _ in prom.asked if 'run="vllm-alone"' in expr)


def test_the_counter_queries_take_the_rise_within_the_run_per_series():
    q = engine_queries(FLEET)
    vllm = 'vllm:num_preemptions_total{run="gpufleet",endpoint="vllm"}'
    assert q["preemptions"] == f"sum(max_over_time({vllm}[100s]) - min_over_time({vllm}[100s]))"
    assert q["kv_peak"] == ('max(max_over_time({__name__=~"vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc",'
                            'run="gpufleet",endpoint="vllm"}[100s]))')
    assert 'gpufleet_guard_rejections_total{run="gpufleet",endpoint="http"}' in q["guard_refusals"]


@pytest.mark.parametrize("missing", ["preemptions", "kv_peak", "replicas_max"])
def test_a_run_without_vllms_series_fails_the_report_instead_of_printing_zeros(missing):
    prom = FakePrometheus({k: v for k, v in FIGURES.items() if k != ("vllm-alone", missing)})
    with pytest.raises(MissingSeries) as e:
        both(prom)
    assert "vLLM alone" in str(e.value) and 'run="vllm-alone"' in str(e.value)
    assert {"preemptions": "vllm:num_preemptions_total", "kv_peak": "vllm:kv_cache_usage_perc",
            "replicas_max": "up{endpoint=\"vllm\"}"}[missing] in str(e.value)


def test_the_guarded_run_needs_the_guards_counter_too():
    prom = FakePrometheus({k: v for k, v in FIGURES.items() if k != ("gpufleet", "guard_refusals")})
    with pytest.raises(MissingSeries, match="gpufleet_guard_rejections_total"):
        both(prom)


def test_the_guarantees_are_worded_from_the_figures():
    alone, fleet = both()
    text = " ".join(guarantees(alone, fleet, SLO, 15))
    assert "429 with Retry-After before any work" in text
    assert "vLLM alone preempted 37 times; behind the guard it preempted none" in text
    assert "2500 ms through gpufleet, above the 2000 ms objective" in text
    assert "Through gpufleet 2 of 6 were not (1 refused on every try, 1 gave up, 0 failed or timed out); " \
           "2 were refused first and served on a retry" in text
    # With preemptions behind the guard, the words change with the number.
    preempting = FakePrometheus({**FIGURES, ("gpufleet", "preemptions"): 4})
    text = " ".join(guarantees(*both(preempting), SLO, 15))
    assert "Not guaranteed: no preemption. Behind the guard vLLM preempted 4 times (alone: 37)" in text
    assert "preempted none" not in text


def test_the_table_renders_as_markdown_with_both_runs_and_the_report_lists_the_queries():
    runs = both()
    table = render_table(runs, SLO).splitlines()
    assert table[0] == "| | vLLM alone | gpufleet | source |"
    assert all(line.startswith("|") and line.count("|") == 5 for line in table)
    report = render_comparison(runs, SLO, 15, "the surge")
    assert "What the guard guarantees, and what it does not:" in report
    assert engine_queries(FLEET)["guard_refusals"] in report


def test_the_chart_draws_both_runs_on_the_same_axes(tmp_path):
    matrix = [{"metric": {}, "values": [[1000.0, "10"], [1002.0, "90"], [1004.0, "100"]]}]
    assert chart.points(matrix, 1000.0) == [(0.0, 10.0), (2.0, 90.0), (4.0, 100.0)]
    assert chart.points([], 1000.0) == []
    assert chart.completions_per_second(FLEET_RESULTS, 10.0) == ([0.0, 5.0, 10.0], [0.0, 0.8, 0.0])
    series = [chart.RunSeries(ALONE, ALONE_RESULTS, [(0, 50.0), (2, 100.0)], [(0, 1.0), (100, 1.0)]),
              chart.RunSeries(FLEET, FLEET_RESULTS, [(0, 40.0), (2, 83.0)], [(0, 1.0), (50, 2.0)])]
    chart.render(tmp_path / "c.png", series, slo_ttft_seconds=SLO)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert chart.timeline_queries(FLEET)["replicas"] == 'count(up{run="gpufleet",endpoint="vllm"} == 1)'
