"""The router's own metrics (gpufleet_router_*), in a registry of its own.

Labels stay bounded: ``model`` is a served name of a service in the router's
scope, or "" for requests naming no known model (a request for a LoRA adapter
counts under its service's model, and under the adapter's name, an
InferenceAdapter in scope, in the ``adapter_*`` counters only); ``role`` is a pool
(table.ROLES); ``outcome``, ``reason`` and ``transfer_params`` come from the
fixed lists here and in policy/choice.py.

The tenants' usage (gpufleet_tenant_*, names and labels from gpufleet_api.tenants.usage) is counted by
namespace, service, model (the name the request asked for: a served model or an adapter in scope) and
tenant (a declared one, else "unknown": labels.tenant_label), so it is bounded by the declarations."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gpufleet_api.tenants import usage
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT

PREFIX = "gpufleet_router_"


class Outcome:
    OK = "ok"                    # the replica's answer went to the client (any 2xx)
    REJECTED = "rejected"        # a replica's 429/503 refusal passed on (after the one retry)
    INVALID = "invalid"          # a 4xx: the router's own (bad JSON, no model, unknown model, too large) or a guard's
    UNAVAILABLE = "unavailable"  # no replica became ready while it was held, or too many were held
    ERROR = "error"              # a replica failed (5xx, connection lost before any byte went out)
    CANCELLED = "cancelled"      # the client went away first


OUTCOMES = (Outcome.OK, Outcome.REJECTED, Outcome.INVALID, Outcome.UNAVAILABLE, Outcome.ERROR, Outcome.CANCELLED)
RETRY_REASONS = ("rejected", "connect_failed", "scale_out")


class Fallback:
    """Why a disaggregated request went to decode without a prefill (decode computes the prompt)."""
    NO_REPLICA = "no_prefill_replica"   # no prefill replica can take requests now
    REFUSED = "refused"                 # every prefill replica tried answered 429 or 503
    UNREACHABLE = "unreachable"         # no prefill replica tried could be connected to
    ERROR = "error"                     # a prefill replica answered another error, or an unreadable answer
    TIMEOUT = "timeout"                 # no prefill answer within --prefill-timeout-seconds


FALLBACK_REASONS = (Fallback.NO_REPLICA, Fallback.REFUSED, Fallback.UNREACHABLE, Fallback.ERROR, Fallback.TIMEOUT)


class TransferParams:
    """What a completed prefill handed to decode (the ``transfer_params`` label)."""
    RETURNED = "returned"   # kv_transfer_params from the prefill's answer (NIXL, LMCache)
    NONE = "none"           # none returned: the connector finds the KV by the prompt (shared storage)


TRANSFER_PARAMS = (TransferParams.RETURNED, TransferParams.NONE)


class Resumption:
    """What became of a stream whose replica broke off mid-answer (the ``outcome`` label)."""
    RESUMED = "resumed"   # another replica continued it: the client's stream completed
    REFUSED = "refused"   # not resumable faithfully (n > 1, logprobs, tools, ...) or switched off: error event
    FAILED = "failed"     # resumption tried and failed (no other replica, or --max-resumptions): error event


RESUMPTION_OUTCOMES = (Resumption.RESUMED, Resumption.REFUSED, Resumption.FAILED)
def _label_values(metric: MetricWrapperBase, label: str) -> set[str]:
    return {sample.labels[label] for family in metric.collect() for sample in family.samples
            if label in sample.labels}


def _label_pairs(metric: MetricWrapperBase, first: str, second: str) -> set[tuple[str, str]]:
    return {(sample.labels[first], sample.labels[second]) for family in metric.collect()
            for sample in family.samples if first in sample.labels and second in sample.labels}


_COLD_START_SECONDS = (1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# (namespace, tenant, limit, share in use) of every declared limit, read when /metrics is scraped.
LimitsInUse = Callable[[], Iterable[tuple[str, str, str, float]]]


class _LimitUsed(Collector):
    """The gauge of each tenant's limits in use, computed when scraped: a bucket refills between requests."""

    def __init__(self, source: Callable[[], LimitsInUse]):
        self.source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(usage.LIMIT_USED, "The share of each tenant's limit in use now (0..1; a "
                                   "tokens-per-minute budget in debt reads over 1).", labels=["namespace", "tenant",
                                                                                              "limit"])
        for namespace, tenant, limit, used in self.source()():
            family.add_metric([namespace, tenant, limit], used)
        yield family


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.limits_in_use: LimitsInUse = lambda: ()   # the fleet's tenancies set it
        self.requests = Counter(PREFIX + "requests", "Requests by model and outcome.", ["model", "outcome"],
                                registry=r)
        self.picks = Counter(PREFIX + "picks", "Replica choices by pool and reason (choice.py).",
                             ["model", "role", "reason"], registry=r)
        self.prefix_affinity_hits = Counter(
            PREFIX + "prefix_affinity_hits", "Requests with a prompt prefix key sent to a replica this router "
            "had sent at least half of its leading blocks to, and still remembers (a predicted prefix-cache "
            "hit).", ["model"], registry=r)
        self.prefix_keyed = Counter(PREFIX + "prefix_keyed_requests",
                                    "Requests whose prompt was long enough for a prefix key.", ["model"],
                                    registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent to a second replica of a pool after the first "
                               "refused (429) or could not be reached, before any byte went to the client.",
                               ["model", "role", "reason"], registry=r)
        self.loop_lag_seconds = Histogram(PREFIX + "event_loop_lag_seconds", "How much later than asked the "
                                          "router's event loop woke from a short sleep: seconds the router had no "
                                          "CPU (its connect and read timeouts fire that late).",
                                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=r)
        self.request_seconds = Histogram(PREFIX + "request_seconds", "From arrival to the answer's last byte.",
                                         ["model"], buckets=_SECONDS, registry=r)
        self.ttft_seconds = Histogram(PREFIX + "ttft_seconds", "Streamed answers: from arrival to the answer's first "
                                      "event sent to the client (holds, retries and a prefill included).",
                                      ["model"], buckets=_SECONDS, registry=r)
        self.replicas = Gauge(PREFIX + "replicas", "Replicas the router may send to (serving and ready by its "
                              "guard's last reading), by pool.", ["model", "role"], registry=r)
        # By service, not model: the operator reads this to scale a service up from zero.
        self.held = Gauge(PREFIX + "held_requests", "Requests waiting for a replica of a service that has none "
                          "ready (a cold start).", ["namespace", "service"], registry=r)
        self.held_total = Counter(PREFIX + "held", "Requests that found no ready replica and waited for one "
                                  "(a cold start), answered or not.", ["namespace", "service"], registry=r)
        self.cold_start_seconds = Histogram(PREFIX + "cold_start_seconds", "From the first request that found no "
                                            "ready replica to the first replica ready for it.",
                                            ["namespace", "service"],
                                            buckets=_COLD_START_SECONDS, registry=r)
        self.epp_pick_seconds = Histogram(PREFIX + "epp_pick_seconds", "The endpoint picker: from a request's whole "
                                          "body in to its destination (or its immediate answer) out.",
                                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                   0.1, 0.25, 1, 10, 120), registry=r)
        self.epp_answers = Counter(PREFIX + "epp_answers", "The endpoint picker's answers: routed (a destination), "
                                   "or the status of its immediate answer (400, 404, 413, 429, 503, ...).",
                                   ["answer"], registry=r)
        self.prefill_seconds = Histogram(PREFIX + "prefill_seconds", "Disaggregated requests: from the first "
                                         "send to a prefill replica to its answer, for prefills handed to decode.",
                                         ["model"], buckets=_SECONDS, registry=r)
        self.handoffs = Counter(PREFIX + "handoffs", "Disaggregated requests whose prefill answered and which went "
                                "to decode with its hand-off.", ["model", "transfer_params"], registry=r)
        self.prefill_fallbacks = Counter(PREFIX + "prefill_fallbacks", "Disaggregated requests sent to decode "
                                         "without a prefill (decode computes the prompt), by reason.",
                                         ["model", "reason"], registry=r)
        self.adapter_requests = Counter(PREFIX + "adapter_requests", "Requests naming a LoRA adapter (an "
                                        "InferenceAdapter in scope) as their model, answered or not.", ["model"],
                                        registry=r)
        self.adapter_not_loaded = Counter(PREFIX + "adapter_not_loaded", "Requests for a LoRA adapter that no "
                                          "ready replica of its service holds loaded, answered 503.", ["model"],
                                          registry=r)
        self.unknown_model_requests = Counter(PREFIX + "unknown_model_requests", "Requests naming a model that "
                                              "no service or adapter in scope serves, answered 404.", registry=r)
        self.resumed_streams = Counter(PREFIX + "resumed_streams", "Streamed answers whose replica broke off "
                                       "after the first byte went to the client, by what became of them "
                                       "(docs/resumption.md).", ["service", "outcome"], registry=r)
        self.resume_gap_seconds = Histogram(PREFIX + "resume_gap_seconds", "Resumed streams: from the break to "
                                            "the first event of the replica that continued the answer.",
                                            ["service"], buckets=_SECONDS, registry=r)
        self.revision_requests = Counter(PREFIX + "revision_requests", "Requests by the revision "
                                         "(gpufleet.dev/revision) of the replica first chosen for them; \"\" for "
                                         "replicas without the label.", ["model", "revision"], registry=r)
        self.body_budget_refusals = Counter(PREFIX + "body_budget_refusals", "Requests answered 503 because "
                                            "their body did not fit in --body-budget-bytes (the request-body "
                                            "bytes held at once).", registry=r)
        self.body_bytes_held = Gauge(PREFIX + "body_bytes_held", "Request-body bytes held now, counted in "
                                     "--body-budget-bytes.", registry=r)
        self.readings_failed = Counter(PREFIX + "readings_failed", "Guard /metrics reads that failed.",
                                       ["model"], registry=r)
        labels = list(usage.USAGE_LABELS)
        self.tenant_requests = Counter(usage.REQUESTS, "Requests forwarded to a replica, by tenant.", labels,
                                       registry=r)
        self.tenant_refusals = Counter(usage.REFUSALS, "Requests refused, by reason: the router's own (no valid "
                                       "identity, over a limit) and the guards' 429/503 passed on to the client.",
                                       [*labels, "reason"], registry=r)
        self.tenant_prompt_tokens = Counter(usage.PROMPT_TOKENS, "Prompt tokens of answered requests, as their "
                                            "usage told the client.", labels, registry=r)
        self.tenant_cached_prompt_tokens = Counter(usage.CACHED_PROMPT_TOKENS, "Of the prompt tokens, those found "
                                                   "in the prefix cache (vLLM's prompt_tokens_details).", labels,
                                                   registry=r)
        self.tenant_answer_tokens = Counter(usage.ANSWER_TOKENS, "Answer tokens of answered requests, as their "
                                            "usage told the client.", labels, registry=r)
        r.register(_LimitUsed(lambda: self.limits_in_use))

    @property
    def tenant_usage(self) -> tuple[Counter, ...]:
        return (self.tenant_requests, self.tenant_refusals, self.tenant_prompt_tokens,
                self.tenant_cached_prompt_tokens, self.tenant_answer_tokens)

    def prune(self, models: set[str], adapters: set[str], services: set[tuple[str, str]]) -> None:
        """Remove the label sets of models, adapters and services no longer in scope (fleet.py, as the table
        changes), so the label sets stay as many as what is served now. "" (requests naming no known model)
        stays."""
        keep_models = models | {""}
        by_model = (self.requests, self.picks, self.prefix_affinity_hits, self.prefix_keyed, self.retries,
                    self.request_seconds, self.ttft_seconds, self.replicas, self.prefill_seconds, self.handoffs,
                    self.prefill_fallbacks, self.revision_requests, self.readings_failed)
        for metric in by_model:
            for model in _label_values(metric, "model") - keep_models:
                metric.remove_by_labels({"model": model})
        for metric in (self.adapter_requests, self.adapter_not_loaded):
            for model in _label_values(metric, "model") - adapters:
                metric.remove_by_labels({"model": model})
        names = {service for _, service in services}
        for metric in (self.held, self.held_total, self.cold_start_seconds):
            for namespace, service in _label_pairs(metric, "namespace", "service") - services:
                metric.remove(namespace, service)
        for metric in (self.resumed_streams, self.resume_gap_seconds):
            for service in _label_values(metric, "service") - names:
                metric.remove_by_labels({"service": service})
        for metric in self.tenant_usage:
            for model in _label_values(metric, "model") - models - adapters:
                metric.remove_by_labels({"model": model})
            for namespace, service in _label_pairs(metric, "namespace", "service") - services:
                metric.remove_by_labels({"namespace": namespace, "service": service})

    def prune_tenants(self, declared: dict[str, frozenset[str]]) -> None:
        """Remove the usage series of tenants no longer declared in their namespace (``declared``: namespace
        -> its tenants; a namespace without tenancy keeps only "unknown")."""
        for metric in self.tenant_usage:
            for namespace, tenant in _label_pairs(metric, "namespace", "tenant"):
                if tenant != UNKNOWN_TENANT and tenant not in declared.get(namespace, frozenset()):
                    metric.remove_by_labels({"namespace": namespace, "tenant": tenant})

    def render(self) -> bytes:
        return generate_latest(self.registry)
