"""The router's settings (the `gpufleet router` flags) and the constants of its forwarding."""
from __future__ import annotations

import dataclasses

from gpufleet_api import engine_pods as names
from gpufleet_api.tracing import TracingConfig

from .policy.choice import Policy

# Headers that describe one connection, not the request (RFC 9110 7.6.1), and the ones aiohttp sets itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
UNREACHABLE_RETRY_AFTER_SECONDS = 5
# A guard answers these before it admits a request (KV watermark, queue full or timed out; draining,
# engine down): the request never started, so another replica may take it.
RETRIED_STATUSES = (429, 503)
# The guard's codes (guard_metrics.Reason) of a 503 about the replica, not about its capacity.
REPLICA_DOWN_CODES = frozenset({"engine_down", "draining"})
# An adapter no ready replica holds loaded: the operator is placing or loading it (or it failed: its
# InferenceAdapter's Ready condition says), so the client retries soon.
ADAPTER_NOT_LOADED_RETRY_AFTER_SECONDS = 5
# A guard's answer when its engine failed mid-request before answering (engine_error): nothing reached the
# client, so the request goes to another replica as after a failed connection.
ENGINE_FAILED_STATUS = 502
# A request no replica answered goes out again after this pause, doubling up to the maximum
# (RouterSettings.unreachable_retry_timeout bounds the whole).
UNREACHABLE_PAUSE_SECONDS = 0.25
UNREACHABLE_PAUSE_MAX_SECONDS = 2.0
# A continuation refused everywhere waits at least this long before asking again (a Retry-After of 0).
MIN_RESUME_WAIT_SECONDS = 0.05
# The endpoint picker's 429 when every candidate's reading says it has no room: about when the next reading
# (--reading-interval-seconds, 1 s by default) may say otherwise.
EPP_REFUSED_RETRY_AFTER_SECONDS = 1
# A body refused for want of room in --body-budget-bytes: the bodies held now are read and sent on within
# about this long on a healthy fleet.
BODY_BUDGET_RETRY_AFTER_SECONDS = 1



@dataclasses.dataclass
class RouterSettings:
    namespaces: tuple[str, ...] = ()        # empty: cluster-wide
    discovery: str = "watch"                # discovery.MODES: watch the API server, or list every interval
    discovery_interval: float = 2.0         # seconds between listings of services and pods (discovery "list")
    reading_interval: float = 1.0           # seconds between reads of each replica's guard /metrics
    reading_timeout: float = 1.0
    prefix_blocks: int = 4                  # leading KV blocks hashed for prefix affinity
    load_factor: float = 0.25               # bounded-load slack over the mean
    # The same for a service with a shared KV tier (spec.engine.kvTier Shared): a request spilled off its
    # prefix's replica loads the prefix from the tier there instead of computing it, so spilling is cheap
    # and load is balanced tightly.
    tier_load_factor: float = 0.0
    max_body_bytes: int = 8 << 20
    # Request bodies held at once across every request (gpufleet_kit.body_budget): more get 503 with
    # Retry-After. At least max_body_bytes (cli.py checks), or a body under the cap could never fit.
    body_budget_bytes: int = 128 << 20  # about 3x in memory: inside the chart's 512Mi limit
    connect_timeout: float = 2.0
    guard_port: int = names.GUARD_PORT
    # On SIGTERM: this long unready but still serving, so Services and clients' pooled
    # connections move to another router, before the listener closes (as the guard's drain).
    drain_grace: float = 5.0
    drain_timeout: float = 60.0             # then answers in progress get this long to finish
    # A request for a service with no replica to take it waits this long for one (a cold start),
    # at most this many per service; then 503 with Retry-After from the measured cold starts.
    hold_timeout: float = 120.0
    hold_max_requests: int = 256
    # A disaggregated request's prefill (queue, prompt, answer; retry included) gets this long, then
    # the request goes to decode without it: never held on a stuck prefill replica.
    prefill_timeout: float = 30.0
    policy: str = Policy.KV_AWARE           # choice.POLICIES: round_robin is the benchmarks' baseline
    # A streamed answer whose replica breaks off mid-stream continues on another replica of its revision
    # (resume.py), at most this many times; off: the client's stream breaks as the replica's did.
    resume_streams: bool = True
    max_resumptions: int = 2
    # A continuation every replica of the revision refuses (429/503) waits for their Retry-After, this long
    # at most from the break.
    resume_timeout: float = 30.0
    # A request no replica answered (connect failed or timed out, nothing admitted it) is sent again,
    # with a doubling pause, this long at most from its arrival: a replica starved of CPU or between
    # an engine's death and its unready probe should not make a client's request fail outright.
    unreachable_retry_timeout: float = 10.0
    # The Gateway API Inference Extension's endpoint picker (epp/, docs/gateway-epp.md): off without a port.
    epp_port: int | None = None
    epp_secure: bool = True                 # TLS (a self-signed certificate made at start, or epp_cert_path's)
    epp_cert_path: str | None = None        # a folder with tls.crt and tls.key (GIE's --cert-path)
    # Endpoints per pick: the first, then the fallbacks a gateway retrying goes to. 1 by default: Envoy's ORIGINAL_DST
    # cluster (GIE's test gateway) reads one address from the header; a list needs an override_host balancer.
    epp_fallbacks: int = 1
    epp_fairness_as_tenant: bool = True     # the gateway's fairness id keys the guard's fair lane (no tenants)
    # The router pods a service behind a gateway with dataPath Router is sent to (host:port of their OpenAI port).
    router_endpoints: tuple[str, ...] = ()
    # The router's spans (docs/tracing.md): --otlp-endpoint and its sampling; None: no tracing.
    tracing: TracingConfig | None = None
