"""Every child object of one InferenceService, as it should be."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from gpufleet_api.guard.control_auth import ControlAuthConfig
from gpufleet_api.guard.guard_config import ROLES, GuardConfig, Role
from gpufleet_api.v1alpha1 import InferenceServiceSpec

from ..manifests import children, kv_transfer, model_cache, names, pools
from ..manifests.network_policy import EngineIngress, build_network_policy
from . import drains


@dataclasses.dataclass(frozen=True)
class CanaryChildren:
    """What a canary (spec.rollout Canary, ``rollout.steps.plan``) changes in the children.

    ``stable_template``: the live stable Deployment's pod template, kept (None: the spec's);
    ``stable_running``: the guard.json its pods run (guard.json keeps its restart fields);
    ``canary_replicas``: of ``<service>-canary`` (None: no canary Deployment); ``canary_key``:
    write ``guard-canary.json`` (a canary runs, or its pods still drain); ``promoting``: the stable
    rolls with maxSurge 0 / maxUnavailable 1 (the canary carries the traffic at full size)."""
    stable_template: dict | None = None
    stable_running: GuardConfig | None = None
    canary_replicas: int | None = None
    canary_key: bool = False
    promoting: bool = False


PROMOTION_STRATEGY = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def spec_revision(isvc: dict, spec: InferenceServiceSpec) -> str:
    """The revision (``names.LABEL_REVISION``) of the unified pool's template the spec asks for."""
    _, hashes = children.build_configmap(isvc, spec)
    dep = children.build_deployment(isvc, spec, 0, hashes["unified"])
    return dep["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION]


def desired_children(isvc: dict, spec: InferenceServiceSpec, replicas: Mapping[Role, int], *,
                     with_podmonitor: bool, podmonitor_labels: Mapping[str, str] | None = None,
                     engine_ingress: EngineIngress | None = None,
                     draining_roles: Iterable[Role] = (), surge: drains.Surge | None = None,
                     canary: CanaryChildren | None = None, allow_private_sources: bool = False,
                     control_auth: ControlAuthConfig | None = None, otlp_endpoint: str = "") -> list[dict]:
    """``replicas``: of each pool, by role (``replicas.desired_replicas``). ``engine_ingress``: who may
    reach the engines; None renders no NetworkPolicy. ``draining_roles``: pools of a shape the service
    left whose pods still run (``draining_roles``). ``surge``: pods on cordoned nodes, each of which
    adds a replica to its pool's Deployment but not to its budget's minAvailable (``drains``).
    ``canary``: a unified service's canary (None: none). ``allow_private_sources``: the operator's
    --adapter-private-sources, into guard.json. ``control_auth``: who the guards' control routes accept
    (``fleet.guard_identity``), into guard.json. ``otlp_endpoint``: the fleet's OTLP receiver, into guard.json."""
    canary = canary or CanaryChildren()
    cm, config_hashes = children.build_configmap(isvc, spec, draining_roles, stable_running=canary.stable_running,
                                                 canary=canary.canary_key, allow_private_sources=allow_private_sources,
                                                 control_auth=control_auth, otlp_endpoint=otlp_endpoint)
    deployed = drains.with_surge(replicas, surge or drains.Surge())
    deployments = [children.build_deployment(isvc, pool.spec, deployed[pool.role], config_hashes[pool.role],
                                             pool.role) for pool in pools.pools(spec)]
    if spec.disaggregation is None:
        stable = deployments[0]
        if canary.stable_template is not None:
            stable["spec"]["template"] = canary.stable_template
        if canary.promoting:
            stable["spec"]["strategy"] = PROMOTION_STRATEGY
        if canary.canary_replicas is not None:
            deployments.append(children.build_deployment(isvc, spec, canary.canary_replicas,
                                                         config_hashes["unified"], track=names.TRACK_CANARY))
    objs = [cm, *deployments, children.build_service(isvc),
            *(children.build_pdb(isvc, pool.role, replicas[pool.role]) for pool in pools.pools(spec))]
    for claim in (model_cache.build_claim(isvc, spec), kv_transfer.build_claim(isvc, spec)):
        if claim is not None:
            objs.insert(0, claim)  # before the Deployments whose pods mount it
    if with_podmonitor:
        objs.append(children.build_podmonitor(isvc, spec, podmonitor_labels))
    if engine_ingress is not None:
        objs.append(build_network_policy(isvc, engine_ingress, kv_peers=kv_transfer.moves_kv_over_network(spec)))
    return objs


def stale_deployments(isvc: dict, spec: InferenceServiceSpec, deployments: list[dict]) -> list[dict]:
    """The Deployments of the service's other shape (``<service>-engine`` once it is disaggregated, its
    pools' once it is unified again), among ``deployments``: those this service owns and no longer wants."""
    service, uid = isvc["metadata"]["name"], isvc["metadata"].get("uid")
    wanted = {names.deployment_name(service, pool.role) for pool in pools.pools(spec)}
    return [d for d in deployments
            if d["metadata"]["name"] in set(names.deployment_names(service)) - wanted
            and any(ref.get("uid") == uid and ref.get("controller")
                    for ref in d["metadata"].get("ownerReferences") or [])]


def stale_budgets(isvc: dict, spec: InferenceServiceSpec, budgets: list[dict]) -> list[dict]:
    """The PodDisruptionBudgets of the service's other shape, among ``budgets``, that it owns."""
    service = isvc["metadata"]["name"]
    wanted = {names.pdb_name(service, pool.role) for pool in pools.pools(spec)}
    return [b for b in budgets
            if b["metadata"]["name"] in set(names.pdb_names(service)) - wanted and _owned(isvc, b)]


def _owned(isvc: dict, obj: dict) -> bool:
    uid = isvc["metadata"].get("uid")
    return any(ref.get("uid") == uid and ref.get("controller") for ref in obj["metadata"].get("ownerReferences") or [])


def draining_roles(pods: list[dict], spec: InferenceServiceSpec) -> set[Role]:
    """Roles of engine pods (``names.LABEL_ROLE``; none: unified) that the spec has no pool for: pods of
    the shape the service left, on their way out."""
    running = {(p["metadata"].get("labels") or {}).get(names.LABEL_ROLE, "unified") for p in pods}
    return {r for r in ROLES if r in running} - {pool.role for pool in pools.pools(spec)}
