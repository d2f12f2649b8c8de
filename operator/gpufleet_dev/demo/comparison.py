"""The demo's side-by-side table: the same surge against vLLM alone and through gpufleet.

Every cell is read from where its figure comes from, never from the demo's own bookkeeping: what
the clients saw (their records: outcomes, first tokens, tokens streamed) and what vLLM and the guard
counted (their series in the demo's Prometheus, by PromQL). A run whose vLLM series are missing
fails the report (``MissingSeries``): a zero there would read as "vLLM never preempted".

Pure: the queries go through an injected ``Query`` (``LocalPrometheus.query``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from gpufleet_api.guard.guard_metrics import REJECTIONS
from gpufleet_kit.stats import nearest_rank

from .load import RequestResult

# (PromQL, unix time to evaluate it at) → the result vector, as Prometheus's HTTP API returns it.
Query = Callable[[str, float], list[dict]]

PREEMPTIONS = "vllm:num_preemptions_total"
# vLLM's KV usage gauge (0..1): the newest name, and the one it had before 0.10.
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
GUARD_REFUSALS = REJECTIONS + "_total"
CLIENTS = "clients' records"


class MissingSeries(RuntimeError):
    """A figure the table needs has no samples in Prometheus for that run."""


@dataclasses.dataclass(frozen=True)
class RunWindow:
    run: str          # the ``run`` label of the run's scrape targets (prometheus.py)
    title: str
    start: float      # unix time the run's load began
    end: float        # unix time its last counted request ended
    guarded: bool     # the guard was in the path (its counters are expected)

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 1e-9)


def _range(w: RunWindow) -> str:
    return f"{max(1, math.ceil(w.end - w.start))}s"


def _increase(metric: str, w: RunWindow, endpoint: str) -> str:
    # Counters that start at zero with their process: the last value less the first within the
    # window, per series (a replica that joins mid-run counts from its first scrape), summed.
    sel, r = f'{metric}{{run="{w.run}",endpoint="{endpoint}"}}', _range(w)
    return f"sum(max_over_time({sel}[{r}]) - min_over_time({sel}[{r}]))"


def engine_queries(w: RunWindow) -> dict[str, str]:
    """The PromQL of each Prometheus figure of a run, evaluated at ``w.end``: vLLM's series from its
    scrape endpoint ("vllm"), the guard's from its own ("http"), as prometheus.py labels them."""
    r = _range(w)
    kv = '{__name__=~"' + "|".join(KV_USAGE_NAMES) + f'",run="{w.run}",endpoint="vllm"}}'
    serving = f'count(up{{run="{w.run}",endpoint="vllm"}} == 1)'
    queries = {
        "preemptions": _increase(PREEMPTIONS, w, "vllm"),
        "kv_peak": f"max(max_over_time({kv}[{r}]))",
        "replicas_min": f"min_over_time({serving}[{r}:2s])",
        "replicas_max": f"max_over_time({serving}[{r}:2s])",
    }
    if w.guarded:
        queries["guard_refusals"] = _increase(GUARD_REFUSALS, w, "http")
    return queries


SERIES_OF = {"preemptions": PREEMPTIONS, "kv_peak": " or ".join(KV_USAGE_NAMES),
             "replicas_min": "up{endpoint=\"vllm\"}", "replicas_max": "up{endpoint=\"vllm\"}",
             "guard_refusals": GUARD_REFUSALS}


@dataclasses.dataclass(frozen=True)
class EngineFigures:
    preemptions: float
    kv_peak_percent: float
    replicas_min: int
    replicas_max: int
    guard_refusals: float | None   # None: no guard in the path
    queries: dict[str, str]


def read_engine_figures(query: Query, w: RunWindow) -> EngineFigures:
    """vLLM's and the guard's figures for one run; MissingSeries names any series with no samples."""
    queries = engine_queries(w)
    values: dict[str, float] = {}
    missing = []
    for name, expr in queries.items():
        vector = query(expr, w.end)
        if not vector:
            missing.append(f"{SERIES_OF[name]} (query: {expr})")
            continue
        values[name] = float(vector[0]["value"][1])
    if missing:
        raise MissingSeries(f"{w.title}: Prometheus has no samples of " + "; ".join(missing) +
                            f" with run=\"{w.run}\" in the run's {w.end - w.start:.0f} s; is it scraping "
                            "vLLM (its /targets page)? The table is not printed with zeros in their place.")
    return EngineFigures(preemptions=values["preemptions"], kv_peak_percent=values["kv_peak"] * 100,
                         replicas_min=round(values["replicas_min"]), replicas_max=round(values["replicas_max"]),
                         guard_refusals=values.get("guard_refusals"), queries=queries)


