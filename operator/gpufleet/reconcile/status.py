"""Status derived from what is observed (level-based, pure)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpufleet_api.guard.guard_config import Role
from gpufleet_api.v1alpha1 import InferenceServiceSpec

from ..manifests import names
from ..manifests.model_cache import FETCH_CONTAINER
from . import conditions as c
from .drains import Surge
from .drains import message as drains_message
from .ownership import CHILD_CONFLICT

# Scaling=False that operators before per-pool autoscaling wrote on a disaggregated service in Auto
# mode; replaced by True once read (``_scaling_condition``).
POOLS_NOT_AUTOSCALED = "PoolsNotAutoscaled"


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the API server shows about one InferenceService's children: the unified pool's
    Deployment, or (``pools``) a disaggregated service's Deployments by role, and every engine pod."""
    deployment: dict | None
    pods: list[dict]
    pools: Mapping[Role, dict | None] = dataclasses.field(default_factory=dict)

    def deployment_of(self, role: Role) -> dict | None:
        return self.deployment if role == "unified" else self.pools.get(role)


def unschedulable_pods(pods: list[dict]) -> list[tuple[str, str]]:
    """(pod name, scheduler message) for pods the scheduler cannot place."""
    out = []
    for p in pods:
        if p.get("metadata", {}).get("deletionTimestamp"):
            continue
        for cond in p.get("status", {}).get("conditions", []) or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                out.append((p["metadata"]["name"], cond.get("message", "")))
    return out


def crashlooping_pods(pods: list[dict]) -> list[str]:
    out = []
    for p in pods:
        st = p.get("status", {})
        # The model-fetch init container too: a download that keeps failing (gated repo, no network).
        for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
            if (cs.get("state", {}).get("waiting") or {}).get("reason") == "CrashLoopBackOff":
                out.append(p["metadata"]["name"])
                break
    return out


# Waiting reasons a kubelet gives for a container that cannot start until someone
# changes something (a Secret, an image name); retrying alone does not help.
BLOCKED_REASONS = ("CreateContainerConfigError", "CreateContainerError", "ErrImagePull", "ImagePullBackOff",
                   "InvalidImageName")


def blocked_pods(pods: list[dict]) -> list[tuple[str, str, str]]:
    """(pod name, waiting reason, kubelet message) for pods with a container that cannot start,
    e.g. a Secret the pod references does not exist."""
    out = []
    for p in pods:
        if p.get("metadata", {}).get("deletionTimestamp"):
            continue
        st = p.get("status", {})
        for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
            waiting = cs.get("state", {}).get("waiting") or {}
            if waiting.get("reason") in BLOCKED_REASONS:
                out.append((p["metadata"]["name"], waiting["reason"], waiting.get("message", "")))
                break
    return out


def downloading_pods(pods: list[dict]) -> list[tuple[str, str]]:
    """(pod name, since) for pods whose model-fetch init container is downloading the weights."""
    out = []
    for p in pods:
        if p.get("metadata", {}).get("deletionTimestamp"):
            continue
        for cs in p.get("status", {}).get("initContainerStatuses") or []:
            running = cs.get("state", {}).get("running")
            if cs.get("name") == FETCH_CONTAINER and running:
                out.append((p["metadata"]["name"], running.get("startedAt", "")))
    return out


def failed_downloads(pods: list[dict]) -> list[tuple[str, str]]:
    """(pod name, the download's last words) for pods whose model-fetch init container failed and is
    retried (a gated repository without a token, a revision that does not exist, no route to the Hub)."""
    out = []
    for p in pods:
        if p.get("metadata", {}).get("deletionTimestamp"):
            continue
        for cs in p.get("status", {}).get("initContainerStatuses") or []:
            last = (cs.get("lastState") or {}).get("terminated") or {}
            if cs.get("name") == FETCH_CONTAINER and last.get("exitCode") not in (None, 0) \
                    and not (cs.get("state") or {}).get("running"):
                words = " ".join((last.get("message") or last.get("reason") or "").split())
                out.append((p["metadata"]["name"], words[-500:]))
    return out


def _deployment_counts(dep: dict | None) -> tuple[int, int, int, bool]:
    """(replicas, ready, updated, rollout observed) from a Deployment."""
    if not dep:
        return 0, 0, 0, False
    st = dep.get("status", {})
    observed = st.get("observedGeneration", 0) >= dep["metadata"].get("generation", 0)
    return st.get("replicas", 0), st.get("readyReplicas", 0), st.get("updatedReplicas", 0), observed


