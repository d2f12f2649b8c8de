"""The operator's own metrics (names in docs/metrics.md), on an injectable registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .manifests.pools import replica_bounds

SVC = ("namespace", "service")


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconcile_total = Counter("gpufleet_reconcile_total", "Reconciliations.", ["kind", "result"], registry=r)
        self.reconcile_errors = Counter("gpufleet_reconcile_errors_total", "Failed reconciliations.", SVC, registry=r)
        self.reconcile_seconds = Histogram("gpufleet_reconcile_duration_seconds", "Reconcile latency.", registry=r,
                                           buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.desired_replicas = Gauge("gpufleet_service_desired_replicas", "Replicas wanted.", SVC, registry=r)
        self.ready_replicas = Gauge("gpufleet_service_ready_replicas", "Ready replicas.", SVC, registry=r)
        self.min_replicas = Gauge("gpufleet_service_min_replicas",
                                  "autoscaling.minReplicas (a disaggregated service: its pools' sum).", SVC, registry=r)
        self.max_replicas = Gauge("gpufleet_service_max_replicas",
                                  "autoscaling.maxReplicas (a disaggregated service: its pools' sum).", SVC, registry=r)
        self.kv_usage = Gauge("gpufleet_service_kv_usage_ratio", "Mean KV-cache usage of ready replicas.", SVC,
                              registry=r)
        self.kv_high = Gauge("gpufleet_service_kv_high_watermark_ratio", "Scale-out watermark.", SVC, registry=r)
        self.kv_low = Gauge("gpufleet_service_kv_low_watermark_ratio", "Scale-in watermark.", SVC, registry=r)
        self.slo_ttft = Gauge("gpufleet_service_slo_ttft_p99_seconds", "TTFT p99 objective.", SVC, registry=r)
        self.slo_itl = Gauge("gpufleet_service_slo_itl_p99_seconds", "ITL p99 objective.", SVC, registry=r)
        self.slo_request = Gauge("gpufleet_service_slo_request_p99_seconds",
                                 "Non-streaming request latency p99 objective.", SVC, registry=r)
        self.slo_availability = Gauge("gpufleet_service_slo_availability_ratio", "Availability objective.", SVC,
                                      registry=r)
        self.decisions = Counter("gpufleet_autoscaler_decisions_total", "Scaling actions.", SVC + ("direction",),
                                 registry=r)
        self.read_errors = Counter("gpufleet_metrics_read_errors_total", "Failed replica metric reads.", SVC,
                                   registry=r)
        self.fragmentation = Gauge("gpufleet_fragmentation_ratio", "Worst replica fragmentation.", SVC, registry=r)
        self.fragmentation_threshold = Gauge("gpufleet_fragmentation_threshold_ratio", "Audit threshold.", SVC,
                                             registry=r)
        self.stranded = Gauge("gpufleet_stranded_gpus", "Free GPUs no InferenceService can use.",
                              ["node_pool", "gpu_product"], registry=r)
        self.gpus_per_replica = Gauge("gpufleet_service_gpus_per_replica", "GPUs one replica requests.", SVC,
                                      registry=r)
        self.crashlooping = Gauge("gpufleet_service_crashlooping_replicas",
                                  "Engine pods with a container in CrashLoopBackOff.", SVC, registry=r)
        self.leader = Gauge("gpufleet_operator_leader",
                            "1 while this replica holds the leader lease and acts, 0 while it follows.", registry=r)
        self.leader_transitions = Counter("gpufleet_operator_leader_transitions_total",
                                          "Changes of this replica's leadership: acquired, lost (renewal "
                                          "failed), released (shut down).", ["transition"], registry=r)
        self.isolation_violations = Gauge("gpufleet_isolation_violations", "Foreign pods on reserved nodes.", SVC,
                                          registry=r)
        self.api_requests = Counter("gpufleet_operator_api_requests_total",
                                    "Requests this replica's client made to the API server (kopf's watches aside), "
                                    "by verb, resource and answer code (0: no answer).", ["verb", "resource", "code"],
                                    registry=r)

    def api_request(self, verb: str, resource: str, code: int) -> None:
        self.api_requests.labels(verb, resource, str(code)).inc()

    def set_spec_gauges(self, namespace: str, service: str, spec) -> None:
        lbl = (namespace, service)
        fewest, most = replica_bounds(spec)  # a disaggregated service's: the sums over its pools
        self.min_replicas.labels(*lbl).set(fewest)
        self.max_replicas.labels(*lbl).set(most)
        self.kv_high.labels(*lbl).set(spec.autoscaling.kv_high_watermark_percent / 100)
        self.kv_low.labels(*lbl).set(spec.autoscaling.kv_low_watermark_percent / 100)
        self.slo_ttft.labels(*lbl).set(spec.slo.ttft_p99_milliseconds / 1000)
        self.slo_itl.labels(*lbl).set(spec.slo.itl_p99_milliseconds / 1000)
        self.slo_request.labels(*lbl).set(spec.slo.request_p99_milliseconds / 1000)
        self.slo_availability.labels(*lbl).set(float(spec.slo.availability_percent) / 100)
        self.fragmentation_threshold.labels(*lbl).set(spec.audit.fragmentation.threshold_percent / 100)
        self.gpus_per_replica.labels(*lbl).set(spec.resources.gpus_per_replica)

    def forget_service(self, namespace: str, service: str) -> None:
        for m in (self.desired_replicas, self.ready_replicas, self.min_replicas, self.max_replicas, self.kv_usage,
                  self.kv_high, self.kv_low, self.slo_ttft, self.slo_itl, self.slo_request,
                  self.slo_availability, self.fragmentation, self.fragmentation_threshold, self.isolation_violations,
                  self.reconcile_errors, self.read_errors, self.gpus_per_replica, self.crashlooping):
            try:
                m.remove(namespace, service)
            except KeyError:
                pass