def fate(r: RequestResult) -> str:
    """What became of a user's request: completed, refused (on its last try), gave_up, failed."""
    if r.status == 200 and not (r.error or r.gave_up or r.timed_out):
        return "completed"
    if r.gave_up:
        return "gave_up"
    if r.status == 429 and not r.timed_out:
        return "refused"
    return "failed"


@dataclasses.dataclass(frozen=True)
class ClientFigures:
    requests: int
    completed: int
    within_slo: int
    refused: int                # users answered 429 with Retry-After at least once
    refused_then_served: int
    refused_never_served: int
    refused_last: int           # refused on the last try too: a partition with completed, gave_up and failed
    gave_up: int
    failed: int                 # failed or timed out (no 200 stream to its end, not a refusal, not given up)
    bare_refusals: int          # 429 answers without Retry-After
    ttft_p50: float | None
    ttft_p99: float | None
    tokens_per_second: float


def client_figures(results: list[RequestResult], slo_ttft_seconds: float, seconds: float) -> ClientFigures:
    fates = [fate(r) for r in results]
    done = [r for r, f in zip(results, fates) if f == "completed"]
    ttft = [r.ttft for r in done if r.ttft is not None]
    refused = [f for r, f in zip(results, fates) if r.refusals > 0]
    return ClientFigures(
        requests=len(results), completed=len(done),
        within_slo=sum(t <= slo_ttft_seconds for t in ttft),
        refused=len(refused), refused_then_served=refused.count("completed"),
        refused_never_served=len(refused) - refused.count("completed"), refused_last=fates.count("refused"),
        gave_up=fates.count("gave_up"), failed=fates.count("failed"),
        bare_refusals=sum(r.bare_refusals for r in results),
        ttft_p50=nearest_rank(ttft, 0.50) if ttft else None, ttft_p99=nearest_rank(ttft, 0.99) if ttft else None,
        tokens_per_second=sum(r.tokens for r in done) / seconds)


@dataclasses.dataclass(frozen=True)
class RunFigures:
    window: RunWindow
    clients: ClientFigures
    engine: EngineFigures


def run_figures(query: Query, w: RunWindow, results: list[RequestResult], slo_ttft_seconds: float) -> RunFigures:
    return RunFigures(w, client_figures(results, slo_ttft_seconds, w.seconds), read_engine_figures(query, w))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _share(n: int, of: int) -> str:
    return f"{n} ({100 * n / of:.0f}%)" if of else str(n)


def table_rows(runs: list[RunFigures], slo_ttft_seconds: float) -> list[tuple[str, list[str], str]]:
    """(figure, one cell per run, source) rows."""
    def row(label: str, cell: Callable[[RunFigures], str], source: str) -> tuple[str, list[str], str]:
        return label, [cell(r) for r in runs], source
    slo = f"{slo_ttft_seconds * 1000:.0f} ms"
    return [
        row("user requests", lambda r: str(r.clients.requests), CLIENTS),
        row("completed", lambda r: _share(r.clients.completed, r.clients.requests), CLIENTS),
        row(f"completed with TTFT within the SLO ({slo})",
            lambda r: _share(r.clients.within_slo, r.clients.requests), CLIENTS),
        row("refused with 429 + Retry-After (users)", lambda r: str(r.clients.refused), CLIENTS),
        row("  of them, served on a later try", lambda r: str(r.clients.refused_then_served), CLIENTS),
        row("  of them, never served", lambda r: str(r.clients.refused_never_served), CLIENTS),
        row("gave up waiting for a first token", lambda r: str(r.clients.gave_up), CLIENTS),
        row("failed or timed out", lambda r: str(r.clients.failed), CLIENTS),
        row("TTFT p50 of completions (from first ask)", lambda r: _ms(r.clients.ttft_p50), CLIENTS),
        row("TTFT p99 of completions (from first ask)", lambda r: _ms(r.clients.ttft_p99), CLIENTS),
        row("output tokens/s of completed streams", lambda r: f"{r.clients.tokens_per_second:.0f}", CLIENTS),
        row("vLLM preemptions", lambda r: f"{r.engine.preemptions:.0f}", f"Prometheus: {PREEMPTIONS}"),
        row("vLLM KV usage peak", lambda r: f"{r.engine.kv_peak_percent:.0f}%", f"Prometheus: {KV_USAGE_NAMES[0]}"),
        row("guard refusals (its counter)",
            lambda r: "- (no guard)" if r.engine.guard_refusals is None else f"{r.engine.guard_refusals:.0f}",
            f"Prometheus: {GUARD_REFUSALS}"),
        row("replicas serving (min-max)", lambda r: (f"{r.engine.replicas_min}" if r.engine.replicas_min ==
                                                      r.engine.replicas_max else
                                                      f"{r.engine.replicas_min}-{r.engine.replicas_max}"),
            "Prometheus: up{endpoint=\"vllm\"}"),
    ]


