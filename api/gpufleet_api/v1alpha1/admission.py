"""spec.admission, spec.autoscaling, spec.monitoring, spec.audit and spec.slo: the guard's admission, the
autoscaler, monitoring and the service's objectives."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from ..schema import rule
from .common import DNS_LABEL, LABEL_VALUE, QUALIFIED_NAME


class QueueClass(Model, frozen=True, kw_only=True):
    """A request class of the guard's multi-level queue."""
    name: Annotated[str, Meta(
        description="Class name, selected by the x-gpufleet-class request header.",
        pattern=DNS_LABEL, max_length=32)]
    level: Annotated[int, Meta(description="Priority level: 1 is served before 2 before 3 (with aging).", ge=1, le=3)]
    max_queue_seconds: Annotated[int, Meta(
        description="Longest a request of this class waits before it is refused "
                    "(429 with Retry-After).",
        ge=1, le=3600)]


class RouteClass(Model, frozen=True, kw_only=True):
    """The class of one OpenAI route's requests."""
    route: Annotated[Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"], Meta(
        description="The route.")]
    default_class: Annotated[str, Meta(
        description="Class of the route's requests that send no class header; with "
                    "classHeaderPolicy LowerOnly also the highest priority the header may ask "
                    "for on this route.",
        pattern=DNS_LABEL, max_length=32)]


DEFAULT_QUEUE_CLASSES = [
    QueueClass(name="interactive", level=1, max_queue_seconds=2),
    QueueClass(name="standard", level=2, max_queue_seconds=10),
    QueueClass(name="background", level=3, max_queue_seconds=60),
]


class AdmissionSpec(Model, frozen=True, kw_only=True):
    """The guard in front of the engine: what it admits, queues and refuses."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.routeClasses.all(r, self.queueClasses.exists(c, c.name == r.defaultClass))",
             "every admission.routeClasses[].defaultClass must name a class in admission.queueClasses",
             field_path=".routeClasses")]}
    kv_watermark_percent: Annotated[int, Meta(
        description="Share of KV blocks kept free in vLLM's reported view. A request "
                    "whose block cost would cross it gets HTTP 429 with Retry-After. The "
                    "guard also keeps a ledger of what admitted requests hold (see "
                    "reservation), so this margin only has to absorb what the guard cannot "
                    "see: metrics lag and requests that bypass it.",
        ge=0, le=90)] = 5
    reservation: Annotated[Literal["Predicted", "FullBudget"], Meta(
        description="KV blocks the guard reserves per admitted request. Predicted: the prompt plus "
                    "the output length learned from recent answers of the same route and class "
                    "(its mean, with one margin for all requests in flight at "
                    "reservationQuantilePercent), grown while an answer streams past it; the "
                    "full budget until 16 answers are known. FullBudget: the prompt plus max_tokens "
                    "(or the rest of the context), the worst case, which refuses traffic vLLM "
                    "alone serves when answers end early.")] = "Predicted"
    reservation_quantile_percent: Annotated[int, Meta(
        description="With reservation Predicted: the quantile at which the answers "
                    "of the requests in flight must together fit their "
                    "reservations and the ledger's margin (100 stands for 99.99).",
        ge=50, le=100)] = 90
    max_context_tokens: Optional[Annotated[int, Meta(
        description="Longest prompt + max_tokens accepted. Defaults to "
                    "model.maxModelLen.",
        ge=16)]] = None
    over_length_policy: Annotated[Literal["Reject", "TruncateLeft"], Meta(
        description="Reject answers 400 naming the token counts; TruncateLeft drops the "
                    "oldest prompt tokens.")] = "Reject"
    request_timeout_seconds: Annotated[int, Meta(
        description="Longest a request may run; also sets the pod's graceful "
                    "termination so draining replicas finish their requests.",
        ge=1, le=3600)] = 300
    max_concurrency: Annotated[int, Meta(
        description="Requests the guard lets into the engine at once.",
        ge=1, le=4096)] = 64
    ttft_control: Annotated[Literal["Objective", "Off"], Meta(
        description="Objective: while the replica is overloaded (more asked of it than its KV pool "
                    "holds at once), the guard lets fewer requests into the engine at once while "
                    "more would get their first token later than slo.ttftP99Milliseconds allows, and "
                    "answers 429 (ttft_limit) to those that would wait for a slot longer than the "
                    "objective leaves. Off: maxConcurrency is the only limit.")] = "Objective"
    queue_classes: Annotated[list[QueueClass], Meta(
        description="Request classes, served lowest level first with aging so none starves.",
        min_length=1, max_length=8,
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )] = msgspec.field(default_factory=lambda: list(DEFAULT_QUEUE_CLASSES))
    route_classes: Annotated[list[RouteClass], Meta(
        description="Default class per route. Routes left out: chat completions get the level-1 class, completions "
                    "the level-2 class (else level 1), embeddings the last level.",
        max_length=3,
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["route"],
        },
    )] = msgspec.field(default_factory=list)
    class_header_policy: Annotated[Literal["LowerOnly", "Trusted"], Meta(
        description="Which classes the x-gpufleet-class header may ask for. LowerOnly: the route's default class or "
                    "a lower priority (a higher level), so a client can yield priority but never take it; a header "
                    "asking for more gets 403. Trusted: any class; only for a gateway in front that sets the header "
                    "itself and drops the one clients send.")] = "LowerOnly"


class AutoscalingSpec(Model, frozen=True, kw_only=True):
    """Replica count driven by the engines' own signals (KV usage, shedding, queueing)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("self.minReplicas <= self.maxReplicas",
             "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas",
             field_path=".minReplicas"),
        rule("self.kvLowWatermarkPercent < self.kvHighWatermarkPercent",
             "autoscaling.kvLowWatermarkPercent must be below autoscaling.kvHighWatermarkPercent",
             field_path=".kvLowWatermarkPercent"),
    ]}
    mode: Annotated[Literal["Auto", "Manual"], Meta(
        description="Auto: the operator sets replicas from the engines' signals. Manual: spec.replicas "
                    "(or kubectl scale) sets them.")] = "Auto"
    min_replicas: Annotated[int, Meta(
        description="Fewest replicas. 0 (Auto mode): the service scales to zero after "
                    "scaleToZeroAfterSeconds without a request, and back to one when `gpufleet router` "
                    "holds a request for it (docs/router.md).",
        ge=0, le=1000)] = 1
    max_replicas: Annotated[int, Meta(description="Most replicas.", ge=1, le=1000)] = 4
    kv_high_watermark_percent: Annotated[int, Meta(
        description="Scale out when mean KV-cache usage exceeds this.",
        ge=1, le=100)] = 80
    kv_low_watermark_percent: Annotated[int, Meta(
        description="Scale in when KV-cache usage stays below this for the "
                    "scale-down stabilization window.",
        ge=0, le=99)] = 40
    queue_depth_threshold: Annotated[int, Meta(
        description="Scale out when requests waiting per replica (guard + engine) "
                    "exceed this.",
        ge=1)] = 8
    queue_time_threshold_milliseconds: Annotated[int, Meta(
        description="Scale out when the guard's p90 queue time (every class, "
                    "requests dispatched in the last 30 s) exceeds this.",
        ge=1)] = 1000
    scale_up_stabilization_seconds: Annotated[int, Meta(
        description="Signals must stay high this long before scaling out.",
        ge=0, le=3600)] = 0
    scale_down_stabilization_seconds: Annotated[int, Meta(
        description="Signals must stay low this long before scaling in.",
        ge=0, le=86400)] = 300
    max_scale_up_step: Annotated[int, Meta(description="Most replicas added in one action.", ge=1, le=100)] = 2
    scale_to_zero_after_seconds: Annotated[int, Meta(
        description="With minReplicas 0: scale to zero after this long with no "
                    "request arriving and none in flight.",
        ge=30, le=604800)] = 600


