"""A disaggregated service's live prefill:decode ratio (``status.prefillDecodeRatio``).

The decode pods' finished requests, read every tick, fill a token window (``observe``); every
``RATIO_UPDATE_S`` the ratio it gives (``planning.live_ratio``) goes into the tick's status fields
when it says something new (``measure``). ratioPolicy Bound holds the decode pool to it
(``autoscaler.ServiceAutoscaler``).
"""
from __future__ import annotations

from typing import Sequence

from gpufleet_api import InferenceServiceSpec

from ..autoscale.signals import ReplicaSample
from ..autoscale.token_window import TokenWindow
from ..planning.live_ratio import live_ratio
from ..reconcile import conditions as cond
from ..reconcile import ratio as ratio_status

RATIO_UPDATE_S = 30.0


class RatioMeter:
    def __init__(self) -> None:
        self.tokens = TokenWindow()  # the decode pods' finished requests
        self.measured: float | None = None

    def observe(self, decode_samples: Sequence[ReplicaSample], now: float) -> None:
        """Advance the window with the decode pods' samples (a follower's reads too)."""
        self.tokens = self.tokens.advance(decode_samples, now)

    def measure(self, body: dict, spec: InferenceServiceSpec, now: float, fields: dict) -> None:
        """Every RATIO_UPDATE_S, the live prefill:decode ratio of the token window into ``fields``
        when it says something new."""
        if self.measured is not None and now - self.measured < RATIO_UPDATE_S:
            return
        self.measured = now
        ratio = live_ratio(spec, self.tokens.demand(now))
        new = ratio_status.ratio_status(ratio, (body.get("status") or {}).get(ratio_status.FIELD), cond.now_iso())
        if new is not None:
            fields[ratio_status.FIELD] = new
