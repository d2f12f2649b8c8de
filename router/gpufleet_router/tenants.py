"""The tenants' gate on the request path (docs/tenants.md; policy/tenancy.py is the pure part): once a
request's ``model`` names its namespace, who is asking (401 before any guard), whether the tenant's limits
have room (429 with Retry-After), the headers the guard gets (the tenant and its weight, never the key),
and, once the answer ended however it ended, the tokens it used: counted, and its admission settled.

A namespace without tenants is served as before, except that the tenant headers a client sends are dropped
there too: only the router names the fair-share key a guard queues by."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from aiohttp import web

from gpufleet_api.tenants import labels, usage
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_api.tenants.identity import Refused
from gpufleet_kit.tenant_limits import Refusal, Ticket

from .exchange import Call, error_response
from .fleet import Fleet
from .metrics import Outcome
from .policy import metering, tenancy
from .policy import requests as rq
from .policy.table import Route
from .settings import HOP_BY_HOP

# The client's headers never forwarded to a guard from a namespace without tenants.
DROPPED = HOP_BY_HOP | tenancy.GUARD_TENANCY_HEADERS
TENANTS_INVALID = usage.TENANTS_INVALID     # a namespace whose declaration never parsed (tenancy.Closed)
TENANTS_UNREAD = usage.TENANTS_UNREAD       # a namespace whose InferenceTenants the router could not read yet
# A namespace the router could not read the tenants of: tried again within seconds.
UNREAD_RETRY_AFTER_SECONDS = 5


@dataclasses.dataclass
class Admission:
    """A request let through: its tenant (None: a namespace without tenants) and what settles it."""
    usage_labels: tuple[str, str, str, str]    # usage.USAGE_LABELS
    tenancy: tenancy.Tenancy | None = None
    tenant: str | None = None
    ticket: Ticket | None = None
    settled: bool = False

    def headers(self, client: Mapping[str, str]) -> dict[str, str]:
        """The headers for the guard: the client's less hop-by-hop ones and any that name a tenant (with
        tenants, its key too), then the tenant and its weight."""
        if self.tenancy is None or self.tenant is None:
            return {k: v for k, v in client.items() if k.lower() not in DROPPED}
        dropped = DROPPED | self.tenancy.dropped_headers
        out = {k: v for k, v in client.items() if k.lower() not in dropped}
        out[usage.GUARD_TENANT_HEADER] = self.tenant
        out[usage.GUARD_WEIGHT_HEADER] = self.tenancy.weights[self.tenant]
        return out


class Gate:
    def __init__(self, fleet: Fleet):
        self.fleet, self.metrics = fleet, fleet.metrics

    def admit(self, headers: Mapping[str, str], route: str, parsed: rq.Parsed, target: Route,
              model: str) -> Admission | web.Response:
        """Let the request through, or the router's answer refusing it (nothing reached a guard). ``headers``:
        the request's, names in any case (aiohttp's) or lower case (the endpoint picker's)."""
        ns = target.namespace
        if ns in self.fleet.tenants_unread or None in self.fleet.tenants_unread:
            self.metrics.requests.labels(target.model, Outcome.UNAVAILABLE).inc()
            return error_response(503, rq.error_body(
                f"The router could not read the InferenceTenants of namespace {ns} yet, so it cannot tell whether "
                f"callers need a key here, and refuses rather than serve them anonymously. It keeps trying; if "
                f"this lasts, grant the router get, list and watch on inferencetenants (the chart's router role "
                f"does) and read its log.", "service_unavailable", code=TENANTS_UNREAD),
                UNREAD_RETRY_AFTER_SECONDS)
        found = self.fleet.tenancies.get(ns)
        if isinstance(found, tenancy.Closed):
            self.metrics.requests.labels(target.model, Outcome.UNAVAILABLE).inc()
            return error_response(503, rq.error_body(found.message, "service_unavailable", code=TENANTS_INVALID))
        if found is None:
            return Admission((ns, target.service, model, UNKNOWN_TENANT))
        who = found.identify(headers)
        if isinstance(who, Refused):
            reason = tenancy.REFUSAL_REASON[who.reason]
            self.metrics.tenant_refusals.labels(ns, target.service, model, UNKNOWN_TENANT, reason).inc()
            self.metrics.requests.labels(target.model, Outcome.INVALID).inc()
            out = error_response(401, rq.error_body(who.message, "authentication_error", code=reason))
            out.headers["WWW-Authenticate"] = "Bearer"
            return out
        tenant = labels.tenant_label(who.tenant, found.declared)
        admitted = found.limiter.admit(who.tenant, parsed.estimated_tokens(route), self.fleet.clock())
        if isinstance(admitted, Refusal):
            self.metrics.tenant_refusals.labels(ns, target.service, model, tenant, admitted.limit).inc()
            self.metrics.requests.labels(target.model, Outcome.REJECTED).inc()
            # As a guard's 429 (the OpenAI client's RateLimitError), with the code of the limit.
            return error_response(429, rq.error_body(admitted.message, "rate_limit_error", code=admitted.limit),
                                  admitted.retry_after_seconds)
        return Admission((ns, target.service, model, tenant), found, who.tenant, admitted)

    def forwarded(self, admission: Admission) -> None:
        self.metrics.tenant_requests.labels(*admission.usage_labels).inc()

    def settle(self, admission: Admission, call: Call, status: int | None) -> None:
        """The answer ended (``status``: the client's; None: it went away or the answer broke): its tokens
        counted, as its usage told the client, and the tenant's admission corrected by them; where no usage
        is known, the estimate stands (an answer refused or failed before any usage: nothing was used).
        Once per admission: retries and resumptions are one request."""
        counted = call.relay.stream.counted() if call.relay is not None and call.relay.response is not None \
            else call.meter.counted
        self.settle_usage(admission, counted, call.meter.guard_refusal, status)

    def settle_usage(self, admission: Admission, counted: metering.Counted | None, guard_refusal: str | None,
                     status: int | None) -> None:
        """``settle`` from what is known of the answer: its usage (None: not known) and the guard's refusal code.
        The endpoint picker settles this way: the gateway, not the router, relays the answer."""
        if admission.settled:
            return
        admission.settled = True
        if counted is not None:
            self.metrics.tenant_prompt_tokens.labels(*admission.usage_labels).inc(counted.prompt)
            self.metrics.tenant_cached_prompt_tokens.labels(*admission.usage_labels).inc(counted.cached)
            self.metrics.tenant_answer_tokens.labels(*admission.usage_labels).inc(counted.answer)
        if guard_refusal is not None:
            self.metrics.tenant_refusals.labels(*admission.usage_labels, guard_refusal).inc()
        if admission.tenancy is None or admission.ticket is None:
            return
        if counted is not None:
            used = counted.total
        elif status is not None and status >= 400:
            used = 0
        else:
            used = admission.ticket.estimated_tokens
        admission.tenancy.limiter.finish(admission.ticket, used, self.fleet.clock())
