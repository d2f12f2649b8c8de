"""status.prefillDecodeRatio: the live prefill:decode ratio as observed state. Pure.

Written only when it says something new (the replica counts, the reason, a message that is not
just newer figures, or the ratio by ``RATIO_CHANGE`` or more), so a thousand services measured
every 30 s do not write their status every 30 s. A measured ratio is not replaced by "awaiting
traffic": it stays, with its time, as the ratio of the last traffic seen (the operator
restarted, or the service went quiet).
"""
from __future__ import annotations

import dataclasses

from ..planning.live_ratio import LiveRatio

FIELD = "prefillDecodeRatio"
RATIO_CHANGE = 0.1


@dataclasses.dataclass(frozen=True)
class MeasuredRatio:
    prefill: int
    decode: int


def ratio_status(ratio: LiveRatio, previous: dict | None, stamp: str) -> dict | None:
    """The status.prefillDecodeRatio to write for ``ratio``; None when ``previous`` says as much."""
    new: dict = {"reason": ratio.reason, "message": ratio.message, "time": stamp}
    if ratio.reason == "Measured":
        new.update(prefill=ratio.prefill, decode=ratio.decode, requests=ratio.requests,
                   windowSeconds=ratio.window_seconds)
        if ratio.decode_per_prefill is not None:
            new["decodePerPrefill"] = f"{ratio.decode_per_prefill:.2f}"
    if not previous:
        return new
    if ratio.reason == "AwaitingTraffic" and previous.get("reason") == "Measured":
        return None
    if (previous.get("reason"), previous.get("prefill"), previous.get("decode")) != \
            (new["reason"], new.get("prefill"), new.get("decode")):
        return new
    if ratio.reason != "Measured":
        return new if previous.get("message") != new["message"] else None
    return new if _moved(previous.get("decodePerPrefill"), new.get("decodePerPrefill")) else None


def _moved(old: str | None, new: str | None) -> bool:
    try:
        before, after = float(old or "nan"), float(new or "nan")
    except ValueError:
        return True
    if before != before or after != after:  # one is missing
        return old != new
    return abs(after - before) >= RATIO_CHANGE * max(before, 1e-9)


def measured_ratio(status_ratio: dict | None) -> MeasuredRatio | None:
    """The replicas the last measured traffic needs, from status.prefillDecodeRatio (None: none measured)."""
    if not status_ratio or status_ratio.get("reason") != "Measured":
        return None
    prefill, decode = status_ratio.get("prefill"), status_ratio.get("decode")
    if not isinstance(prefill, int) or not isinstance(decode, int) or prefill < 1 or decode < 1:
        return None
    return MeasuredRatio(prefill, decode)
