"""What the operator puts on every engine pod and the router (and the operator's own watches) read back:
the labels that say which service, pool and revision a pod serves, and the ports of its guard and vLLM.
Defined once here; ``gpufleet.manifests.names`` writes them, ``gpufleet_router`` reads them."""
from __future__ import annotations

from .guard.guard_config import ROLES, Role

__all__ = ["DECODE", "ENGINE_APP", "ENGINE_PORT", "ENGINE_POD_LABELS", "GUARD_PORT", "LABEL_NAME", "LABEL_REVISION",
           "LABEL_ROLE", "LABEL_SERVICE", "PREFILL", "ROLES", "UNIFIED", "Role", "engine_pods_selector",
           "label_selector"]

LABEL_NAME = "app.kubernetes.io/name"
LABEL_SERVICE = "gpufleet.dev/service"
# On the engine pods of a disaggregated service: prefill or decode (absent on a unified service's pods).
LABEL_ROLE = "gpufleet.dev/role"
# On every engine pod: a 10-hex hash of what the replica serves (its pod template without this label).
LABEL_REVISION = "gpufleet.dev/revision"
ENGINE_APP = "gpufleet-engine"
ENGINE_POD_LABELS = {LABEL_NAME: ENGINE_APP}  # every engine pod of every service

GUARD_PORT = 8080   # the pod's one way in: the guard
ENGINE_PORT = 8000  # vLLM, on the pod's loopback only

# A pod's pool (the values of gpufleet.dev/role, and "unified" where the label is absent).
UNIFIED: Role = "unified"   # prefill and decode in one engine
PREFILL: Role = "prefill"
DECODE: Role = "decode"


def label_selector(labels: dict[str, str]) -> str:
    """Labels as a label selector string (``k=v,k=v``): every one must match."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def engine_pods_selector() -> str:
    """Every engine pod of every service (the router's and the operator's pod watches)."""
    return label_selector(ENGINE_POD_LABELS)
