"""Node drains: a replacement for every engine pod on a cordoned node, started before it is evicted.

``kubectl drain`` cordons a node (spec.unschedulable) and then evicts its pods. Each pool's
PodDisruptionBudget has minAvailable = the pool's desired replicas (``manifests.children.build_pdb``),
so an eviction waits until the pool has a Ready replica more than it wants. This module decides that
surplus: each pool's Deployment gets one replica more per pod of the pool that sits on a cordoned node
and is not terminating yet. The ReplicaSet starts the replacements on other nodes (the scheduler skips
cordoned ones); once one is Ready the budget allows the eviction, the guard's preStop drain finishes
the old pod's requests, and when the old pod is terminating the surge drops back.

The surge is not the autoscaler's capacity: status.desiredReplicas stays what was decided, and the
autoscaler does not scale in while a surge is under way (``autoscale.drain_hold``). Pure, apart from
``CordonIndex``, the memory the node watch keeps (no I/O).
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping

from gpufleet_api.guard.guard_config import Role

from ..manifests import names

FIELD = "drain"  # status.drain


@dataclasses.dataclass(frozen=True)
class Surge:
    """Engine pods on cordoned nodes (not terminating), by pool, and those nodes."""
    pods: Mapping[Role, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    nodes: tuple[str, ...] = ()

    def replicas(self, role: Role) -> int:
        """Replicas to add to the pool's Deployment."""
        return len(self.pods.get(role, ()))

    @property
    def total(self) -> int:
        return sum(len(p) for p in self.pods.values())

    def pod_names(self) -> list[str]:
        return sorted(p for pods in self.pods.values() for p in pods)


def role_of(pod: dict) -> Role:
    return (pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE, "unified")


def node_names(pods: Iterable[dict]) -> set[str]:
    """Nodes running pods that a cordon would make the surge count (the nodes to look up)."""
    return {p["spec"]["nodeName"] for p in pods if _counts(p) and p.get("spec", {}).get("nodeName")}


def _counts(pod: dict) -> bool:
    """A pod a drain would still have to evict: not terminating, not finished, not a canary's (its
    Deployment is not a pool's)."""
    meta = pod["metadata"]
    return (not meta.get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and (meta.get("labels") or {}).get(names.LABEL_TRACK) != "canary")


def surge(pods: Iterable[dict], cordoned: set[str]) -> Surge:
    """``pods``: the service's engine pods; ``cordoned``: names of unschedulable nodes."""
    by_role: dict[Role, list[str]] = collections.defaultdict(list)
    nodes: set[str] = set()
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node in cordoned and _counts(p):
            by_role[role_of(p)].append(p["metadata"]["name"])
            nodes.add(node)
    return Surge({role: tuple(sorted(ps)) for role, ps in by_role.items()}, tuple(sorted(nodes)))


def with_surge(replicas: Mapping[Role, int], s: Surge) -> dict[Role, int]:
    """Each pool's Deployment replicas: its desired replicas plus its pods on cordoned nodes."""
    return {role: n + s.replicas(role) for role, n in replicas.items()}


def status(s: Surge) -> dict | None:
    """status.drain: what the surge is for; None (removes the field) when there is none."""
    if not s.total:
        return None
    return {"replicas": s.total, "nodes": list(s.nodes), "pods": s.pod_names(), "message": message(s)}


def message(s: Surge) -> str:
    return (f"{s.total} replacement replica(s) for {', '.join(s.pod_names())} on cordoned node(s) "
            f"{', '.join(s.nodes)}; each is evicted (kubectl drain) once a replacement is Ready")


def changed(previous: dict | None, s: Surge) -> bool:
    """Whether the surge differs from the one status.drain recorded (the Deployments need applying)."""
    return sorted((previous or {}).get("pods") or []) != s.pod_names()


def surging(status_: Mapping) -> bool:
    """A surge is under way (status.drain): the autoscaler does not scale in, nor does remediation restart."""
    return bool((status_.get(FIELD) or {}).get("replicas"))


class CordonIndex:
    """Which nodes are cordoned and which services run engine pods on them, as the watches last showed
    them; fed by the node and engine pod watches, read by the reconciler."""

    def __init__(self) -> None:
        self._cordoned: dict[str, bool] = {}
        self._node_of: dict[tuple[str, str], str] = {}  # (namespace, pod) -> node
        self._on: dict[str, dict[tuple[str, str], str]] = {}  # node -> (namespace, pod) -> service

    def cordoned(self, node: str) -> bool | None:
        """None: the node watch has not shown it yet."""
        return self._cordoned.get(node)

    def node_seen(self, node: str, unschedulable: bool | None) -> bool:
        """``unschedulable`` None: the node is gone. True when the services on it need a look: its cordon
        changed, or it is cordoned and was not known (a node first listed after the operator started
        uncordoned needs none: its services' own first reconcile reads it)."""
        if unschedulable is None:
            self._cordoned.pop(node, None)
            return False
        before = self._cordoned.get(node)
        self._cordoned[node] = unschedulable
        return before != unschedulable and (before is not None or unschedulable)

    def pod_seen(self, namespace: str, service: str, pod: str, node: str | None) -> None:
        """``node`` None: the pod is gone or not scheduled yet."""
        key = (namespace, pod)
        old = self._node_of.pop(key, None)
        if old is not None:
            self._on.get(old, {}).pop(key, None)
            if not self._on.get(old):
                self._on.pop(old, None)
        if node:
            self._node_of[key] = node
            self._on.setdefault(node, {})[key] = service

    def services_on(self, node: str) -> set[tuple[str, str]]:
        """(namespace, service) of every engine pod on ``node``."""
        return {(ns, svc) for (ns, _), svc in self._on.get(node, {}).items()}
