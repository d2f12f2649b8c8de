"""Every child object of one InferenceService, as it should be."""
from __future__ import annotations

from collections.abc import Mapping

from ..api.v1alpha1 import InferenceServiceSpec
from ..manifests import children, model_cache
from ..manifests.network_policy import EngineIngress, build_network_policy


def desired_children(isvc: dict, spec: InferenceServiceSpec, replicas: int, *,
                     with_podmonitor: bool, podmonitor_labels: Mapping[str, str] | None = None,
                     engine_ingress: EngineIngress | None = None) -> list[dict]:
    """``engine_ingress``: who may reach the engines; None renders no NetworkPolicy."""
    cm, config_hash = children.build_configmap(isvc, spec)
    objs = [cm, children.build_deployment(isvc, spec, replicas, config_hash),
            children.build_service(isvc), children.build_pdb(isvc)]
    claim = model_cache.build_claim(isvc, spec)
    if claim is not None:
        objs.insert(0, claim)  # before the Deployment whose pods mount it
    if with_podmonitor:
        objs.append(children.build_podmonitor(isvc, spec, podmonitor_labels))
    if engine_ingress is not None:
        objs.append(build_network_policy(isvc, engine_ingress))
    return objs
