"""Autoscaling the pools of a disaggregated service. Pure.

Each pool is sized by ``policy.decide`` on its own replicas' samples, inside its own
``minReplicas..maxReplicas`` (``pool_thresholds``):

- prefill on its queue (waiting per replica, p90 queue time), shedding and the guard's TTFT p99
  against ``spec.slo.ttftP99Milliseconds`` (a prefill pod's TTFT is the prefill: its answer is
  the first token); not on KV usage, which on a prefill pod is the prompts in flight;
- decode on KV usage (the watermarks), shedding, its queue and the guard's ITL p99 against
  ``spec.slo.itlP99Milliseconds``.

With ``spec.disaggregation.ratioPolicy: Bound`` the decode pool is then held to the measured
prefill:decode ratio (``status.prefillDecodeRatio``) times the prefill pool's replicas, ±
``ratioTolerancePercent`` (``ratio_band``, ``bound_decode``).

Neither pool goes to zero: a pool's minReplicas is at least 1 (the API refuses less), no
scale-in goes below it, and the band is clamped into it.
"""
from __future__ import annotations

import dataclasses
import math

from gpufleet_api.guard.guard_config import Role
from gpufleet_api.route import max_replicas
from gpufleet_api.v1alpha1 import InferenceServiceSpec

from .policy import Decision, Observation, Thresholds, pressure

_EPS = 1e-9
RATIO_BOUND = "RatioBound"


def pool_thresholds(spec: InferenceServiceSpec, role: Role) -> Thresholds:
    """The policy's thresholds for one pool: the service's watermarks, queue thresholds and
    stabilization, the pool's bounds, and the signals that measure the pool's work."""
    assert spec.disaggregation is not None and role in ("prefill", "decode")
    bounds = getattr(spec.disaggregation, role)
    # The API's floor (PoolSpec.minReplicas >= 1): a pool never scales to zero while the other has work.
    assert bounds.min_replicas >= 1
    prefill = role == "prefill"
    return dataclasses.replace(
        Thresholds.from_spec(spec.autoscaling), min_replicas=bounds.min_replicas,
        # The router reads the same bound (gpufleet_api.route) to decide whether a refused request may
        # wait for a scale-out.
        max_replicas=max_replicas(spec, role), scale_to_zero_s=None, scale_on_kv=not prefill,
        ttft_p99_s=spec.slo.ttft_p99_milliseconds / 1000 if prefill else None,
        itl_p99_s=None if prefill else spec.slo.itl_p99_milliseconds / 1000)


@dataclasses.dataclass(frozen=True)
class RatioBand:
    """The decode replicas the ratio bound allows, and how it got there (for messages)."""
    low: int
    high: int
    text: str


def ratio_band(prefill_need: int, decode_need: int, prefill_replicas: int, tolerance: float,
               min_replicas: int, max_replicas: int) -> RatioBand:
    """decode within [r·p·(1−t), r·p·(1+t)], r = decode_need / prefill_need (the measured ratio),
    p = the prefill pool's replicas, t = tolerance; at least one whole count (a band narrower than
    one replica is the nearest), then clamped into the decode pool's bounds."""
    centre = decode_need / prefill_need * prefill_replicas
    low = max(1, math.ceil(centre * (1 - tolerance) - _EPS))
    high = math.floor(centre * (1 + tolerance) + _EPS)
    if high < low:
        low = high = max(1, math.floor(centre + 0.5))
    text = (f"ratio bound {prefill_need}:{decode_need} (prefill:decode) x {prefill_replicas} prefill "
            f"replica(s) ± {tolerance:.0%}: decode {low}..{high}")
    fit_low, fit_high = (min(max(n, min_replicas), max_replicas) for n in (low, high))
    if (fit_low, fit_high) != (low, high):
        text += f", {fit_low}..{fit_high} within the pool's {min_replicas}..{max_replicas}"
    return RatioBand(fit_low, fit_high, text)


def bound_decode(own: Decision | None, current: int, band: RatioBand, th: Thresholds, obs: Observation,
                 serving: int) -> tuple[Decision | None, str | None]:
    """The decode pool's decision within the band: (decision, why the pool is held where it is
    rather than where its signals or the band want it; None: not held).

    - Below the band: raised to its low end at once (as the pool's bounds are applied).
    - Its signals ask for more than the band's high end: capped there (never lowered).
    - Above the band with no scale-out asked for: scaled in to the high end, but never below the
      replicas that keep mean KV usage under the high watermark, and not while a replica is
      unreadable or a signal is high.
    """
    want = own.target if own is not None else current
    if band.low <= want <= band.high:
        return (None if own is None else dataclasses.replace(own, message=f"{own.message}; {band.text}")), None
    if want < band.low:
        if band.low == current:
            return None, None
        why = f"{own.message}; " if own is not None else ""
        return Decision(band.low, RATIO_BOUND, f"{why}{band.text}: raised to {band.low}"), None
    if own is not None and own.target > current:
        target = max(band.high, current)
        held = f"decode held at {target} replica(s), below the {own.target} its signals ask for ({own.reason}): " \
               f"{band.text}"
        if target == current:
            return None, held
        return dataclasses.replace(own, target=target, message=f"{own.message}; {band.text}: capped at "
                                                                f"{target}"), held
    if obs.unreadable:
        return None, (f"decode stays at {current} replica(s), above the band, while "
                      f"{', '.join(sorted(obs.unreadable))} cannot be read: {band.text}")
    high = pressure(th, obs)
    if high or obs.kv_usage is None:
        why = ", ".join(r for r, _ in high) if high else "KV usage unknown"
        return None, f"decode stays at {current} replica(s), above the band ({why}): {band.text}"
    need = math.ceil(serving * obs.kv_usage / th.kv_high - _EPS)  # keeps mean usage under the watermark
    target = max(band.high, need, th.min_replicas)
    if target >= current:
        return None, (f"decode stays at {current} replica(s), above the band: fewer would put its mean KV usage "
                      f"over the {th.kv_high:.0%} watermark; {band.text}")
    kv_note = f" (KV usage {obs.kv_usage:.0%} needs {need})" if need > band.high else ""
    return Decision(target, RATIO_BOUND, f"{band.text}: scaled in to {target}{kv_note}"), None
