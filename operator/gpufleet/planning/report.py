"""A plan as text: the distribution, KV demand, one replica's capacity, the
replicas needed with the constraint that sets them, the prefill:decode ratio,
and every assumption with its value and source. Pure (returns a string)."""
from __future__ import annotations

import math

from .planner import Plan

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _num(x: float | None, decimals: int = 0) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "∞"
    return f"{x:,.{decimals}f}"


def _rate(x: float) -> str:
    # Small rates need decimals to be readable; large ones do not.
    return _num(x, 2 if abs(x) < 100 else 0)


def _bytes(x: float) -> str:
    for unit, size in _UNITS:
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:.0f} B"


def _ms(seconds: float) -> str:
    return "∞" if not math.isfinite(seconds) else f"{seconds * 1000:,.0f} ms"


def render(plan: Plan) -> str:
    lines: list[str] = []
    add = lines.append
    r, f, t, c = plan.replica, plan.fleet, plan.traffic, plan.concurrency
    s = plan.settings

    add(f"gpufleet plan: {plan.model.name} on {plan.gpu.name}")
    add(f"source: {plan.source}")
    add("")
    add("REQUEST DISTRIBUTION")
    add(f"  {'':<20}{'p50':>10}{'p95':>10}{'p99':>10}{'mean':>10}{'max':>10}")
    for label, st in (("prompt tokens", plan.prompt), ("output tokens", plan.output)):
        add(f"  {label:<20}{_num(st.p50):>10}{_num(st.p95):>10}{_num(st.p99):>10}{_num(st.mean, 1):>10}"
            f"{_num(st.max):>10}")
    add(f"  {'requests/s':<20}peak {_rate(t.rps_peak)}   trough {_rate(t.rps_trough)}   mean {_rate(t.rps_mean)}"
        f"   ({t.window_seconds:g} s windows over {t.span_seconds:,.0f} s)")
    add(f"  {'prompt tokens/s':<20}peak {_rate(t.prompt_tokens_per_s_peak)}")
    add(f"  {'output tokens/s':<20}peak {_rate(t.output_tokens_per_s_peak)}")
    add(f"  {'in flight (peak)':<20}{_num(c.requests_peak, 1 if c.requests_peak % 1 else 0)} requests, "
        f"{_num(c.tokens_peak)} tokens")
    add(f"  {'':<20}({c.method})")
    add("")
    add("KV CACHE")
    add(f"  {'per token':<20}{_bytes(r.kv_bytes_per_token)}")
    add(f"  {'demand at peak':<20}{_bytes(f.kv_demand_bytes)} = {_num(c.tokens_peak)} tokens × "
        f"{_bytes(r.kv_bytes_per_token)}")
    add(f"  {'pool per replica':<20}{_bytes(r.kv_pool_bytes)} = {r.tensor_parallel} × {_bytes(plan.gpu.memory_bytes)}"
        f" × {s.gpu_memory_utilization:g} − {_bytes(r.weights_bytes)} weights")
    add(f"  {'usable per replica':<20}{_bytes(r.kv_usable_bytes)} after the {s.kv_watermark_percent} % watermark"
        f" = {_num(r.kv_usable_tokens)} tokens")
    add("")
    add(f"ONE REPLICA ({r.tensor_parallel} × {plan.gpu.name})")
    add(f"  {'prefill':<20}{_num(r.prefill_tokens_per_s)} tokens/s")
    add(f"  {'decode':<20}{_num(r.decode_tokens_per_s)} tokens/s at batch {r.decode_batch} "
        f"(capped by {r.decode_batch_bound}), step {r.decode_step_seconds * 1000:.1f} ms, {r.decode_bound} bound")
    add(f"  {'batch caps':<20}" + " · ".join(f"{k} {_num(v)}" for k, v in r.batch_limits.items()))
    add(f"  {'decode context':<20}{_num(r.decode_context_tokens)} tokens (mean prompt + mean output ÷ 2)")
    add("")
    add(f"REPLICAS NEEDED: {f.replicas} ({f.gpus} GPU{'s' if f.gpus != 1 else ''}), set by {f.binding}")
    ttft = (f"predicted TTFT p99 at {f.replicas}: {_ms(f.ttft_p99_seconds)} (SLO {_ms(s.ttft_p99_seconds)})")
    for label, value, why in (
            ("by KV capacity", f.replicas_by_kv, "KV demand at peak ÷ usable KV per replica"),
            ("by token throughput", f.replicas_by_throughput,
             "peak prompt tok/s ÷ prefill tok/s + peak output tok/s ÷ decode tok/s"),
            ("by TTFT p99 SLO", f.replicas_by_ttft if f.replicas_by_ttft is not None else "not met", ttft),
            ("by concurrency", f.replicas_by_concurrency, "peak in flight ÷ min(maxNumSeqs, maxConcurrency)")):
        add(f"  {label:<22}{value!s:>8}   {why}")
    add("")
    add("DISAGGREGATED SERVING (prefill:decode from token throughput)")
    add(f"  prefill:decode = 1 : {_num(f.decode_per_prefill, 2)}   "
        f"({f.prefill_replica_units:.3g} prefill : {f.decode_replica_units:.3g} decode replicas of peak demand)")
    add(f"  at peak: {f.prefill_replicas_disaggregated} prefill + {f.decode_replicas_disaggregated} decode replicas "
        "(prefill also meets the TTFT SLO; decode also holds the KV demand)")
    add("")
    add("ASSUMPTIONS")
    width = max(len(a.name) for a in plan.assumptions) + 2
    for a in plan.assumptions:
        add(f"  {a.name:<{width}}{a.value}   [{a.source}]")
    if plan.notes:
        add("")
        add("NOTES")
        for note in plan.notes:
            add(f"  - {note}")
    return "\n".join(lines) + "\n"
