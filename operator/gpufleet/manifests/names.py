"""Deterministic names and labels of everything the operator creates."""
from __future__ import annotations

import hashlib
import re

from gpufleet_api import v1alpha1 as t
from gpufleet_api.engine_pods import (
    ENGINE_APP,
    ENGINE_POD_LABELS,
    ENGINE_PORT,
    GUARD_PORT,
    LABEL_NAME,
    LABEL_REVISION,
    LABEL_ROLE,
    LABEL_SERVICE,
    ROLES,
    Role,
    engine_pods_selector,
    label_selector,
)

__all__ = ["ENGINE_APP", "ENGINE_POD_LABELS", "ENGINE_PORT", "GUARD_PORT", "LABEL_NAME", "LABEL_REVISION", "LABEL_ROLE",
           "LABEL_SERVICE", "engine_pods_selector", "label_selector"]  # the API's, for the manifests' one import

LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MODEL = "gpufleet.dev/model"
LABEL_ISOLATION = "gpufleet.dev/isolation"
LABEL_POOL = "gpufleet.dev/node-pool"
# On a canary's pods (spec.rollout Canary): canary; its Deployment's selector adds it.
LABEL_TRACK = "gpufleet.dev/track"
TRACK_CANARY = "canary"
ANNOTATION_CONFIG_HASH = "gpufleet.dev/config-hash"
ANNOTATION_AUDIT_REQUEST = "gpufleet.dev/audit-requested"
# Kubernetes' own: on the replica a scale-in means to remove (``fleet.scale_in_marks``).
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MANAGER = "gpufleet"


def deployment_name(service: str, role: Role = "unified") -> str:
    """``<service>-engine`` for the unified pool; ``<service>-prefill``, ``<service>-decode`` for the pools
    of a disaggregated service."""
    return f"{service}-engine" if role == "unified" else f"{service}-{role}"


def deployment_names(service: str) -> tuple[str, ...]:
    """Every Deployment name a service may have had, whatever its shape."""
    return tuple(deployment_name(service, role) for role in ROLES)


def canary_deployment_name(service: str) -> str:
    """The Deployment of a unified service's canary revision (spec.rollout Canary)."""
    return f"{service}-canary"


# The guard ConfigMap's key the canary's pods read: the new revision's whole guard.json, while
# guard.json keeps the stable's restart fields (its pods were started with them).
CANARY_CONFIG_KEY = "guard-canary.json"


def guard_config_key(role: Role = "unified") -> str:
    """The guard ConfigMap's key (and the file in the pod) of a pool's ``guard.json``."""
    return "guard.json" if role == "unified" else f"guard-{role}.json"


def service_name(service: str) -> str:
    return service


def configmap_name(service: str) -> str:
    return f"{service}-guard"


def pdb_name(service: str, role: Role = "unified") -> str:
    """A pool's PodDisruptionBudget: named as its Deployment (the unified pool's is ``<service>-engine``,
    as before budgets were per pool, so an upgrade replaces it in place)."""
    return deployment_name(service, role)


def pdb_names(service: str) -> tuple[str, ...]:
    """Every PodDisruptionBudget name a service may have had, whatever its shape."""
    return tuple(pdb_name(service, role) for role in ROLES)


def podmonitor_name(service: str) -> str:
    return f"{service}-engine"


def networkpolicy_name(service: str) -> str:
    return f"{service}-engine"


def inference_pool_name(service: str) -> str:
    """spec.gateway's InferencePool: the name an HTTPRoute's backendRef gives."""
    return service


def http_route_name(service: str) -> str:
    return service


def kv_store_claim_name(service: str) -> str:
    return f"{service}-kv-store"


def model_cache_claim_name(service: str) -> str:
    return f"{service}-model-cache"


def model_label(model: str) -> str:
    """A label value identifying a model (ids hold '/', ':' and can exceed 63 chars)."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-_.")[:50].strip("-_.")
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{clean}-{digest}" if clean else digest


def selector_labels(service: str) -> dict[str, str]:
    """Every engine pod of the service, whatever its pool."""
    return {LABEL_NAME: ENGINE_APP, LABEL_SERVICE: service}


def pool_labels(service: str, role: Role = "unified") -> dict[str, str]:
    """The engine pods of one pool: the Deployment's selector. The unified pool's is the service's own
    (a Deployment's selector cannot change, so existing services keep theirs)."""
    return selector_labels(service) if role == "unified" else {**selector_labels(service), LABEL_ROLE: role}


def common_labels(service: str) -> dict[str, str]:
    return {LABEL_NAME: ENGINE_APP, LABEL_INSTANCE: service, LABEL_MANAGED_BY: MANAGER,
            LABEL_SERVICE: service, "app.kubernetes.io/part-of": "gpufleet"}


def canary_labels(service: str) -> dict[str, str]:
    """The canary Deployment's selector: the service's engine pods of the canary track."""
    return {**selector_labels(service), LABEL_TRACK: TRACK_CANARY}


def selector_string(service: str) -> str:
    return label_selector(selector_labels(service))


def owner_reference(isvc: dict) -> dict:
    meta = isvc["metadata"]
    return {"apiVersion": t.API_VERSION, "kind": t.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def endpoint(service: str, namespace: str) -> str:
    return f"http://{service_name(service)}.{namespace}.svc:80/v1"
