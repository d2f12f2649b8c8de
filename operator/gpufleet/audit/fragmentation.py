"""Fragmentation audit: per-replica /audit reports → one verdict per service.

fragmentation ratio = 1 - largest allocatable block / free memory, read from
each replica's guard. A replica that cannot measure (CPU engine, unreachable)
is listed as such; the verdict is Unavailable when none could.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReplicaAudit:
    pod: str
    ratio: float | None            # None: not measurable on this replica
    note: str = ""                 # why not, or extra detail


@dataclasses.dataclass(frozen=True)
class AuditResult:
    verdict: str                   # OK | AboveThreshold | Unavailable
    ratio: float | None
    worst: str | None
    recommendation: str
    replicas: tuple[ReplicaAudit, ...]


def replica_from_report(pod: str, report: dict | None, error: str | None = None) -> ReplicaAudit:
    """One replica from the guard's /audit document (engine_image/gpufleet_engine/audit.py)."""
    if report is None:
        return ReplicaAudit(pod, None, error or "no report")
    ratio = report.get("fragmentationRatio")
    if ratio is None:
        why = "; ".join(report.get("unavailable") or []) or (report.get("device") or {}).get("reason") \
            or "not measured"
        return ReplicaAudit(pod, None, why)
    return ReplicaAudit(pod, float(ratio))


def evaluate(replicas: list[ReplicaAudit], threshold: float, remediation: str) -> AuditResult:
    measured = [r for r in replicas if r.ratio is not None]
    if not measured:
        notes = sorted({r.note for r in replicas}) or ["no replicas"]
        return AuditResult("Unavailable", None, None,
                           f"no replica could measure fragmentation ({'; '.join(notes)})", tuple(replicas))
    worst = max(measured, key=lambda r: (r.ratio or 0.0, r.pod))
    if worst.ratio is None or worst.ratio <= threshold:
        return AuditResult("OK", worst.ratio, worst.pod, "none needed", tuple(replicas))
    if remediation == "RestartReplica":
        rec = (f"restarting {worst.pod} (fragmentation {worst.ratio:.0%} > {threshold:.0%}) when the "
               f"PodDisruptionBudget and spare capacity allow")
    else:
        rec = (f"restart {worst.pod} during low traffic (kubectl delete pod {worst.pod}), or set "
               f"spec.audit.fragmentation.remediation: RestartReplica")
    return AuditResult("AboveThreshold", worst.ratio, worst.pod, rec, tuple(replicas))


def can_restart(*, ready_replicas: int, desired_replicas: int, pdb_disruptions_allowed: int) -> tuple[bool, str]:
    """Restart only if the budget allows and the others can carry the load."""
    if pdb_disruptions_allowed < 1:
        return False, "the PodDisruptionBudget allows no disruption now"
    if ready_replicas < desired_replicas:
        return False, f"only {ready_replicas}/{desired_replicas} replicas ready"
    if ready_replicas < 2:
        return False, "it is the only ready replica; restarting it would drop all traffic"
    return True, "ok"
