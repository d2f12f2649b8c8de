"""The router's HTTP server: one OpenAI endpoint in front of every InferenceService in scope.

A request is read (bounded), its ``model`` names the service (table.py) or
a LoRA adapter of one (adapters.py), choice.py names the replica (for an
adapter, one that holds it loaded), and the body goes to that replica's guard
unchanged. The answer comes back as it arrives, chunk by chunk, so streamed
tokens are not held. A 429 from the first replica, or a connection that
fails before it answers, is sent once more to another replica: nothing has
gone to the client yet. Refused twice, the client gets the 429 with the
earlier of the replicas' Retry-After hints.

In a namespace that declares tenants (docs/tenants.md), the caller is identified and the tenant's limits
checked before any of that (tenants.py): 401 or 429 from the router itself, and the guard gets the tenant
and its weight, never the caller's key.

A disaggregated service (prefill and decode pools) takes each request in two
steps (handoff.py): a prefill replica, chosen by prefix affinity and load,
computes the prompt's KV and answers with one token; a decode replica, chosen
by free KV, gets the client's request with the prefill's hand-off and its
answer goes to the client. A prefill that does not answer in time, or at all,
is skipped: decode then computes the prompt itself.

Here: the aiohttp app and its routes, and ``serve``. The rest, by job: the fleet's state and discovery
(fleet.py, discovery.py), forwarding and retries (forwarding.py, exchange.py), streams and their
resumption (streaming.py, policy/resume.py), the P/D hand-off (prefill.py, policy/handoff.py), the settings
(settings.py), the tenants' gate (tenants.py); the pure policy in policy/ (choice.py, table.py over the API's
route view, shedding.py, requests.py, tenancy.py, metering.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from gpufleet_api import bounded_json
from gpufleet_api import tracing as names
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_kit.body_budget import BodyBudget, BodyTooLarge, BudgetExhausted, Claim, read_body
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.openmetrics import exposition
from gpufleet_kit.tracing import Tracing, bind, current, unbind

from . import discovery, spans
from .epp.server import EppServer
from .exchange import Call, Relay, client_session, error_response, refuse
from .fleet import Fleet
from .forwarding import Forwarder
from .metrics import Outcome, RouterMetrics
from .policy import requests as rq
from .policy import resume
from .policy.placement import UnknownModel, place
from .settings import BODY_BUDGET_RETRY_AFTER_SECONDS, RouterSettings
from .tenants import Gate

__all__ = ["Fleet", "Router", "RouterSettings", "client_session", "serve"]

log = logging.getLogger("gpufleet_router")


class Router:
    """The router's HTTP app: the OpenAI routes, /v1/models, /metrics and the probes."""

    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession, tracing: Tracing | None = None):
        """``tracing``: the router's spans (docs/tracing.md); None: none."""
        self.fleet = fleet
        self.http = http
        self.tracing = tracing or Tracing.off()
        self.metrics = fleet.metrics
        self.settings = fleet.settings
        self.forwarder = Forwarder(fleet, http)
        self.gate = Gate(fleet)
        self.body_budget = BodyBudget(self.settings.body_budget_bytes)
        self.metrics.body_bytes_held.set_function(lambda: self.body_budget.held)

    def app(self) -> web.Application:
        @web.middleware
        async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
            # aiohttp's own 404/405 are plain text: answer them in the OpenAI error format too.
            try:
                return await handler(request)
            except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
                self.metrics.requests.labels("", Outcome.INVALID).inc()
                routes = ", ".join(f"POST {r}" for r in rq.ROUTES) + ", GET /v1/models"
                return error_response(e.status, rq.error_body(
                    f"{request.method} {request.path} is not served here; the router serves {routes}.",
                    "invalid_request_error", code="not_found" if e.status == 404 else "method_not_allowed"))

        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[openai_errors])

        async def close_while_draining(request: web.Request, response: web.StreamResponse) -> None:
            if self.fleet.draining:
                response.force_close()
                response.headers["Connection"] = "close"
        app.on_response_prepare.append(close_while_draining)

        def proxied(route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
            async def handler(request: web.Request) -> web.StreamResponse:
                return await self.handle(request, route)
            return handler

        for route in rq.ROUTES:
            app.router.add_post(route, proxied(route))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.render_metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def models(self, request: web.Request) -> web.Response:
        # As vLLM lists them (serving_models.show_available_models): a base model's ``root`` is the model
        # it loads and its ``parent`` null; an adapter's ``root`` is its source, its ``parent`` the base.
        cards = [{"id": model, "object": "model", "created": 0, "owned_by": "gpufleet", "root": route.root,
                  "parent": None, "namespace": route.namespace, "service": route.service}
                 for model, route in self.fleet.table.routes.items()]
        cards += [{"id": a.name, "object": "model", "created": 0, "owned_by": "gpufleet", "root": a.root,
                   "parent": a.parent, "namespace": a.namespace, "service": a.service}
                  for a in self.fleet.catalog.adapters.values()]
        return web.json_response({"object": "list", "data": sorted(cards, key=lambda c: c["id"])})

    async def render_metrics(self, request: web.Request) -> web.Response:
        # OpenMetrics (with the request-latency histogram's exemplars) when the scraper asks for it.
        body, content_type = exposition(self.metrics.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"alive": True})

    async def readyz(self, request: web.Request) -> web.Response:
        reasons = ([] if self.fleet.listed.is_set() else ["services not listed yet"]) + \
            (["draining"] if self.fleet.draining else [])
        return web.json_response({"ready": not reasons, "reasons": reasons}, status=503 if reasons else 200)

    async def handle(self, request: web.Request, route: str) -> web.StreamResponse:
        # The body is held until the answer has gone out (a retry or a stream's resumption sends it again):
        # its bytes count in the budget until then, however the handling ends.
        with self.body_budget.claim() as claim:
            if not self.tracing.on:
                return await self._handle(request, route, claim)
            # The request's server span: a client's W3C traceparent honoured; the steps (holds, sends to
            # replicas, the prefill, a resumption) written to it where they happen (spans.py).
            trace = self.tracing.begin(names.ROUTER_REQUEST_SPAN, request.headers, {names.HTTP_ROUTE: route})
            token = bind(trace)
            status = 0
            try:
                response = await self._handle(request, route, claim)
                status = response.status
                return response
            except Exception as e:
                trace.keep("error")
                trace.set(names.ERROR_TYPE, type(e).__name__)
                raise
            finally:
                unbind(token)
                spans.finished(trace, status)   # the router's own refusals (the forwarded: in _handle)
                trace.end({names.HTTP_STATUS: status} if status else {names.OUTCOME: "cancelled"})

    async def _handle(self, request: web.Request, route: str, claim: Claim) -> web.StreamResponse:
        arrived = self.fleet.clock()
        try:
            body = await self._read_body(request, claim)
            placement = place(body, route, self.fleet.table, self.fleet.catalog, self.settings.prefix_blocks,
                              self.fleet.tokenize)
        except UnknownModel as e:
            self.metrics.unknown_model_requests.inc()
            return refuse(self.metrics, "", Outcome.INVALID, e.status, e.body())
        except rq.BadRequest as e:
            return refuse(self.metrics, "", Outcome.INVALID, e.status, e.body())
        except BudgetExhausted as e:
            self.metrics.body_budget_refusals.inc()
            return refuse(self.metrics, "", Outcome.UNAVAILABLE, 503, rq.error_body(
                f"The router holds {e.held} bytes of request bodies now and this body's {e.wanted} more would "
                f"pass its budget of {e.limit} bytes (--body-budget-bytes, the chart's router.bodyBudgetBytes); "
                f"retry shortly.", "service_unavailable", code=Reason.BODY_BUDGET),
                BODY_BUDGET_RETRY_AFTER_SECONDS)
        parsed, target, adapter, prefix = placement.parsed, placement.target, placement.adapter, placement.prefix
        trace = current()
        if trace.on:
            spans.placed(trace, route, parsed, target, adapter.name if adapter else target.model)
        if adapter is not None:
            self.metrics.adapter_requests.labels(adapter.name).inc()
        admission = self.gate.admit(request.headers, route, parsed, target, adapter.name if adapter else target.model)
        if isinstance(admission, web.Response):
            return admission
        if admission.tenant is not None and trace.on:
            trace.set(names.TENANT, admission.tenant)
        if prefix is not None:
            self.metrics.prefix_keyed.labels(target.model).inc()
        relay = self._relay(body, route, parsed)
        if relay is not None and relay.stream.refusal is None:
            # Counted from vLLM's usage in each chunk (what the client did not ask for is taken out again).
            body = json.dumps(resume.upstream_body(relay.stream.doc)).encode()
        call = Call(request, route, body, admission.headers(request.headers), parsed, target, arrived, prefix,
                    adapter.name if adapter else None, relay)
        self.gate.forwarded(admission)
        status: int | None = None
        try:
            response = await self.forwarder.forward(call)
            status = response.status
            return response
        finally:
            self.gate.settle(admission, call, status)
            if trace.on:
                spans.finished(trace, status or 0)   # before the exemplar: a kept request's trace exists
            self.metrics.request_seconds.labels(target.model).observe(self.fleet.clock() - arrived, trace.exemplar())

    def _relay(self, body: bytes, route: str, parsed: rq.Parsed) -> Relay | None:
        """A streamed completion's relay event by event (resume.py), with resumption on; else None."""
        if not (self.settings.resume_streams and parsed.stream and route in resume.RESUMABLE_ROUTES):
            return None
        try:
            doc = bounded_json.loads(body)
        except ValueError:
            return None
        return Relay(resume.Stream(doc, route)) if isinstance(doc, dict) else None

    async def _read_body(self, request: web.Request, claim: Claim) -> bytes:
        """The body, bounded by --max-body-bytes (413) and counted in --body-budget-bytes before it is held
        (BudgetExhausted); chunked bodies too, while they arrive."""
        limit = self.settings.max_body_bytes
        try:
            return await read_body(request, limit, claim)
        except BodyTooLarge:
            raise rq.BadRequest(413, f"The request body is over the router's limit of {limit} bytes; send a "
                                     f"shorter prompt.", kind="invalid_request_error",
                                code="request_too_large") from None


