"""The pod-deletion-cost mark on the replica a scale-in means to remove, and its clearing.

The autoscaler (``autoscaler.ServiceAutoscaler``) marks the least-loaded replica of a pool before it
lowers the pool's replica count: the ReplicaSet removes the pod with the lowest deletion cost first.
A replica that outlives its scale-in (the ReplicaSet took another, e.g. a not-ready one) has its
mark cleared, or it would be the next one removed however busy it is by then.
"""
from __future__ import annotations

import collections
import logging

from gpufleet_api.guard.guard_config import Role
from gpufleet_kit.kube.errors import ApiError

from ..manifests.names import ANNOTATION_DELETION_COST
from .pod_views import role_of
from .ports import ServicePorts

log = logging.getLogger(__name__)


class ScaleInMarks:
    def __init__(self, ports: ServicePorts, namespace: str, name: str):
        self.ports = ports
        self.ns, self.name = namespace, name
        # pod marked for scale-in -> (its pool, the pool's replica count it was marked for)
        self.removals: dict[str, tuple[Role, int]] = {}

    async def mark(self, pod: str, target: int, role: Role = "unified") -> None:
        """The ReplicaSet removes the pod with the lowest deletion cost first."""
        try:
            await self.ports.objects.merge_patch("v1", "Pod", pod, {"metadata": {"annotations": {
                ANNOTATION_DELETION_COST: "-1000"}}}, self.ns)
            self.removals[pod] = (role, target)
        except ApiError as e:
            log.warning("could not mark %s for scale-in: %s", pod, e)

    async def release_outlived(self, body: dict, pods: list[dict]) -> None:
        """Clear the mark on a replica that outlived its scale-in (the ReplicaSet took
        another, e.g. a not-ready one): left, it would make that replica the next one
        removed however busy it is by then. Counted per pool: each pool's ReplicaSet
        removes its own pods."""
        live = [p for p in pods if not p["deleting"]]
        names_live = {p["name"] for p in live}
        for name in [n for n in self.removals if n not in names_live]:
            del self.removals[name]  # removed as intended
        status = body.get("status") or {}
        wanted: dict[Role | None, int | None] = {"unified": status.get("desiredReplicas")}
        wanted.update({p.get("role"): p.get("desiredReplicas") for p in status.get("pools") or []})
        counts = collections.Counter(role_of(p) for p in live)
        for p in live:
            mark = self.removals.get(p["name"])
            if mark is None:
                target = wanted.get(role_of(p))
                if not p.get("marked") or target is None:
                    continue
                role = role_of(p)  # a mark from before a restart
            else:
                role, target = mark
            if counts[role] <= target:  # the scale-in is done and this one stayed
                await self.unmark(p["name"])

    async def release(self, role: Role) -> None:
        """Clear the pool's marks (a scale-out, or a scale-in with no replica to mark)."""
        for name in [n for n, (r, _) in self.removals.items() if r == role]:
            await self.unmark(name)

    async def unmark(self, pod: str) -> None:
        try:
            await self.ports.objects.merge_patch("v1", "Pod", pod,
                                                 {"metadata": {"annotations": {ANNOTATION_DELETION_COST: None}}},
                                                 self.ns)
        except ApiError as e:
            if e.status != 404:
                log.warning("could not clear the scale-in mark on %s: %s", pod, e)
                return
        self.removals.pop(pod, None)
