"""Fleet control loops that run beside reconciliation: per-service autoscaling
and fragmentation audits (kopf daemons), and cluster-wide audits."""
from __future__ import annotations


def register_loops(runtime, audit_interval: float = 30.0) -> None:
    """Enable the fleet loops on the operator runtime (started with it)."""
    from .cluster_audit import ClusterAuditor
    from .scrape import ReplicaReader

    runtime.reader = ReplicaReader()
    runtime.fleet_enabled = True
    auditor = ClusterAuditor(runtime, interval=audit_interval)

    async def cluster_audits(_rt) -> None:
        await auditor.run_forever()
    runtime.loops.append(cluster_audits)
