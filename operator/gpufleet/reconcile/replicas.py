"""How many replicas each pool's Deployment should have right now."""
from __future__ import annotations

from gpufleet_api.guard.guard_config import Role
from gpufleet_api.v1alpha1 import InferenceServiceSpec

from ..manifests import pools


def target_replicas(spec: InferenceServiceSpec, status: dict) -> int:
    """The unified pool's replicas."""
    auto = spec.autoscaling
    if auto.mode == "Manual":
        return spec.replicas if spec.replicas is not None else auto.min_replicas
    # Auto: the autoscaler's last decision, kept inside the current bounds.
    wanted = status.get("desiredReplicas")
    if wanted is None:
        wanted = auto.min_replicas
    return max(auto.min_replicas, min(auto.max_replicas, wanted))


def desired_replicas(spec: InferenceServiceSpec, status: dict) -> dict[Role, int]:
    """Replicas of each pool, by role. A disaggregated service's pools in Manual mode: each pool's
    replicas (default its minReplicas). In Auto mode the autoscaler does not size pools yet: each
    keeps the replicas last wanted for it (status.pools), kept inside its current bounds."""
    if spec.disaggregation is None:
        return {"unified": target_replicas(spec, status)}
    last = {p.get("role"): p.get("desiredReplicas") for p in status.get("pools") or []}
    out: dict[Role, int] = {}
    for pool in pools.pools(spec):
        bounds = pool.bounds
        assert bounds is not None  # a disaggregated service's pools have their own
        if spec.autoscaling.mode == "Manual":
            out[pool.role] = bounds.replicas if bounds.replicas is not None else bounds.min_replicas
        else:
            wanted = last.get(pool.role)
            wanted = bounds.min_replicas if wanted is None else wanted
            out[pool.role] = max(bounds.min_replicas, min(bounds.max_replicas, wanted))
    return out
