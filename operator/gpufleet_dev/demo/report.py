"""The demo's report: a timeline and request results → text and a PNG. Pure
apart from writing the files."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from gpufleet_kit.stats import nearest_rank

from .comparison import RunFigures, fate, guarantees, render_table, sources
from .load import RequestResult


@dataclasses.dataclass
class Tick:
    t: float
    desired: int
    ready: int
    kv_percent: int | None
    clients: int


def percentile(values: list[float], q: float) -> float | None:
    return nearest_rank(values, q) if values else None


def summarize(results: list[RequestResult]) -> dict:
    fates = [fate(r) for r in results]
    ok = [r for r, f in zip(results, fates) if f == "completed"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    return {
        "requests": len(results), "ok": len(ok),
        "shed_429": fates.count("refused"),
        "errors": fates.count("failed") + fates.count("gave_up"),
        "retried_elsewhere": sum(r.retried > 0 for r in results),
        "ttft_p50": percentile(ttft, 0.50), "ttft_p95": percentile(ttft, 0.95), "ttft_p99": percentile(ttft, 0.99),
        "tokens": sum(r.tokens for r in ok),
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def render_text(*, service: str, spec_summary: dict, ticks: list[Tick], results: list[RequestResult],
                decisions: list[dict], audit: dict, prometheus: dict) -> str:
    s = summarize(results)
    duration = ticks[-1].t if ticks else 0
    lines = [f"gpufleet demo report — InferenceService {service}", "",
             "What was asked (spec):"]
    lines += [f"  {k}: {v}" for k, v in spec_summary.items()]
    lines += ["", f"Load through gpufleet: {s['requests']} streaming requests over {duration:.0f}s (surge and lull)",
              f"  completed {s['ok']}, refused with 429 + Retry-After on every try {s['shed_429']}, "
              f"gave up or failed {s['errors']}, "
              f"sent to another replica because the first was draining {s['retried_elsewhere']}",
              f"  TTFT p50 {_ms(s['ttft_p50'])}, p95 {_ms(s['ttft_p95'])}, p99 {_ms(s['ttft_p99'])}; "
              f"{s['tokens']} tokens generated", "",
              "What the operator did:"]
    if decisions:
        lines += [f"  {d['time']}  {d['from']} -> {d['to']} replicas  ({d['reason']}: {d['message']})"
                  for d in decisions]
    else:
        lines.append("  no scaling decision (load stayed between the watermarks)")
    peak = max((t.kv_percent or 0 for t in ticks), default=0)
    lines += [f"  peak KV usage seen {peak}% (scale-out watermark {spec_summary.get('kvHighWatermarkPercent')}%, "
              f"scale-in {spec_summary.get('kvLowWatermarkPercent')}%)",
              *guarantee_lines(spec_summary.get("kvWatermarkPercent")),
              f"  replicas: max desired {max((t.desired for t in ticks), default=0)}, "
              f"max ready {max((t.ready for t in ticks), default=0)}", "",
              "Audits:"]
    lines += [f"  {k}: {v}" for k, v in audit.items()]
    if prometheus:
        lines += ["", "Prometheus (real, scraping the guard, vLLM and the operator):"]
        lines += [f"  {k}: {v}" for k, v in prometheus.items()]
    return "\n".join(lines) + "\n"


def guarantee_lines(watermark_percent) -> list[str]:
    """What the guard promises and what it does not, in words the peak usage above cannot contradict."""
    return [f"  the guard admits a request only while {watermark_percent}% of the KV pool stays free after it; "
            "the answers it admitted keep growing into that reserve, so usage can pass the line (up to the "
            "whole pool); a request that does not fit gets 429 with Retry-After"]


def render_png(path: Path, ticks: list[Tick], results: list[RequestResult], *, kv_high: int, kv_low: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = [x.t for x in ticks]
    axes[0].step(t, [x.desired for x in ticks], where="post", label="desired replicas")
    axes[0].step(t, [x.ready for x in ticks], where="post", label="ready replicas")
    axes[0].step(t, [x.clients for x in ticks], where="post", label="clients", alpha=0.5)
    axes[0].set_ylabel("count")
    axes[0].legend(loc="upper left")
    axes[1].plot(t, [x.kv_percent if x.kv_percent is not None else float("nan") for x in ticks], label="KV usage %")
    axes[1].axhline(kv_high, color="red", linestyle="--", label=f"scale-out {kv_high}%")
    axes[1].axhline(kv_low, color="green", linestyle="--", label=f"scale-in {kv_low}%")
    axes[1].set_ylabel("KV %")
    axes[1].legend(loc="upper left")
    ok = [r for r in results if r.status == 200 and r.ttft is not None]
    axes[2].scatter([r.started for r in ok], [r.ttft * 1000 for r in ok], s=4, label="TTFT (ms), completed")
    shed = [r.started for r in results if r.status == 429]
    if shed:
        axes[2].scatter(shed, [0] * len(shed), s=8, marker="x", color="red", label="429")
    axes[2].set_ylabel("TTFT ms")
    axes[2].set_xlabel("seconds since load start")
    axes[2].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_comparison(runs: list[RunFigures], slo_ttft_seconds: float, kv_watermark_percent: int,
                      surge: str) -> str:
    """The side-by-side table, what the guard guarantees and does not (from the figures), and the
    PromQL behind each Prometheus cell."""
    titles = ", then ".join(r.window.title for r in runs)
    lines = [f"The same surge: {titles} (same engine image, same node; {surge}).",
             "User requests counted once each, whatever their retries; TTFT from the user's first try.", "",
             render_table(runs, slo_ttft_seconds), ""]
    if len(runs) == 2:
        lines += ["What the guard guarantees, and what it does not:"]
        lines += [f"  - {line}" for line in guarantees(runs[0], runs[1], slo_ttft_seconds, kv_watermark_percent)]
        lines.append("")
    lines += ["Where the Prometheus cells come from (instant queries at each run's end):", *sources(runs)]
    return "\n".join(lines) + "\n"
