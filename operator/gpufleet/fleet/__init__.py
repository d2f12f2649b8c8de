"""Fleet control loops that run beside reconciliation: per-service autoscaling
and fragmentation audits (one shared paced loop), and cluster-wide audits."""
from __future__ import annotations


def register_loops(runtime, audit_interval: float = 30.0, router_addresses: list[str] | None = None) -> None:
    """Enable the fleet loops on the operator runtime (started with it). ``router_addresses``:
    the routers to read held requests from; default: the gpufleet-router pods found by label."""
    from .cluster_audit import ClusterAuditor
    from .fleet_loop import FleetLoop
    from .router_demand import RouterDemand
    from .scrape import ReplicaReader

    runtime.reader = ReplicaReader()
    runtime.fleet = FleetLoop(runtime, interval=runtime.fleet_interval, leadership=runtime)
    auditor = ClusterAuditor(runtime, interval=audit_interval)

    async def service_loops(_rt) -> None:
        await runtime.fleet.run_forever()
    runtime.loops.append(service_loops)

    async def cluster_audits(_rt) -> None:
        await auditor.run_forever()
    runtime.loops.append(cluster_audits)

    demand = RouterDemand(runtime, interval=runtime.fleet_interval, addresses=router_addresses)

    async def router_demand(_rt) -> None:
        await demand.run_forever()
    runtime.loops.append(router_demand)
