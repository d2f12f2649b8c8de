"""When a status write is due: the fast-moving figures paced, everything else at once. Pure.

Status is the observed state that `kubectl get` and the on-call read, not a metrics feed:
Prometheus has every figure every second (docs/metrics.md). The fleet loop reads a busy service's
replicas every second and its figures move on nearly every read; written on every move, 1000 busy
services would put about 1000 status updates a second into etcd. So, per object:

- the figures (``FIGURES``: KV cache usage, KV waste, TTFT p99; an InferenceAdapter's
  requestsPerSecond, ``fleet/adapter_sync.py``) reach status at most every ``interval_seconds``
  (the operator's --status-figures-interval-seconds);
- everything else a pass writes (conditions, replica counts, lastScaling, the prefill:decode ratio)
  is written at once, and the current figures ride along with it;
- a figure that rises above its limit (``limits``: KV usage above kvHighWatermarkPercent, TTFT p99
  above slo.ttftP99Milliseconds) while status shows it at or under is written at once: "this service
  just went hot" is what an on-call acts on. Falling back under waits for the interval, so a figure
  hovering at its limit costs at most one write more per interval;
- ``interval_seconds`` 0: every change at once.

``TIME_FIELD`` (status.figuresUpdateTime) says when the figures last reached status; figures that
hold still are not rewritten, so it can be older than the interval on a steady service.
"""
from __future__ import annotations

from typing import Mapping

from gpufleet_api.v1alpha1 import InferenceServiceSpec

from . import conditions as cond

FIGURES = ("kvCacheUsagePercent", "kvWastePercent", "ttftP99Milliseconds")
TIME_FIELD = "figuresUpdateTime"
DEFAULT_INTERVAL_S = 20.0
MAX_INTERVAL_S = 300.0


def limits(spec: InferenceServiceSpec) -> dict[str, float]:
    """The levels above which a service's figure is written at once."""
    return {"kvCacheUsagePercent": spec.autoscaling.kv_high_watermark_percent,
            "ttftP99Milliseconds": spec.slo.ttft_p99_milliseconds}


def due(written_at: float | None, now: float, interval_seconds: float) -> bool:
    """Whether figures last written at ``written_at`` (None: not by this process) may be written again."""
    return interval_seconds <= 0 or written_at is None or now - written_at >= interval_seconds


def risen_above(shown: Mapping, figures: Mapping, limits: Mapping[str, float]) -> list[str]:
    """The figures above their limit that ``shown`` (the object's status) has at or under it, or not at all."""
    out = []
    for name, limit in limits.items():
        new, old = figures.get(name), shown.get(name)
        if new is not None and new > limit and (old is None or old <= limit):
            out.append(name)
    return out


class FigurePacer:
    """One object's pacing: when its figures last reached status (monotonic seconds)."""

    def __init__(self, interval_seconds: float, figures: tuple[str, ...] = FIGURES):
        self.interval_seconds = interval_seconds
        self.figures = figures
        self.written_at: float | None = None

    def plan(self, fields: Mapping, shown: Mapping, now: float, *, urgent: bool = False,
             limits: Mapping[str, float] | None = None, stamp: str | None = None) -> dict:
        """The status fields to write now ({}: none).

        ``fields``: what the pass computed, figures and others; ``shown``: the object's status;
        ``urgent``: a write happens anyway (a condition changes). Figures that moved go with any
        write, and alone when due; they bring ``TIME_FIELD`` (``stamp``, default now) along."""
        figures = {k: v for k, v in fields.items() if k in self.figures}
        rest = {k: v for k, v in fields.items() if k not in self.figures}
        urgent = (urgent or any(shown.get(k) != v for k, v in rest.items())
                  or bool(risen_above(shown, figures, limits or {})))
        moved = any(shown.get(k) != v for k, v in figures.items())
        if moved and (urgent or due(self.written_at, now, self.interval_seconds)):
            return {**rest, **figures, TIME_FIELD: stamp or cond.now_iso()}
        return dict(rest) if urgent else {}

    def wrote(self, written: Mapping, now: float) -> None:
        """``written`` reached status at ``now``: the interval starts again if it carried the figures."""
        if TIME_FIELD in written:
            self.written_at = now
