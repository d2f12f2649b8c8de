"""The fleet's view of an engine pod, as the pod watch keeps it (``handlers.engine_pod_changed``):
{name, ip, ready, deleting, marked, role, revision, track}, and what the loops read of it."""
from __future__ import annotations

from typing import Sequence

from gpufleet_api.guard.guard_config import Role

from ..autoscale.signals import ReplicaSample
from ..manifests.pools import POOL_ROLES


def readable_replicas(pods: list[dict]) -> list[dict]:
    """Replica views ({name, ip, ready, deleting, role}) that serve traffic and can be read."""
    return [p for p in pods if p["ready"] and p.get("ip") and not p["deleting"]]


def role_of(pod: dict) -> Role:
    return pod.get("role") or "unified"


def samples_by_role(ready: list[dict], samples: Sequence[ReplicaSample]) -> dict[Role, list[ReplicaSample]]:
    """The samples of a disaggregated service's ready replicas, by pool."""
    roles = {p["name"]: role_of(p) for p in ready}
    return {role: [s for s in samples if roles.get(s.pod) == role] for role in POOL_ROLES}