def _pool_status(observed: Observed, pool_desired: Mapping[Role, int]) -> list[dict]:
    """status.pools: each pool's replicas, from its Deployment."""
    out = []
    for role, want in pool_desired.items():
        replicas, ready, _, _ = _deployment_counts(observed.deployment_of(role))
        out.append({"role": role, "replicas": replicas, "readyReplicas": ready, "desiredReplicas": want})
    return out


def _scaling_condition(spec: InferenceServiceSpec, generation: int, current: dict | None) -> dict | None:
    """Scaling=True in place of the PoolsNotAutoscaled an older operator left: the autoscaler sizes
    every pool in Auto mode now (the fleet loop owns the condition from then on)."""
    if not current or current.get("reason") != POOLS_NOT_AUTOSCALED:
        return None
    if spec.disaggregation is None:
        return c.condition(c.SCALING, True, "UnifiedPool", "one unified pool again: the autoscaler sizes it "
                           "in Auto mode", generation=generation)
    if spec.autoscaling.mode == "Auto":
        return c.condition(c.SCALING, True, "PoolsAutoscaled", "the autoscaler sizes the prefill and decode "
                           "pools, each within its minReplicas..maxReplicas", generation=generation)
    return None


def derive_status(*, service: str, namespace: str, generation: int, spec: InferenceServiceSpec,
                  desired: int, observed: Observed, previous: dict,
                  pool_desired: Mapping[Role, int] | None = None, surge: Surge | None = None) -> dict:
    """Status fields, and under ``conditions`` the conditions reconcile owns as
    updates by type (the writer merges them over the freshest copy).

    ``pool_desired``: a disaggregated service's replicas by pool (``desired`` is their sum); its
    counts are the sums over ``observed.pools``, and it is ready only while every pool has a ready
    replica (a request needs a prefill and a decode pod). ``surge``: pods on cordoned nodes, whose
    replacements run beside them (Progressing=True, NodeDrain, until they are evicted)."""
    extra = surge.total if surge is not None else 0
    if pool_desired:
        counts = [_deployment_counts(observed.deployment_of(role)) for role in pool_desired]
        replicas, ready, updated = (sum(n[i] for n in counts) for i in range(3))
        rollout_seen = all(n[3] for n in counts)
        pool_rows = _pool_status(observed, pool_desired)
        serving = all(p["readyReplicas"] > 0 for p in pool_rows)
        ready_text = ", ".join(f"{p['role']} {p['readyReplicas']}/{p['desiredReplicas']}" for p in pool_rows)
    else:
        replicas, ready, updated, rollout_seen = _deployment_counts(observed.deployment)
        pool_rows, serving, ready_text = [], ready > 0, f"{ready}/{desired}"
    stuck = unschedulable_pods(observed.pods)
    blocked = blocked_pods(observed.pods)
    updates = []

    if not serving:
        if stuck:
            reason, msg = "Unschedulable", f"no replica can be placed: {stuck[0][1]}"
        elif blocked:
            reason, msg = "ContainersCannotStart", f"pod {blocked[0][0]}: {blocked[0][1]}: {blocked[0][2]}"
        elif desired == 0:
            reason, msg = "ScaledToZero", (
                "spec.replicas is 0" if spec.autoscaling.mode == "Manual" else
                f"no request for {spec.autoscaling.scale_to_zero_after_seconds}s (minReplicas 0); a request "
                f"through gpufleet router starts a replica and waits for it")
        elif failed := failed_downloads(observed.pods):
            reason, msg = "ModelDownloadFailed", (
                f"{ready_text} replicas ready; {FETCH_CONTAINER} of {failed[0][0]} failed and is retried: "
                f"{failed[0][1]}")
        elif downloading := downloading_pods(observed.pods):
            reason, msg = "DownloadingModel", (
                f"{ready_text} replicas ready; {len(downloading)} downloading the weights into the model cache "
                f"(init container {FETCH_CONTAINER} of {downloading[0][0]}, since {downloading[0][1]}; "
                f"kubectl logs {downloading[0][0]} -c {FETCH_CONTAINER} shows the files)")
        else:
            reason, msg = "EngineStarting", f"{ready_text} replicas ready; engines are loading the model"
        updates.append(c.condition(c.READY, False, reason, msg, generation=generation))
    elif ready < desired:
        updates.append(c.condition(c.READY, True, "PartiallyReady", f"{ready_text} replicas ready",
                                   generation=generation))
    else:
        updates.append(c.condition(c.READY, True, "AllReplicasReady", f"{ready_text} replicas ready",
                                   generation=generation))

    if stuck:
        updates.append(c.condition(c.PROGRESSING, False, "InsufficientCapacity",
                                   f"{len(stuck)} replica(s) unschedulable: {stuck[0][1]}",
                                   generation=generation))
    elif surge is not None and surge.total:
        updates.append(c.condition(c.PROGRESSING, True, "NodeDrain", drains_message(surge), generation=generation))
    elif not rollout_seen or updated < desired or replicas > desired + extra:
        updates.append(c.condition(c.PROGRESSING, True, "RollingOut",
                                   f"{updated}/{desired} replicas on the current revision",
                                   generation=generation))
    else:
        updates.append(c.condition(c.PROGRESSING, False, "RolloutComplete",
                                   f"all {desired} replicas on the current revision", generation=generation))

    if desired > 0 and ready < desired:
        why = f"{len(stuck)} unschedulable" if stuck else "not ready yet"
        updates.append(c.condition(c.DEGRADED, True, "ReplicasUnavailable",
                                   f"{desired - ready} of {desired} replicas unavailable ({why})",
                                   generation=generation))
    else:
        updates.append(c.condition(c.DEGRADED, False, "AsExpected", "", generation=generation))

    isolated = isolation_condition(spec, generation, c.get(previous.get("conditions"), c.ISOLATED))
    if isolated:
        updates.append(isolated)
    scaling = _scaling_condition(spec, generation, c.get(previous.get("conditions"), c.SCALING))
    if scaling:
        updates.append(scaling)

    return {
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "desiredReplicas": desired,
        "pools": pool_rows or None,  # None removes a disaggregated service's pools once it is unified
        "selector": names.selector_string(service),
        "endpoint": names.endpoint(service, namespace),
        "conditions": updates,
    }


