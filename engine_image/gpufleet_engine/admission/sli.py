"""Service-level indicators, judged per request against the service's objectives.

The guard counts each event good or bad where it happens (``gpufleet_guard_sli_*``),
so a burn rate is a ratio of two counters: no ``histogram_quantile`` spreading
requests across a bucket that straddles the objective. What counts, and why:

- A request the client got wrong (4xx) is nobody's budget; one the guard shed
  for capacity (HTTP 429 with Retry-After) has its own alert (GpufleetRequestsShed).
- A request refused after waiting out its queue time, timed out, or answered
  with a 5xx counts bad in availability and, having produced no token in time,
  in its latency SLI. So does a refusal because the engine is down.
- A client that gave up counts only if it waited past the objective first:
  slowness made it leave.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpufleet_api.guard.guard_config import SLOConfig
from gpufleet_api.guard.guard_metrics import SLI, Reason

__all__ = ["Request", "judge", "judge_refusal"]

# Refusals that are the service's failure, not the client's or a deliberate shed.
_BAD_REFUSALS = frozenset({Reason.QUEUE_TIMEOUT, Reason.ENGINE_DOWN})
_SERVED = ("ok",)
_FAILED = ("timeout", "error")


@dataclass
class Request:
    """What the guard saw of one admitted request."""
    stream: bool
    outcome: str                       # one of contract.guard_metrics.OUTCOMES
    seconds: float                     # arrival to the end of the answer (or of waiting)
    ttft_seconds: float | None = None  # streaming: arrival to the first chunk
    gaps: int = 0                      # streaming: gaps between chunks
    late_gaps: int = 0                 # ... of which longer than slo.itlP99Seconds


# (sli, good events, events)
Judgement = list[tuple[str, int, int]]


def judge(slo: SLOConfig, r: Request) -> Judgement:
    """The SLI events of one finished request."""
    out: Judgement = []
    if r.outcome in _SERVED or r.outcome in _FAILED:
        out.append((SLI.AVAILABILITY, int(r.outcome in _SERVED), 1))
    if r.stream:
        if r.ttft_seconds is not None:
            out.append((SLI.TTFT, int(r.ttft_seconds <= slo.ttft_p99_seconds), 1))
        elif r.outcome in _FAILED or (r.outcome == "cancelled" and r.seconds > slo.ttft_p99_seconds):
            out.append((SLI.TTFT, 0, 1))  # never produced a token
        if r.gaps:
            out.append((SLI.ITL, r.gaps - r.late_gaps, r.gaps))
    elif r.outcome in _SERVED:
        out.append((SLI.LATENCY, int(r.seconds <= slo.request_p99_seconds), 1))
    elif r.outcome in _FAILED or (r.outcome == "cancelled" and r.seconds > slo.request_p99_seconds):
        out.append((SLI.LATENCY, 0, 1))
    return out


def judge_refusal(reason: str, stream: bool | None) -> Judgement:
    """The SLI events of a refused request; ``stream`` is None when it was refused unread."""
    if reason not in _BAD_REFUSALS:
        return []
    out: Judgement = [(SLI.AVAILABILITY, 0, 1)]
    if stream is not None:
        out.append((SLI.TTFT if stream else SLI.LATENCY, 0, 1))
    return out
