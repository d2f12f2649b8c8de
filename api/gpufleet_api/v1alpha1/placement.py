"""spec.resources, spec.disaggregation and spec.isolation: what each replica gets, prefill and decode pools, and
which nodes a service may share."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..schema import rule
from .common import LABEL_VALUE, QUALIFIED_NAME, QUANTITY


class ResourceSpec(Model, frozen=True, kw_only=True):
    """What one replica needs."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!has(self.migProfile) || self.gpusPerReplica == 1",
             "resources.migProfile needs resources.gpusPerReplica: 1 (one MIG slice per replica)",
             field_path=".migProfile")]}
    gpus_per_replica: Annotated[int, Meta(description="Whole GPUs per replica (nvidia.com/gpu).", ge=1, le=16)] = 1
    gpu_product: Optional[Annotated[str, Meta(
        description="Required GPU product, matched against the node label "
                    "nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3).",
        **LABEL_VALUE)]] = None
    mig_profile: Optional[Annotated[str, Meta(
        description="Request a MIG slice instead of a whole GPU, e.g. 1g.10gb "
                    "(resource nvidia.com/mig-<profile>).",
        pattern=r"^[1-7]g\.[0-9]+gb$")]] = None
    cpu: Annotated[int | str, Meta(
        description="CPU request per replica (Kubernetes quantity).",
        extra_json_schema=QUANTITY)] = "4"
    memory: Annotated[int | str, Meta(
        description="Memory request and limit per replica (Kubernetes quantity).",
        extra_json_schema=QUANTITY)] = "32Gi"


class PoolSpec(Model, frozen=True, kw_only=True):
    """One pool of a disaggregated service: its replica bounds and, optionally, its own resources."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.minReplicas <= self.maxReplicas", "a pool's minReplicas must be at most its maxReplicas",
             field_path=".minReplicas")]}
    min_replicas: Annotated[int, Meta(description="Fewest replicas of the pool.", ge=1, le=1000)] = 1
    max_replicas: Annotated[int, Meta(description="Most replicas of the pool.", ge=1, le=1000)] = 4
    replicas: Optional[Annotated[int, Meta(
        description="Replicas when autoscaling.mode is Manual; unset: minReplicas. Ignored in Auto mode (the "
                    "autoscaler sizes the pool within minReplicas..maxReplicas).",
        ge=1, le=1000)]] = None
    resources: Optional[Annotated[ResourceSpec, Meta(
        description="What one replica of this pool needs, in place of spec.resources (all of it: fields "
                    "left out take their defaults, not spec.resources').")]] = None


class DisaggregationSpec(Model, frozen=True, kw_only=True):
    """Prefill and decode as separate pools: prefill pods compute prompts and hand their KV to decode pods
    through engine.kvTransfer, decode pods stream the answers. The router sends each request to a prefill
    pod, then to a decode pod; clients change nothing (docs/disaggregation.md)."""
    prefill: Annotated[PoolSpec, Meta(
        description="The prefill pool (Deployment <service>-prefill).")] = msgspec.field(default_factory=PoolSpec)
    decode: Annotated[PoolSpec, Meta(
        description="The decode pool (Deployment <service>-decode).")] = msgspec.field(default_factory=PoolSpec)
    ratio_policy: Annotated[Literal["None", "Bound"], Meta(
        description="Bound (autoscaling.mode Auto): the autoscaler keeps the decode pool within "
                    "ratioTolerancePercent of the prefill:decode ratio measured from the traffic "
                    "(status.prefillDecodeRatio) times the prefill pool's replicas, as far as the decode pool's "
                    "minReplicas..maxReplicas allow. None: each pool is sized by its own signals only.")] = "None"
    ratio_tolerance_percent: Annotated[int, Meta(
        description="With ratioPolicy Bound: how far, in percent, the decode pool may stray from the measured "
                    "ratio times the prefill replicas.",
        ge=0, le=100)] = 25


class Toleration(Model, frozen=True, kw_only=True):
    """A toleration added to the engine pods."""
    __schema__ = {"x_kubernetes_validations": [
        rule("has(self.key) || self.operator == 'Exists'",
             "a toleration without a key must have operator Exists (it then tolerates every taint)",
             field_path=".operator"),
        rule("self.operator != 'Exists' || !has(self.value) || self.value == ''",
             "a toleration with operator Exists takes no value", field_path=".value"),
        rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds applies only to effect NoExecute", field_path=".tolerationSeconds"),
    ]}
    key: Optional[Annotated[str, Meta(description="Taint key.", max_length=316, pattern=QUALIFIED_NAME)]] = None
    operator: Annotated[Literal["Exists", "Equal"], Meta(description="Exists or Equal.")] = "Equal"
    value: Optional[Annotated[str, Meta(description="Taint value (Equal).", **LABEL_VALUE)]] = None
    effect: Optional[Annotated[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"], Meta(
        description="Taint effect; empty matches all.")]] = None
    toleration_seconds: Optional[Annotated[int, Meta(
        description="For NoExecute: how long the pod stays after the taint appears.",
        ge=0)]] = None


class IsolationSpec(Model, frozen=True, kw_only=True):
    """How engine pods share nodes. Dedicated: no other model's pods on a node running this model.
    Exclusive: the whole node, no other GPU pod at all. Shared: opt-in co-location (models fight over
    memory bandwidth and PCIe; latency SLOs become unpredictable)."""
    mode: Annotated[Literal["Dedicated", "Exclusive", "Shared"], Meta(
        description="Dedicated, Exclusive or Shared.")] = "Dedicated"
    node_pool: Optional[Annotated[str, Meta(
        description="Schedule only onto nodes labelled gpufleet.dev/node-pool=<nodePool>.",
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", max_length=63)]] = None
    node_selector: Annotated[dict[str, str], Meta(
        description="Extra node labels the engine pods require.",
        max_length=32,
        extra_json_schema={
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "isolation.nodeSelector keys must be label keys: an optional DNS "
                                              "prefix and '/', then up to 63 letters, digits, '-', '_' or '.'")],
        },
    )] = msgspec.field(default_factory=dict)
    tolerations: Annotated[list[Toleration], Meta(
        description="Extra tolerations for the engine pods.",
        max_length=32)] = msgspec.field(default_factory=list)
