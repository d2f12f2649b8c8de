"""Every child object of one InferenceService, as it should be."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpufleet_engine.contract.guard_config import ROLES, Role

from ..api.v1alpha1 import InferenceServiceSpec
from ..manifests import children, kv_transfer, model_cache, names, pools
from ..manifests.network_policy import EngineIngress, build_network_policy


def desired_children(isvc: dict, spec: InferenceServiceSpec, replicas: Mapping[Role, int], *,
                     with_podmonitor: bool, podmonitor_labels: Mapping[str, str] | None = None,
                     engine_ingress: EngineIngress | None = None,
                     draining_roles: Iterable[Role] = ()) -> list[dict]:
    """``replicas``: of each pool, by role (``replicas.desired_replicas``). ``engine_ingress``: who may
    reach the engines; None renders no NetworkPolicy. ``draining_roles``: pools of a shape the service
    left whose pods still run (``draining_roles``)."""
    cm, config_hashes = children.build_configmap(isvc, spec, draining_roles)
    objs = [cm, *(children.build_deployment(isvc, pool.spec, replicas[pool.role], config_hashes[pool.role], pool.role)
                  for pool in pools.pools(spec)),
            children.build_service(isvc), children.build_pdb(isvc)]
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


def draining_roles(pods: list[dict], spec: InferenceServiceSpec) -> set[Role]:
    """Roles of engine pods (``names.LABEL_ROLE``; none: unified) that the spec has no pool for: pods of
    the shape the service left, on their way out."""
    running = {(p["metadata"].get("labels") or {}).get(names.LABEL_ROLE, "unified") for p in pods}
    return {r for r in ROLES if r in running} - {pool.role for pool in pools.pools(spec)}
