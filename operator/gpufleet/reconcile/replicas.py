"""How many replicas the Deployment should have right now."""
from __future__ import annotations

from ..api.v1alpha1 import InferenceServiceSpec


def target_replicas(spec: InferenceServiceSpec, status: dict) -> int:
    auto = spec.autoscaling
    if auto.mode == "Manual":
        return spec.replicas if spec.replicas is not None else auto.min_replicas
    # Auto: the autoscaler's last decision, kept inside the current bounds.
    wanted = status.get("desiredReplicas")
    if wanted is None:
        wanted = auto.min_replicas
    return max(auto.min_replicas, min(auto.max_replicas, wanted))
