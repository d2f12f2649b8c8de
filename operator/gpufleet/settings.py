"""The operator's settings: one frozen, validated object built from `gpufleet run`'s flags.

Everything the runtime needs is here before anything starts, and nothing is
set on the runtime afterwards. Each check names the flag at fault and what to
pass instead (``SettingsError.flag``; the CLI reports it as a usage error).
Values that depend on the credentials (the namespace they name) stay ``None``
here and are resolved by the runtime: building the settings does no I/O.
"""
from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType
from typing import Mapping

from .errors import OperatorError
from .leader_election.records import Timing, TimingError
from .manifests.network_policy import EngineIngress
from .reconcile import figures

LEASE_NAME = "gpufleet-operator"
# A namespace's name, not one of kopf's patterns (``ml-*``, ``!rn-*``).
NAMESPACE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class SettingsError(OperatorError, ValueError):
    """A flag's value the operator cannot run with; ``flag`` names it."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


@dataclasses.dataclass(frozen=True)
class LeaderElection:
    """--leader-elect: one leader among the replicas, on a coordination.k8s.io Lease."""
    identity: str
    timing: Timing = Timing()
    name: str = LEASE_NAME
    namespace: str | None = None  # None: the namespace of the operator's credentials

    def __post_init__(self) -> None:
        if not self.name:
            raise SettingsError("--leader-elect-resource-name", "the Lease needs a name: pass "
                                f"--leader-elect-resource-name, e.g. {LEASE_NAME}")
        if not self.identity:
            raise SettingsError("--leader-elect-identity", "this replica needs a non-empty name in the Lease: "
                                "pass --leader-elect-identity, or leave it out for <hostname>_<random>")


@dataclasses.dataclass(frozen=True)
class NetworkPolicies:
    """--network-policies: who may reach the engines' guard port (docs/security.md)."""
    operator_labels: Mapping[str, str]
    operator_namespace: str | None = None  # None: the namespace of the operator's credentials
    client_namespaces: tuple[str, ...] = ()
    prometheus_namespaces: tuple[str, ...] = ()
    same_namespace: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "operator_labels", MappingProxyType(dict(self.operator_labels)))
        if not self.operator_labels:
            raise SettingsError("--network-policy-operator-label",
                                "with --network-policies the engines accept the operator's metrics reads only "
                                "from pods with its labels: pass --network-policy-operator-label KEY=VALUE "
                                "(the chart sets app.kubernetes.io/name=gpufleet-operator)")

    def ingress(self, credentials_namespace: str) -> EngineIngress:
        return EngineIngress(self.operator_namespace or credentials_namespace, dict(self.operator_labels),
                             self.client_namespaces, self.prometheus_namespaces, self.same_namespace)


def _positive(flag: str, value: float, what: str, example: str) -> None:
    if not value > 0:
        raise SettingsError(flag, f"{flag} must be more than 0 (got {value:g}): it is {what}; e.g. {flag} {example}")


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()           # watched; () is cluster-wide
    metrics_port: int | None = 9090            # /metrics, /healthz, /readyz; None: not served
    metrics_host: str = "0.0.0.0"
    liveness_endpoint: str | None = None       # kopf's liveness endpoint
    worker_limit: int = 100                    # kopf: objects of one kind handled at once
    leader_election: LeaderElection | None = None
    fleet_loops: bool = True                   # autoscaler, audits and router demand besides reconciles
    fleet_interval: float = 1.0                # seconds between replica reads
    follower_interval: float = 5.0             # a follower's reads of every replica (0: none, a cold takeover)
    status_figures_interval: float = figures.DEFAULT_INTERVAL_S  # seconds between a service's figure writes
    resync_seconds: float = 300.0              # a service untouched this long is reconciled again
    audit_interval: float = 30.0               # stranded-GPU and isolation audits
    podmonitor_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    network_policies: NetworkPolicies | None = None
    router_addresses: tuple[str, ...] = ()     # fixed routers to read held requests from
    adapter_private_sources: bool = False      # guards may fetch adapters from private addresses
    otlp_endpoint: str = ""                    # the fleet's OTLP receiver for the guards' spans (docs/tracing.md)
    # The operator's projected ServiceAccount token for the guards' audience (fleet/guard_identity.py);
    # None: no identity, and every guard refuses the operator's control calls (adapters, audits, demand).
    guard_token_file: str | None = None

    @property
    def listed_namespaces(self) -> tuple[str, ...]:
        """Where the cluster audits list InferenceServices, one namespace after another: the watched
        namespaces when each is a name, as a namespaced install (the chart's rbac.scope Namespaced)
        grants no cluster-wide list of them; () lists across the cluster (none named, or a pattern)."""
        if self.namespaces and all(NAMESPACE_NAME.match(ns) for ns in self.namespaces):
            return self.namespaces
        return ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "podmonitor_labels", MappingProxyType(dict(self.podmonitor_labels)))
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise SettingsError("--metrics-port", f"--metrics-port must be a TCP port, 1 to 65535 (got "
                                f"{self.metrics_port}); 0 turns the metrics server off")
        if self.worker_limit < 1:
            raise SettingsError("--worker-limit", f"--worker-limit must be at least 1 (got {self.worker_limit}); "
                                f"e.g. --worker-limit 100")
        _positive("--fleet-interval-seconds", self.fleet_interval, "how often each service's replicas are read",
                  "1")
        if not self.follower_interval >= 0:  # also NaN
            raise SettingsError("--follower-interval-seconds", f"--follower-interval-seconds must be 0 or more "
                                f"(got {self.follower_interval:g}): it is how often a replica that does not "
                                f"lead reads every replica's metrics to keep the autoscaler's state warm for a "
                                f"takeover; 0 turns that off (a cold takeover); e.g. "
                                f"--follower-interval-seconds 5")
        interval = self.status_figures_interval
        if not 0 <= interval <= figures.MAX_INTERVAL_S:
            raise SettingsError("--status-figures-interval-seconds", (
                f"--status-figures-interval-seconds must be 0 to {figures.MAX_INTERVAL_S:g} (got {interval:g}): "
                f"it is how often at most a service's fast-moving status figures (KV cache usage, TTFT p99) are "
                f"written, 0 for every change; e.g. --status-figures-interval-seconds "
                f"{figures.DEFAULT_INTERVAL_S:g} (Prometheus has them every second)"))
        _positive("--resync-seconds", self.resync_seconds,
                  "how long after its last reconcile a service is reconciled again", "300")
        _positive("--audit-interval-seconds", self.audit_interval, "how often the cluster-wide audits run", "30")
        for address in self.router_addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SettingsError("--router-address", f"--router-address {address!r} is not HOST:PORT; e.g. "
                                    f"--router-address 10.0.0.7:8000")


def leader_timing(lease_duration: float, renew_deadline: float, retry_period: float) -> Timing:
    """The --leader-elect-* durations, or a SettingsError that names them."""
    try:
        return Timing(lease_duration, renew_deadline, retry_period)
    except TimingError as e:
        raise SettingsError("--leader-elect-lease-duration/--leader-elect-renew-deadline/"
                            "--leader-elect-retry-period", str(e)) from None
