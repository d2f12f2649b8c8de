"""Deterministic names and labels of everything the operator creates."""
from __future__ import annotations

import hashlib
import re

from ..api import v1alpha1 as t

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_SERVICE = "gpufleet.dev/service"
LABEL_MODEL = "gpufleet.dev/model"
LABEL_ISOLATION = "gpufleet.dev/isolation"
LABEL_POOL = "gpufleet.dev/node-pool"
LABEL_ROLE = "gpufleet.dev/role"
ANNOTATION_CONFIG_HASH = "gpufleet.dev/config-hash"
ANNOTATION_AUDIT_REQUEST = "gpufleet.dev/audit-requested"
ENGINE_APP = "gpufleet-engine"
MANAGER = "gpufleet"

GUARD_PORT = 8080
ENGINE_PORT = 8000


def deployment_name(service: str) -> str:
    return f"{service}-engine"


def service_name(service: str) -> str:
    return service


def configmap_name(service: str) -> str:
    return f"{service}-guard"


def pdb_name(service: str) -> str:
    return f"{service}-engine"


def podmonitor_name(service: str) -> str:
    return f"{service}-engine"


def networkpolicy_name(service: str) -> str:
    return f"{service}-engine"


def model_cache_claim_name(service: str) -> str:
    return f"{service}-model-cache"


def model_label(model: str) -> str:
    """A label value identifying a model (ids hold '/', ':' and can exceed 63 chars)."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-_.")[:50].strip("-_.")
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{clean}-{digest}" if clean else digest


def selector_labels(service: str) -> dict[str, str]:
    return {LABEL_NAME: ENGINE_APP, LABEL_SERVICE: service}


def common_labels(service: str) -> dict[str, str]:
    return {LABEL_NAME: ENGINE_APP, LABEL_INSTANCE: service, LABEL_MANAGED_BY: MANAGER,
            LABEL_SERVICE: service, "app.kubernetes.io/part-of": "gpufleet"}


def selector_string(service: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(service).items())


def owner_reference(isvc: dict) -> dict:
    meta = isvc["metadata"]
    return {"apiVersion": t.API_VERSION, "kind": t.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def endpoint(service: str, namespace: str) -> str:
    return f"http://{service_name(service)}.{namespace}.svc:80/v1"