def isolation_condition(spec: InferenceServiceSpec, generation: int, current: dict | None) -> dict | None:
    """What the spec promises about isolation, unless the isolation audit has
    verified what the nodes show (it says nothing about Shared services)."""
    if current and current.get("reason") not in ("Enforced", "SharedByRequest") and spec.isolation.mode != "Shared":
        return None
    if spec.isolation.mode == "Shared":
        return c.condition(c.ISOLATED, False, "SharedByRequest",
                           "isolation.mode is Shared: other models may run on the same nodes", generation=generation)
    return c.condition(c.ISOLATED, True, "Enforced",
                       f"{spec.isolation.mode}: required pod anti-affinity keeps other models off this service's "
                       f"nodes", generation=generation)


def invalid_status(*, generation: int, problems: list[str]) -> dict:
    msg = "; ".join(problems)
    return {
        "observedGeneration": generation,
        "conditions": [
            c.condition(c.READY, False, "InvalidSpec", msg, generation=generation),
            c.condition(c.PROGRESSING, False, "InvalidSpec", "fix the spec; nothing is rolled out until then",
                        generation=generation),
        ],
    }


CHILD_REJECTED = "ChildRejected"


def child_rejected_conditions(*, kind: str, name: str, message: str, generation: int) -> list[dict]:
    """A child the API server refuses (schema, admission policy, quota): the user
    has to change something, so say which object and what the server said."""
    msg = f"{kind} {name} rejected by the API server: {message}"
    return [
        c.condition(c.READY, False, CHILD_REJECTED, msg, generation=generation),
        c.condition(c.PROGRESSING, False, CHILD_REJECTED,
                    f"nothing newer is rolled out until {kind} {name} is accepted; change the spec (or the "
                    f"policy that refuses it)", generation=generation),
    ]


def rejected_for(status: dict, generation: int) -> bool:
    """This generation's children were refused, or not applied for a child's name another object holds
    (the condition outlives the reconcile that saw it)."""
    ready = c.get(status.get("conditions"), c.READY) or {}
    return ready.get("reason") in (CHILD_REJECTED, CHILD_CONFLICT) and ready.get("observedGeneration") == generation
