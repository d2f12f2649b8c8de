"""What the endpoint picker answers for one request, from the router's own state (the Fleet its HTTP server
routes by) and the same policy: the placement (policy/placement.py), the tenants' gate (tenants.py), the hold
through a cold start (Fleet.wait_for_pool), the pick and its fallbacks (Picker.pick through placement.ranked).

Where a service's requests go (docs/gateway-epp.md):

- a service behind its gateway with the router in its data path (RouteView.via_router: dataPath Router, or
  unset with prefill and decode pools) goes to a router pod, the one with the fewest requests this picker sent
  and not yet finished (then in turn): the router there picks the replica, hands the prefill to decode and
  resumes a broken stream, as for its own clients;
- any other goes straight to an engine pod's guard: the policy's pick, then its fallbacks.

The request's own accounting (``Sent``): the pick counts against its replica's room and in flight from the
moment it is made (``Picker.sent``), moves to the replica the gateway reports as the one that served it, and
ends with the answer (``Picker.finished``)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping

from aiohttp import web

from gpufleet_api import bounded_json
from gpufleet_api.engine_pods import UNIFIED

from ..fleet import Fleet
from ..metrics import Outcome
from ..policy import adapters, placement, tenancy
from ..policy import requests as rq
from ..policy.choice import Picker, Sent
from ..policy.prefixes import Prefix
from ..settings import ADAPTER_NOT_LOADED_RETRY_AFTER_SECONDS, EPP_REFUSED_RETRY_AFTER_SECONDS
from ..tenants import Admission, Gate
from . import protocol


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The picker's own answer instead of a destination: counted in gpufleet_router_requests_total under
    ``model`` with ``outcome`` (None: counted already, as the tenants' gate counts its refusals)."""
    status: int
    body: dict
    retry_after: float | None = None
    outcome: str | None = Outcome.INVALID
    model: str = ""


@dataclasses.dataclass
class InFlight:
    """A request sent to a replica, counted in its picker until it ends."""
    picker: Picker
    pod: str
    ticket: Sent
    cost: int
    prefix: Prefix | None
    pods: dict[str, str]      # address -> pod, of the candidates: which replica the gateway says served


@dataclasses.dataclass
class Routed:
    """Where the request goes: ``destinations`` in order, the headers to set and remove on its way."""
    model: str
    destinations: list[str]
    set_headers: dict[str, str]
    remove_headers: frozenset[str]
    reason: str = ""
    in_flight: InFlight | None = None        # an engine pod's pick
    router_endpoint: str | None = None       # a router pod's
    admission: Admission | None = None


