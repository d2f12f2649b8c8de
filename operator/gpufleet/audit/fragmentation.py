"""Fragmentation audit: per-replica /audit reports → one verdict per service,
and when a replica may be restarted for it.

A replica's fragmentation is its worst device's ``inactive split bytes /
reserved bytes`` in vLLM's own caching allocator, reported from inside vLLM
by the engine's plugin (gpufleet_api.guard.gpu_memory, docs/metrics.md).
Fragmentation alone costs nothing; a replica is *losing memory* when its
allocator's retries (cudaMalloc failed, cache flushed, retried) or OOMs rose
since the previous audit. Only such a replica, above the threshold, is a
candidate for RestartReplica, and only under every rule of ``may_restart``.
A replica that cannot measure (CPU engine, unreachable) is listed as such;
the verdict is Unavailable when none could.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class ReplicaAudit:
    pod: str
    ratio: float | None            # None: not measurable on this replica
    note: str = ""                 # why not, or extra detail
    alloc_retries: int | None = None   # cumulative, summed over the replica's devices
    ooms: int | None = None


@dataclasses.dataclass(frozen=True)
class AuditResult:
    verdict: str                   # OK | AboveThreshold | Unavailable
    ratio: float | None
    worst: str | None
    recommendation: str
    replicas: tuple[ReplicaAudit, ...]
    restart_candidate: str | None = None   # above the threshold and losing memory


def replica_from_report(pod: str, report: dict | None, error: str | None = None) -> ReplicaAudit:
    """One replica from the guard's /audit document (engine_image/gpufleet_engine/serving/memory_report.py)."""
    if report is None:
        return ReplicaAudit(pod, None, error or "no report")
    ratio = report.get("fragmentationRatio")
    if ratio is None:
        why = "; ".join(report.get("unavailable") or []) or (report.get("device") or {}).get("reason") \
            or "not measured"
        return ReplicaAudit(pod, None, why)
    retries, ooms = report.get("allocRetries"), report.get("ooms")
    return ReplicaAudit(pod, float(ratio), alloc_retries=None if retries is None else int(retries),
                        ooms=None if ooms is None else int(ooms))


def losing_memory(replica: ReplicaAudit, previous: tuple[int, int] | None) -> bool:
    """Allocation retries or OOMs rose since the previous audit of the same pod (no baseline: unknown, no)."""
    if previous is None or replica.alloc_retries is None or replica.ooms is None:
        return False
    return replica.alloc_retries > previous[0] or replica.ooms > previous[1]


def counters(replicas: list[ReplicaAudit]) -> dict[str, tuple[int, int]]:
    """The baseline the next audit compares against."""
    return {r.pod: (r.alloc_retries, r.ooms) for r in replicas
            if r.alloc_retries is not None and r.ooms is not None}


def evaluate(replicas: list[ReplicaAudit], threshold: float, remediation: str,
             previous: Mapping[str, tuple[int, int]] | None = None) -> AuditResult:
    previous = previous or {}
    measured = [r for r in replicas if r.ratio is not None]
    if not measured:
        notes = sorted({r.note for r in replicas}) or ["no replicas"]
        return AuditResult("Unavailable", None, None,
                           f"no replica could measure fragmentation ({'; '.join(notes)})", tuple(replicas))
    worst = max(measured, key=lambda r: (r.ratio or 0.0, r.pod))
    if worst.ratio is None or worst.ratio <= threshold:
        return AuditResult("OK", worst.ratio, worst.pod, "none needed", tuple(replicas))
    above = [r for r in measured if (r.ratio or 0.0) > threshold]
    losing = sorted((r for r in above if losing_memory(r, previous.get(r.pod))),
                    key=lambda r: (-(r.ratio or 0.0), r.pod))
    candidate = losing[0].pod if losing else None
    if candidate is None:
        rec = (f"{worst.pod}: {worst.ratio:.0%} of its allocator's reserved memory is in split blocks, but "
               f"no replica above {threshold:.0%} had allocation retries or OOMs since the last audit; "
               f"no restart needed while that holds")
    elif remediation == "RestartReplica":
        rec = (f"restarting {candidate} (fragmentation above {threshold:.0%} and allocation retries or OOMs "
               f"rising) when the rules for a safe restart allow")
    else:
        rec = (f"{candidate} is losing usable memory (allocation retries or OOMs rising, fragmentation above "
               f"{threshold:.0%}): restart it during low traffic (kubectl delete pod {candidate}), or set "
               f"spec.audit.fragmentation.remediation: RestartReplica")
    return AuditResult("AboveThreshold", worst.ratio, worst.pod, rec, tuple(replicas), candidate)


@dataclasses.dataclass(frozen=True)
class RestartContext:
    """What the rules for restarting a replica look at, read in one loop pass."""
    now: float                          # seconds, the loop's clock
    watching_since: float               # when this operator process began watching the service
    cooldown_seconds: float
    last_restart_ago: float | None      # seconds since the service's last fragmentation restart (status)
    ready_replicas: int
    desired_replicas: int
    pods_terminating: int
    node_drain: bool                    # replacements for pods on cordoned nodes run (status.drain)
    scaling_in: bool                    # a scale-in decided in this pass, or marked and not finished
    kv_usage: Mapping[str, float]       # ready replicas' KV-cache usage, 0..1
    kv_high: float                      # the scale-out watermark, 0..1


def may_restart(pod: str, ctx: RestartContext) -> tuple[bool, str]:
    """Every rule must hold; the first that does not is the reason given."""
    if ctx.scaling_in:
        return False, "a scale-in is under way; one disruption at a time"
    if ctx.now - ctx.watching_since < ctx.cooldown_seconds:
        return False, (f"the operator began watching this service {ctx.now - ctx.watching_since:.0f}s ago; "
                       f"no restart within the first {ctx.cooldown_seconds:.0f}s (no burst after a start)")
    if ctx.last_restart_ago is not None and ctx.last_restart_ago < ctx.cooldown_seconds:
        return False, (f"a replica was restarted for fragmentation {ctx.last_restart_ago:.0f}s ago; the cooldown "
                       f"is {ctx.cooldown_seconds:.0f}s")
    if ctx.pods_terminating or ctx.ready_replicas < ctx.desired_replicas:
        return False, (f"only {ctx.ready_replicas}/{ctx.desired_replicas} replicas ready"
                       f"{f', {ctx.pods_terminating} terminating' if ctx.pods_terminating else ''}; "
                       f"one replica at a time")
    if ctx.ready_replicas < 2:
        return False, "it is the only ready replica; restarting it would drop all traffic"
    if ctx.node_drain:
        return False, "a node drain is under way; one disruption at a time"
    others = ctx.ready_replicas - 1
    if len(ctx.kv_usage) < ctx.ready_replicas:
        return False, "not every ready replica's KV usage could be read; its load cannot be placed"
    load = sum(ctx.kv_usage.values())
    after = load / others
    if after >= ctx.kv_high:
        return False, (f"the other {others} replica(s) would run at {after:.0%} KV usage without it, at or above "
                       f"the scale-out watermark {ctx.kv_high:.0%}")
    return True, f"the other {others} replica(s) would run at {after:.0%} KV usage"