class FragmentationAuditSpec(Model, frozen=True, kw_only=True):
    """GPU memory fragmentation audit, from inside the engine: the share of PyTorch's caching allocator's
    reserved memory held in inactive split blocks (docs/metrics.md)."""
    interval_seconds: Annotated[int, Meta(description="How often to audit.", ge=60, le=604800)] = 3600
    threshold_percent: Annotated[int, Meta(
        description="Fragmentation above this is reported (Event, condition, alert).",
        ge=1, le=100)] = 25
    remediation: Annotated[Literal["None", "RestartReplica"], Meta(
        description="None only reports; RestartReplica restarts a replica above the threshold whose "
                    "allocation retries or OOMs are rising (deletes its pod; the guard drains it first), "
                    "one at a time, when every desired replica is ready, no node drain is under way and "
                    "the other ready replicas have KV headroom for its load.")] = "None"
    restart_cooldown_seconds: Annotated[int, Meta(
        description="RestartReplica: at least this long between two restarts of the "
                    "service's replicas, and after the operator starts.",
        ge=300, le=604800)] = 3600


class MonitoringSpec(Model, frozen=True, kw_only=True):
    """How Prometheus finds the service's engines."""
    pod_monitor_labels: Annotated[dict[str, str], Meta(
        description="Labels for the PodMonitor of the engines, on top of those the operator is run with "
                    "(--podmonitor-label, the chart's monitoring.podMonitor.labels); a Prometheus selects PodMonitors "
                    "by label, kube-prometheus-stack by default only those labelled release=<its release>.",
        max_length=16,
        extra_json_schema={
            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": LABEL_VALUE["pattern"]},
            "x-kubernetes-validations": [rule(f"self.all(k, size(k) <= 316 && k.matches('{QUALIFIED_NAME}'))",
                                              "monitoring.podMonitorLabels keys must be label keys: an optional DNS "
                                              "prefix and '/', then up to 63 letters, digits, '-', '_' or '.'")],
        },
    )] = msgspec.field(default_factory=dict)


class AuditSpec(Model, frozen=True, kw_only=True):
    """Scheduled audits."""
    fragmentation: Annotated[FragmentationAuditSpec, Meta(
        description="Fragmentation audit.")] = msgspec.field(default_factory=FragmentationAuditSpec)


class SLOSpec(Model, frozen=True, kw_only=True):
    """Service level objectives; alerts and dashboards derive their thresholds from these."""
    ttft_p99_milliseconds: Annotated[int, Meta(description="Time-to-first-token p99 objective.", ge=1)] = 2000
    itl_p99_milliseconds: Annotated[int, Meta(description="Inter-token latency p99 objective.", ge=1)] = 100
    request_p99_milliseconds: Annotated[int, Meta(
        description="Latency p99 objective of non-streaming requests, whose whole "
                    "answer is their first token.",
        ge=1)] = 60000
    availability_percent: Annotated[str, Meta(
        description="Share of requests that must succeed: not answered with a 5xx, not "
                    "timed out, not refused for a queue timeout or an engine down "
                    "(client errors and HTTP 429 sheds do not count), e.g. \"99.9\"; below "
                    "100, or there is no error budget for the burn-rate alerts to measure "
                    "against.",
        pattern=r"^[1-9]?[0-9](\.[0-9]{1,3})?$")] = "99.9"
