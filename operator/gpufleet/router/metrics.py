"""The router's own metrics (gpufleet_router_*), in a registry of its own.

Labels stay bounded: ``model`` is a served name of a service in the router's
scope, or "" for requests naming no known model; ``outcome`` and ``reason``
come from the fixed lists here."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
_COLD_START_SECONDS = (1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests by model and outcome.", ["model", "outcome"],
                                registry=r)
        self.picks = Counter(PREFIX + "picks", "Replica choices by reason (choice.py).", ["model", "reason"],
                             registry=r)
        self.prefix_affinity_hits = Counter(
            PREFIX + "prefix_affinity_hits", "Requests with a prompt prefix key sent to a replica this router "
            "had sent at least half of its leading blocks to, and still remembers (a predicted prefix-cache "
            "hit).", ["model"], registry=r)
        self.prefix_keyed = Counter(PREFIX + "prefix_keyed_requests",
                                    "Requests whose prompt was long enough for a prefix key.", ["model"],
                                    registry=r)
        self.retries = Counter(PREFIX + "retries", "Requests sent to a second replica after the first refused "
                               "(429) or could not be reached, before any byte went to the client.",
                               ["model", "reason"], registry=r)
        self.request_seconds = Histogram(PREFIX + "request_seconds", "From arrival to the answer's last byte.",
                                         ["model"], buckets=_SECONDS, registry=r)
        self.replicas = Gauge(PREFIX + "replicas", "Replicas the router may send to (serving and ready by its "
                              "guard's last reading).", ["model"], registry=r)
        # By service, not model: the operator reads this to scale a service up from zero.
        self.held = Gauge(PREFIX + "held_requests", "Requests waiting for a replica of a service that has none "
                          "ready (a cold start).", ["namespace", "service"], registry=r)
        self.held_total = Counter(PREFIX + "held", "Requests that found no ready replica and waited for one "
                                  "(a cold start), answered or not.", ["namespace", "service"], registry=r)
        self.cold_start_seconds = Histogram(PREFIX + "cold_start_seconds", "From the first request that found no "
                                            "ready replica to the first replica ready for it.",
                                            ["namespace", "service"],
                                            buckets=_COLD_START_SECONDS, registry=r)
        self.readings_failed = Counter(PREFIX + "readings_failed", "Guard /metrics reads that failed.",
                                       ["model"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