def render_table(runs: list[RunFigures], slo_ttft_seconds: float) -> str:
    """A Markdown table (it pastes into the README as it is)."""
    head = "| | " + " | ".join(r.window.title for r in runs) + " | source |"
    lines = [head, "|---|" + "---:|" * len(runs) + "---|"]
    lines += [f"| {label} | " + " | ".join(cells) + f" | {source} |"
              for label, cells, source in table_rows(runs, slo_ttft_seconds)]
    return "\n".join(lines)


def guarantees(alone: RunFigures, fleet: RunFigures, slo_ttft_seconds: float, kv_watermark_percent: int) -> list[str]:
    """What the guard guarantees and what it does not: by construction, and each claim about this run
    worded from the run's own figures, so the table above cannot contradict it."""
    a, f = alone.clients, fleet.clients
    lines = [f"By construction: the guard admits a request only while {kv_watermark_percent}% of the KV pool "
             "stays free after its reservation; one it cannot admit gets 429 with Retry-After before any work "
             "is done on it. Admitted answers keep growing into that reserve, so KV usage can still reach the "
             "whole pool."]
    if f.bare_refusals:
        lines.append(f"{f.bare_refusals} refusals through gpufleet came without Retry-After.")
    pre_a, pre_f = alone.engine.preemptions, fleet.engine.preemptions
    if pre_f == 0:
        lines.append(f"Preemptions: vLLM alone preempted {pre_a:.0f} times; behind the guard it preempted none "
                     "in this run.")
    else:
        lines.append(f"Not guaranteed: no preemption. Behind the guard vLLM preempted {pre_f:.0f} times "
                     f"(alone: {pre_a:.0f}); the guard reserves predicted answer lengths, not the worst case.")
    p99 = f.ttft_p99
    if p99 is not None:
        verdict = ("within" if p99 <= slo_ttft_seconds else "above")
        lines.append(f"TTFT p99 of completions, counted from the user's first try (waits for Retry-After "
                     f"included): {_ms(a.ttft_p99)} alone, {_ms(p99)} through gpufleet, {verdict} the "
                     f"{_ms(slo_ttft_seconds)} objective. Under overload the guard admits fewer requests "
                     "while more would miss the objective (admission.ttftControl), and refuses those that "
                     "would wait too long; it does not promise the objective, least of all to a user it "
                     "asks to come back.")
    never = f.requests - f.completed
    if never:
        lines.append(f"Not guaranteed: that every user is served. Through gpufleet {never} of {f.requests} were "
                     f"not ({f.refused_last} refused on every try, "
                     f"{f.gave_up} gave up, {f.failed} failed or timed out); "
                     f"{f.refused_then_served} were refused first and served on a retry. Alone: "
                     f"{a.requests - a.completed} of {a.requests} were not served.")
    else:
        lines.append(f"Every one of the {f.requests} users through gpufleet was served in this run "
                     f"({f.refused_then_served} after a refusal).")
    lines.append(f"Capacity comes from replicas, not from the guard: {a.tokens_per_second:.0f} output tokens/s "
                 f"delivered alone with {alone.engine.replicas_max} replica, {f.tokens_per_second:.0f} through "
                 f"gpufleet with up to {fleet.engine.replicas_max}.")
    return lines


def sources(runs: list[RunFigures]) -> list[str]:
    """The PromQL behind each Prometheus cell, per run."""
    return [f"  {r.window.title} ({name}): {expr}" for r in runs for name, expr in r.engine.queries.items()]