async def serve(kube: KubeClient, settings: RouterSettings, host: str, port: int,
                stop: asyncio.Event) -> None:
    """Run until ``stop`` is set, then drain: unready (still serving) for the grace, then stop
    listening and let answers in progress finish."""
    metrics = RouterMetrics()
    fleet = Fleet(settings, metrics)
    http = client_session(settings)
    tracing = Tracing.start(settings.tracing, names.ROUTER_SERVICE_NAME)
    router = Router(fleet, http, tracing)
    tasks = [asyncio.create_task(discovery.run(fleet, kube), name="router-discovery"),
             asyncio.create_task(fleet.read(http), name="router-readings"),
             asyncio.create_task(fleet.lag.watch(), name="router-loop-lag")]
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=settings.drain_timeout)
    await runner.setup()
    # The gateways' endpoint picker (epp/): the same fleet and policy behind a second front door.
    epp = EppServer(fleet, router.body_budget, host, tracing) if settings.epp_port is not None else None
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("router listening on %s:%d (%s)", host, port,
                 ", ".join(settings.namespaces) if settings.namespaces else "every namespace")
        if epp is not None:
            await epp.start()
        await stop.wait()
        fleet.draining = True
        if epp is not None:
            await epp.draining()
        log.info("draining: unready for %gs, then answers in progress get up to %gs", settings.drain_grace,
                 settings.drain_timeout)
        await asyncio.sleep(settings.drain_grace)
    finally:
        if epp is not None:
            await epp.stop(settings.drain_timeout)
        await runner.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.close()
        await asyncio.to_thread(tracing.shutdown)   # the spans still batched go out
