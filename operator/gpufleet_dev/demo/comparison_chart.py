"""The comparison chart: both runs on the same axes (TTFT, KV usage, completions per second,
replicas), time counted from each run's start of load.

TTFT and completions come from the clients' records; KV usage and replicas from Prometheus's
range queries over each run (``timeline_queries``), turned into (t, value) points by ``points``.
Pure apart from writing the PNG."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .comparison import KV_USAGE_NAMES, RunWindow, fate
from .load import RequestResult

COLOURS = {"vllm-alone": "tab:red", "gpufleet": "tab:blue"}
BIN_SECONDS = 5.0


def timeline_queries(w: RunWindow) -> dict[str, str]:
    kv = '{__name__=~"' + "|".join(KV_USAGE_NAMES) + f'",run="{w.run}",endpoint="vllm"}}'
    return {"kv_percent": f"100 * max({kv})", "replicas": f'count(up{{run="{w.run}",endpoint="vllm"}} == 1)'}


def points(matrix: list[dict], start: float) -> list[tuple[float, float]]:
    """A range query's first series as (seconds since ``start``, value)."""
    if not matrix:
        return []
    return [(float(t) - start, float(v)) for t, v in matrix[0]["values"]]


@dataclasses.dataclass(frozen=True)
class RunSeries:
    window: RunWindow
    results: list[RequestResult]             # started/finished in seconds since the run's load began
    kv_percent: list[tuple[float, float]]
    replicas: list[tuple[float, float]]


def completions_per_second(results: list[RequestResult], seconds: float) -> tuple[list[float], list[float]]:
    bins = max(1, int(seconds // BIN_SECONDS) + 1)
    counts = [0] * bins
    for r in results:
        if fate(r) == "completed":
            counts[min(bins - 1, int(r.finished // BIN_SECONDS))] += 1
    return [i * BIN_SECONDS for i in range(bins)], [c / BIN_SECONDS for c in counts]


def render(path: Path, runs: list[RunSeries], *, slo_ttft_seconds: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for run in runs:
        colour, title = COLOURS.get(run.window.run, None), run.window.title
        done = [r for r in run.results if fate(r) == "completed" and r.ttft is not None]
        axes[0].scatter([r.started for r in done], [r.ttft for r in done], s=5, color=colour, alpha=0.6,
                        label=f"{title}: TTFT of completions")
        never = [r.started for r in run.results if fate(r) != "completed"]
        if never:
            axes[0].scatter(never, [slo_ttft_seconds / 10] * len(never), s=12, marker="x", color=colour,
                            label=f"{title}: never served ({len(never)})")
        if run.kv_percent:
            axes[1].plot(*zip(*run.kv_percent), color=colour, label=title)
        t, rate = completions_per_second(run.results, run.window.seconds)
        axes[2].step(t, rate, where="post", color=colour, label=title)
        if run.replicas:
            axes[3].step(*zip(*run.replicas), where="post", color=colour, label=title)
    axes[0].axhline(slo_ttft_seconds, color="grey", linestyle="--", label=f"SLO {slo_ttft_seconds * 1000:.0f} ms")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT s (from first ask)")
    axes[1].set_ylabel("vLLM KV usage %")
    axes[1].set_ylim(0, 105)
    axes[2].set_ylabel(f"completions/s ({BIN_SECONDS:g} s bins)")
    axes[3].set_ylabel("replicas serving")
    axes[3].set_xlabel("seconds since the run's load began")
    for ax in axes:
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle("The same surge: vLLM alone and through gpufleet")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
