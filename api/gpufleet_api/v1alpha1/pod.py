"""spec.pod: what of the engine pods a service may set (volumes, mounts, pull secrets, labels, annotations)."""
from __future__ import annotations

from typing import Annotated, Any, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..schema import rule
from .common import DNS_LABEL, DNS_SUBDOMAIN, LABEL_VALUE, QUALIFIED_NAME
from .engine import ADAPTER_CLAIM_VOLUME_PREFIX

# Volumes the engine pod has already; a volume of pod.volumes may not reuse their names.
RESERVED_VOLUMES = ["guard-config", "cache", "dshm", "model", "gpu-memory", "model-cache", "kv-store", "adapters",
                    "guard-admin"]


class LocalObjectReference(Model, frozen=True, kw_only=True):
    """A reference to an object in the InferenceService's namespace."""
    name: Annotated[str, Meta(description="Name of the object.", pattern=DNS_SUBDOMAIN, max_length=253)]


class VolumeMount(Model, frozen=True, kw_only=True):
    """Where the engine container mounts one of pod.volumes."""
    name: Annotated[str, Meta(description="Name of a volume in pod.volumes.", pattern=DNS_LABEL, max_length=63)]
    mount_path: Annotated[str, Meta(
        description="Absolute path inside the engine container.",
        pattern=r"^/.*", max_length=1024)]
    read_only: Annotated[bool, Meta(description="Mount read-only.")] = False
    sub_path: Optional[Annotated[str, Meta(
        description="Path inside the volume to mount instead of its root.",
        max_length=1024)]] = None


class PodSpec(Model, frozen=True, kw_only=True):
    """Settings of the engine pods that clusters ask for and gpufleet has no opinion on: private
    registries, cost labels, scheduling priority, extra volumes (tolerations are in isolation)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.volumeMounts.all(m, self.volumes.exists(v, v.name == m.name))",
             "every pod.volumeMounts[].name must name a volume in pod.volumes", field_path=".volumeMounts"),
    ]}
    labels: Annotated[dict[str, str], Meta(
        description="Labels added to the engine pods (gpufleet's own labels win on a clash).",
        max_length=32,
        extra_json_schema={
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "pod.labels keys must be label keys: an optional DNS prefix and '/', "
                                              "then up to 63 letters, digits, '-', '_' or '.'"),
                                         rule("self.all(k, !k.startsWith('gpufleet.dev/'))",
                                              "pod.labels keys under gpufleet.dev/ are gpufleet's own (isolation and "
                                              "the autoscaler find pods by them)")],
        },
    )] = msgspec.field(default_factory=dict)
    annotations: Annotated[dict[str, str], Meta(
        description="Annotations added to the engine pods (gpufleet's own win on a clash).",
        max_length=64,
        extra_json_schema={
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "pod.annotations keys must be annotation keys: an optional DNS prefix "
                                              "and '/', then up to 63 letters, digits, '-', '_' or '.'")],
        },
    )] = msgspec.field(default_factory=dict)
    image_pull_secrets: Annotated[list[LocalObjectReference], Meta(
        description="Secrets (type kubernetes.io/dockerconfigjson) the kubelet uses to pull the engine image from a "
                    "private registry.",
        max_length=16,
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )] = msgspec.field(default_factory=list)
    priority_class_name: Optional[Annotated[str, Meta(
        description="PriorityClass of the engine pods, so GPU serving preempts batch work rather than the reverse.",
        pattern=DNS_SUBDOMAIN, max_length=253)]] = None
    volumes: Annotated[list[Any], Meta(
        description="Extra pod volumes, each a Kubernetes Volume (name plus one source: secret, configMap, "
                    "persistentVolumeClaim, emptyDir, csi, ...), checked by the API server when the Deployment is "
                    f"applied. Names {', '.join(RESERVED_VOLUMES)} are gpufleet's.",
        max_length=16,
        extra_json_schema={
            "items": {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
                      "description": "A Kubernetes Volume (core/v1).",
                      "properties": {"name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63,
                                              "description": "Volume name, unique in the pod."}}},
            "x-kubernetes-validations": [
                   rule(f"self.all(v, !(v.name in {RESERVED_VOLUMES}))",
                        f"pod.volumes names {', '.join(RESERVED_VOLUMES)} are gpufleet's; choose another name"),
                   rule(f"self.all(v, !v.name.startsWith('{ADAPTER_CLAIM_VOLUME_PREFIX}'))",
                        f"pod.volumes names starting {ADAPTER_CLAIM_VOLUME_PREFIX} are gpufleet's (the claims "
                        "of engine.lora.adapterClaims); choose another name"),
               ],
        },
    )] = msgspec.field(default_factory=list)
    volume_mounts: Annotated[list[VolumeMount], Meta(
        description="Where the engine (vLLM) container mounts pod.volumes.",
        max_length=16)] = msgspec.field(default_factory=list)
