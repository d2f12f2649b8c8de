"""What the guard writes on a request's trace at each step of an exchange, and its tail rule:
which requests are kept whatever head sampling decided (docs/tracing.md)."""
from __future__ import annotations

from gpufleet_api import tracing as names
from gpufleet_engine.admission.context import Prepared
from gpufleet_engine.admission.grants import Grant
from gpufleet_kit.tracing import RequestTrace


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
    elif any(good < events for _, good, events in judgement):
        trace.keep("slo")
