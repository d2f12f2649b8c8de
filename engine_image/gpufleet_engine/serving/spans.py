"""What the guard writes on a request's trace at each step of an exchange, and its tail rule:
which requests are kept whatever head sampling decided (docs/tracing.md)."""
from __future__ import annotations

from gpufleet_api import tracing as names
from gpufleet_api.guard.guard_metrics import SLI
from gpufleet_engine.admission.context import Prepared
from gpufleet_engine.admission.grants import Grant
from gpufleet_kit.tracing import RequestTrace

# A stream is kept for its gaps when more than this share of them came later than the ITL objective:
# the objective is a p99 over gaps, so a late gap or two in a long stream is within it (and under load
# nearly every stream has one); a stream a tenth of whose gaps are late is a slow stream.
ITL_KEEP_LATE_SHARE = 0.1


def slow_stream(gaps: int, late_gaps: int) -> bool:
    return late_gaps > ITL_KEEP_LATE_SHARE * gaps


def dispatched(trace: RequestTrace, class_name: str, grant: Grant, prepared: Prepared) -> None:
    trace.set_all({names.CLASS: class_name, names.RESERVED_BLOCKS: grant.cost,
                   names.QUEUE_WAIT_SECONDS: grant.queued_seconds, names.STREAM: prepared.stream,
                   names.GEN_AI_INPUT_TOKENS: prepared.total_prompt_tokens,
                   **({names.ADAPTER: prepared.adapter} if prepared.adapter else {})})


def first_token(trace: RequestTrace, ttft_seconds: float, objective_seconds: float) -> None:
    trace.set(names.TTFT_SECONDS, ttft_seconds)
    if ttft_seconds > objective_seconds:
        trace.keep("slo")  # before the exemplar is written: the slow bucket names a trace that is kept


def finished(trace: RequestTrace, outcome: str, judgement: list[tuple[str, int, int]]) -> None:
    """The tail rule at the request's end: failed, refused by vLLM, or any SLI event missed."""
    trace.set(names.OUTCOME, outcome)
    if outcome in ("error", "timeout"):
        trace.keep("error")
    elif outcome == "invalid":
        trace.keep("refused")
    elif any(slow_stream(events, events - good) if sli == SLI.ITL else good < events
             for sli, good, events in judgement):
        trace.keep("slo")