class Chooser:
    def __init__(self, fleet: Fleet, gate: Gate):
        self.fleet, self.gate = fleet, gate
        self.settings, self.metrics = fleet.settings, fleet.metrics
        self.routers_in_flight: dict[str, int] = {}
        self._turn = itertools.count()

    async def choose(self, path: str, headers: Mapping[str, str], body: bytes,
                     subset: frozenset[str] | None) -> Routed | Refusal:
        """The destinations for a request with a body (an OpenAI request), or the picker's answer."""
        route = path.split("?", 1)[0]
        if route not in rq.ROUTES:
            return Refusal(404, rq.error_body(
                f"POST {route} is not served here; the endpoint picker places POST {', POST '.join(rq.ROUTES)}.",
                "invalid_request_error", code="not_found"))
        arrived = self.fleet.clock()
        try:
            placed = placement.place(body, route, self.fleet.table, self.fleet.catalog, self.settings.prefix_blocks,
                                     self.fleet.tokenize)
        except placement.UnknownModel as e:
            self.metrics.unknown_model_requests.inc()
            return Refusal(e.status, e.body())
        except rq.BadRequest as e:
            return Refusal(e.status, e.body())
        target, adapter = placed.target, placed.adapter_name
        if target.via_router:
            # The router pod admits it (its own tenants' gate) and places it: nothing is decided here twice.
            return self._to_router(target.model, subset, protocol.gateway_headers(headers, target.queue_classes,
                                                                                  False))
        admission = self.gate.admit(headers, route, placed.parsed, target, adapter or target.model)
        if isinstance(admission, web.Response):
            return _from_response(admission)
        set_headers = protocol.gateway_headers(headers, target.queue_classes,
                                               self.settings.epp_fairness_as_tenant and admission.tenancy is None)
        if admission.tenancy is not None:
            # The tenant the gate identified and its weight, never what the client sent under those names.
            set_headers.update({k: v for k, v in admission.headers({}).items()})
            remove = tenancy.GUARD_TENANCY_HEADERS | admission.tenancy.dropped_headers
        else:
            remove = tenancy.GUARD_TENANCY_HEADERS
        # Hop-by-hop headers are the gateway's own business (the router drops them as a proxy; Envoy is one).
        remove = frozenset(h for h in remove if h in headers) - protocol.NEVER_REMOVED
        routed = await self._to_replica(placed, subset, arrived)
        if isinstance(routed, Refusal):
            self.gate.settle_usage(admission, None, None, routed.status)
            return routed
        if placed.prefix is not None:
            self.metrics.prefix_keyed.labels(target.model).inc()
        if adapter is not None:
            self.metrics.adapter_requests.labels(adapter).inc()
        routed.set_headers, routed.remove_headers, routed.admission = set_headers, remove, admission
        self.gate.forwarded(admission)
        return routed

    async def _to_replica(self, placed: placement.Placement, subset: frozenset[str] | None,
                          arrived: float) -> Routed | Refusal:
        model, target = placed.target.model, placed.target
        pool = self.fleet.serving_pool(model)
        if pool is None:
            unserved = await self.fleet.wait_for_pool(model, target, arrived, arrived + self.settings.hold_timeout)
            if unserved is not None:
                return Refusal(503, unserved.body, unserved.retry_after, Outcome.UNAVAILABLE, model)
            pool = self.fleet.serving_pool(model)
        picker = self.fleet.picker(model, pool) if pool is not None else None
        if picker is None or pool is None:
            return Refusal(503, rq.error_body(f"No replica of {target.namespace}/{target.service} is ready.",
                                              "service_unavailable", code="no_ready_replica"),
                           self.fleet.cold(model).retry_after(0.0), Outcome.UNAVAILABLE, model)
        if placed.adapter is not None and not picker.holders(placed.adapter.name):
            self.metrics.adapter_not_loaded.labels(placed.adapter.name).inc()
            return Refusal(503, rq.error_body(adapters.not_loaded_message(placed.adapter.name, target),
                                              "adapter_not_loaded", code="adapter_not_loaded"),
                           ADAPTER_NOT_LOADED_RETRY_AFTER_SECONDS, Outcome.UNAVAILABLE, model)
        pods = {r.address: r.pod for r in picker.replicas.values()}
        outside = [r.pod for r in picker.replicas.values() if subset is not None and r.address not in subset]
        prefix = placed.prefix if pool == UNIFIED else None
        picks = placement.ranked(picker, placed, max(1, self.settings.epp_fallbacks), outside, prefix)
        if not picks:
            where = "none of the endpoints in the gateway's subset hint" if subset is not None else "no replica"
            return Refusal(503, rq.error_body(
                f"{where[0].upper()}{where[1:]} of {target.namespace}/{target.service} can take the request now "
                f"(not ready, draining{', or not holding the adapter' if placed.adapter else ''}).",
                "service_unavailable", code="no_ready_replica"), self.fleet.cold(model).retry_after(0.0),
                Outcome.UNAVAILABLE, model)
        if placement.all_refuse(picker, picks, placed.cost):
            return Refusal(429, rq.error_body(
                f"Every replica of {target.namespace}/{target.service} the request could go to is full now (their "
                f"guards' readings leave no room for its ~{placed.cost} KV blocks); retry after the Retry-After.",
                "rate_limit_error", code="no_room"), EPP_REFUSED_RETRY_AFTER_SECONDS, Outcome.REJECTED, model)
        first = picks[0]
        self.metrics.picks.labels(model, pool, first.reason).inc()
        if first.affinity_hit:
            self.metrics.prefix_affinity_hits.labels(model).inc()
        ticket = picker.sent(first.replica.pod, placed.cost, self.fleet.clock(), prefix)
        return Routed(model, [p.replica.address for p in picks], {}, frozenset(), first.reason,
                      InFlight(picker, first.replica.pod, ticket, placed.cost, prefix, pods))

    def _to_router(self, model: str, subset: frozenset[str] | None, set_headers: dict[str, str]) -> Routed | Refusal:
        """A router pod: the fewest of this picker's requests in flight, then in turn; the rest as fallbacks.
        The client's headers pass as they came (the router's gate reads them), with the class the gateway's
        objective names."""
        endpoints = [e for e in self.settings.router_endpoints if subset is None or e in subset]
        if not endpoints:
            return Refusal(503, rq.error_body(
                f"The model {model!r} is served through the router, and no router endpoint is known"
                f"{' in the gateway subset hint' if subset is not None else ''} (--router-endpoints).",
                "service_unavailable", code="no_ready_replica"), None, Outcome.UNAVAILABLE, model)
        turn = next(self._turn)
        order = sorted(range(len(endpoints)), key=lambda i: (self.routers_in_flight.get(endpoints[i], 0),
                                                             (i - turn) % len(endpoints)))
        chosen = [endpoints[i] for i in order][:max(1, self.settings.epp_fallbacks)]
        self.routers_in_flight[chosen[0]] = self.routers_in_flight.get(chosen[0], 0) + 1
        return Routed(model, chosen, set_headers, frozenset(), "router", router_endpoint=chosen[0])

    def choose_bodyless(self, subset: frozenset[str] | None) -> Routed | Refusal:
        """A request without a body (GET /v1/models, say): no model to place it by, so any ready replica in the
        subset, the least busy (as GIE's picker sends such requests to a random endpoint)."""
        best: tuple[int, str] | None = None
        for picker in self.fleet.pickers.values():
            for r in picker.eligible():
                if subset is None or r.address in subset:
                    candidate = (picker.in_flight.get(r.pod, 0), r.address)
                    best = candidate if best is None or candidate < best else best
        if best is None:
            return Refusal(503, rq.error_body("No ready replica can take the request.", "service_unavailable",
                                              code="no_ready_replica"), None, Outcome.UNAVAILABLE)
        return Routed("", [best[1]], {}, frozenset(), "bodyless")

    def served(self, routed: Routed, address: str | None) -> None:
        """The gateway says ``address`` served the request: the pick's accounting moves there if it went to a
        fallback."""
        flight = routed.in_flight
        if flight is not None and address is not None:
            pod = flight.pods.get(address)
            if pod is not None and pod != flight.pod:
                flight.picker.finished(flight.pod, flight.ticket)
                flight.ticket = flight.picker.sent(pod, flight.cost, self.fleet.clock(), flight.prefix)
                flight.pod = pod
                self.metrics.retries.labels(routed.model, UNIFIED, "rejected").inc()
        elif routed.router_endpoint is not None and address is not None and address != routed.router_endpoint:
            self._router_done(routed.router_endpoint)
            routed.router_endpoint = address
            self.routers_in_flight[address] = self.routers_in_flight.get(address, 0) + 1

    def finished(self, routed: Routed, status: int | None) -> None:
        """The answer ended (``status``: its status; None: the stream ended before one)."""
        flight, routed.in_flight = routed.in_flight, None
        if flight is not None:
            flight.picker.finished(flight.pod, flight.ticket)
            outcome = Outcome.OK if status is not None and status < 400 else (
                Outcome.CANCELLED if status is None else Outcome.REJECTED if status in (429, 503) else
                Outcome.INVALID if status < 500 else Outcome.ERROR)
            self.metrics.requests.labels(routed.model, outcome).inc()
        if routed.router_endpoint is not None:
            self._router_done(routed.router_endpoint)
            routed.router_endpoint = None
        if routed.admission is not None:
            self.gate.settle_usage(routed.admission, None, None, status)
            routed.admission = None

    def _router_done(self, endpoint: str) -> None:
        left = self.routers_in_flight.get(endpoint, 0) - 1
        if left > 0:
            self.routers_in_flight[endpoint] = left
        else:
            self.routers_in_flight.pop(endpoint, None)


def _from_response(response: web.Response) -> Refusal:
    """The tenants' gate's refusal (an aiohttp answer) as the picker's."""
    try:
        body = bounded_json.loads(response.body if isinstance(response.body, bytes) else b"{}")
    except ValueError:
        body = rq.error_body(response.reason or "refused", "invalid_request_error")
    retry = response.headers.get("Retry-After")
    return Refusal(response.status, body, float(retry) if retry else None, None)
