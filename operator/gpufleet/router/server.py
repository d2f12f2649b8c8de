"""The router's HTTP server: one OpenAI endpoint in front of every InferenceService in scope.

A request is read (bounded), its ``model`` names the service (table.py) or
a LoRA adapter of one (adapters.py), choice.py names the replica (for an
adapter, one that holds it loaded), and the body goes to that replica's guard
unchanged. The answer comes back as it arrives, chunk by chunk, so streamed
tokens are not held. A 429 from the first replica, or a connection that
fails before it answers, is sent once more to another replica: nothing has
gone to the client yet. Refused twice, the client gets the 429 with the
earlier of the replicas' Retry-After hints.

A disaggregated service (prefill and decode pools) takes each request in two
steps (handoff.py): a prefill replica, chosen by prefix affinity and load,
computes the prompt's KV and answers with one token; a decode replica, chosen
by free KV, gets the client's request with the prefill's hand-off and its
answer goes to the client. A prefill that does not answer in time, or at all,
is skipped: decode then computes the prompt itself.

The I/O around the pure core: ``Fleet`` keeps the route table current from
the API server and each replica's reading current from its guard.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import time
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from gpufleet_api import API_VERSION, KIND
from gpufleet_api.guard.adapters import ADAPTER_KIND
from gpufleet_api.guard.endpoints import GUARD_METRICS_PATH

from ..kube.client import KubeClient
from ..kube.errors import NotFound
from ..kube.pods import is_serving
from ..manifests import names
from . import adapters, discovery, handoff, resume, shedding
from . import requests as rq
from .choice import Pick, Picker, Policy, Prefix, Reading, prefix_of
from .cold_start import ColdStarts
from .metrics import Fallback, Outcome, Resumption, RouterMetrics, TransferParams
from .signals import parse_guard
from .table import ROLES, Role, Route, Table, build_table

log = logging.getLogger("gpufleet.router")

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


class Fleet:
    """The route table and a picker per service and pool, kept current by two loops."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.table = Table({})
        self.catalog = adapters.EMPTY       # the LoRA adapters in scope
        self.pickers: dict[tuple[str, str], Picker] = {}   # (model, role) -> that pool's picker
        self.listed = asyncio.Event()       # the first listing succeeded: the router can route
        self.draining = False
        self._problems: tuple[str, ...] = ()
        self._adapter_items: list[dict] = []   # the last InferenceAdapters listed
        self.held: dict[str, collections.deque[asyncio.Future]] = {}
        self.cold_since: dict[str, float] = {}   # model -> when its first request found no replica
        self.cold_starts: dict[str, ColdStarts] = {}

    def update(self, table: Table, catalog: adapters.Catalog = adapters.EMPTY) -> None:
        problems = table.problems + catalog.problems
        for problem in set(problems) - set(self._problems):
            log.warning("%s", problem)
        self._problems = problems
        self.table = table
        self.catalog = catalog
        for model, route in table.routes.items():
            for role in ROLES:
                factor = self.settings.tier_load_factor if route.kv_tier else self.settings.load_factor
                picker = self.pickers.setdefault((model, role), Picker(factor, self.settings.policy))
                picker.load_factor = factor
                picker.canary_revision, picker.canary_percent = route.canary_revision, route.canary_weight
                picker.set_replicas(route.pool(role))
        for model, role in [key for key in self.pickers if key[0] not in table.routes]:
            del self.pickers[(model, role)]
            self.metrics.replicas.remove(model, role)
        self._count_replicas()
        self.release_held()

    def picker(self, model: str, role: str = Role.UNIFIED) -> Picker | None:
        return self.pickers.get((model, role))

    def serving_pool(self, model: str) -> str | None:
        """The pool that answers the service's requests now: decode (after a prefill) when a decode
        replica can take them, else unified, else None (held). Decode first: while a rollout turns a
        unified service into pools, the new pools take over as soon as a decode replica is ready."""
        for role in (Role.DECODE, Role.UNIFIED):
            picker = self.picker(model, role)
            if picker is not None and picker.eligible():
                return role
        return None

    def _count_replicas(self) -> None:
        for (model, role), picker in self.pickers.items():
            self.metrics.replicas.labels(model, role).set(len(picker.eligible()))

    async def list_once(self, kube: KubeClient) -> None:
        services: list[dict] = []
        pods: list[dict] = []
        selector = names.engine_pods_selector()
        for ns in self.settings.namespaces or (None,):
            services += await kube.list(API_VERSION, KIND, ns)
            pods += await kube.list("v1", "Pod", ns, label_selector=selector)
        table = build_table(services, pods, is_serving, self.settings.guard_port)
        self.update(table, await self._list_adapters(kube, table))
        self.listed.set()

    async def _list_adapters(self, kube: KubeClient, table: Table) -> adapters.Catalog:
        """The InferenceAdapters in scope. Without their CRD (a chart older than adapters) there are none;
        when they cannot be listed, the last catalog is kept so that base models are still routed."""
        items: list[dict] = []
        try:
            for ns in self.settings.namespaces or (None,):
                items += await kube.list(API_VERSION, ADAPTER_KIND, ns)
        except NotFound:
            return adapters.EMPTY
        except Exception as e:
            log.warning("cannot list InferenceAdapters (adapters served as last listed): %s", e)
            return adapters.build_catalog(self._adapter_items, table)
        self._adapter_items = items
        return adapters.build_catalog(items, table)

    async def discover(self, kube: KubeClient) -> None:
        while True:
            try:
                await self.list_once(kube)
            except Exception as e:  # keep routing on the last table; say why it is not refreshed
                log.warning("cannot list InferenceServices and engine pods: %s", e)
            await asyncio.sleep(self.settings.discovery_interval)

    async def read_once(self, http: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.reading_timeout)

        async def read(model: str, picker: Picker, pod: str, address: str) -> None:
            taken_at = self.clock()
            reading: Reading | None
            try:
                async with http.get(f"http://{address}{GUARD_METRICS_PATH}", timeout=timeout) as r:
                    if r.status != 200:
                        raise RuntimeError(f"answered {r.status}")
                    reading = parse_guard(await r.text(), taken_at)
            except Exception as e:  # unreadable: its room is unknown until the next read
                log.debug("cannot read %s (%s): %s", pod, address, e)
                self.metrics.readings_failed.labels(model).inc()
                reading = None
            picker.observe(pod, reading)

        await asyncio.gather(*(read(model, picker, r.pod, r.address)
                               for (model, _role), picker in list(self.pickers.items())
                               for r in picker.replicas.values() if r.serving))
        self._count_replicas()
        self.release_held()

    # --- requests held through a cold start ------------------------------------------

    def cold(self, model: str) -> ColdStarts:
        return self.cold_starts.setdefault(model, ColdStarts())

    async def hold(self, model: str, deadline: float) -> bool:
        """Wait, in arrival order, until the service has a replica to answer (serving_pool); False
        at the deadline."""
        queue = self.held.setdefault(model, collections.deque())
        self.cold_since.setdefault(model, self.clock())
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        self.metrics.held_total.labels(*self._service(model)).inc()
        self.metrics.held.labels(*self._service(model)).set(len(queue))
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, deadline - self.clock()))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if waiter in queue:
                queue.remove(waiter)
            self.metrics.held.labels(*self._service(model)).set(len(queue))

    def _service(self, model: str) -> tuple[str, str]:
        route = self.table.routes.get(model)
        return (route.namespace, route.service) if route else ("", model)

    def held_count(self, model: str) -> int:
        return len(self.held.get(model, ()))

    def release_held(self) -> None:
        """Wake the requests held for each service that now has a replica to answer, first come first."""
        for model in self.table.routes:
            if self.serving_pool(model) is None:
                continue
            started = self.cold_since.pop(model, None)
            if started is not None:
                seconds = self.clock() - started
                self.cold(model).record(seconds)
                self.metrics.cold_start_seconds.labels(*self._service(model)).observe(seconds)
                log.info("%s: a replica is ready %.1fs after the first request found none", model, seconds)
            queue = self.held.get(model)
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
            if queue is not None:
                self.metrics.held.labels(*self._service(model)).set(0)

    async def read(self, http: aiohttp.ClientSession) -> None:
        while True:
            started = self.clock()
            await self.read_once(http)
            await asyncio.sleep(max(0.0, self.settings.reading_interval - (self.clock() - started)))


def error_response(status: int, body: dict, retry_after: float | None = None) -> web.Response:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return web.json_response(body, status=status, headers=headers)


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return float(resp.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


class Router:
    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession):
        self.fleet = fleet
        self.http = http
        self.metrics = fleet.metrics
        self.settings = fleet.settings

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
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"alive": True})

    async def readyz(self, request: web.Request) -> web.Response:
        reasons = ([] if self.fleet.listed.is_set() else ["services not listed yet"]) + \
            (["draining"] if self.fleet.draining else [])
        return web.json_response({"ready": not reasons, "reasons": reasons}, status=503 if reasons else 200)

    def _refuse(self, model: str, outcome: str, status: int, body: dict,
                retry_after: float | None = None) -> web.Response:
        self.metrics.requests.labels(model, outcome).inc()
        return error_response(status, body, retry_after)

    async def handle(self, request: web.Request, route: str) -> web.StreamResponse:
        arrived = self.fleet.clock()
        try:
            body = await self._read_body(request)
            parsed = rq.parse(body, route)
            resolved = adapters.resolve(parsed.model, self.fleet.table, self.fleet.catalog)
            if resolved is None:
                self.metrics.unknown_model_requests.inc()
                # vLLM's 404 (OpenAI's shape, vLLM's type and numeric code), naming what is served here.
                raise rq.BadRequest(404, adapters.not_found_message(parsed.model, self.fleet.table,
                                                                    self.fleet.catalog),
                                    param="model", code=404, kind="NotFoundError")
        except rq.BadRequest as e:
            return self._refuse("", Outcome.INVALID, e.status, e.body())
        target, adapter = resolved.route, resolved.adapter
        if adapter is not None:
            self.metrics.adapter_requests.labels(adapter.name).inc()
        prefix = prefix_of(parsed.prompt, target.block_size * rq.CHARS_PER_TOKEN, self.settings.prefix_blocks,
                           adapter=adapter.name if adapter else None)
        if prefix is not None:
            self.metrics.prefix_keyed.labels(target.model).inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        relay = self._relay(body, route, parsed)
        if relay is not None and relay.stream.refusal is None:
            # Counted from vLLM's usage in each chunk (what the client did not ask for is taken out again).
            body = json.dumps(resume.upstream_body(relay.stream.doc)).encode()
        try:
            return await self._forward(_Call(request, route, body, headers, parsed, target, arrived, prefix,
                                             adapter.name if adapter else None, relay))
        finally:
            self.metrics.request_seconds.labels(target.model).observe(self.fleet.clock() - arrived)

    def _relay(self, body: bytes, route: str, parsed: rq.Parsed) -> _Relay | None:
        """A streamed completion's relay event by event (resume.py), with resumption on; else None."""
        if not (self.settings.resume_streams and parsed.stream and route in resume.RESUMABLE_ROUTES):
            return None
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        return _Relay(resume.Stream(doc, route)) if isinstance(doc, dict) else None

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = rq.BadRequest(413, f"The request body is over the router's limit of {limit} bytes; send a "
                                       f"shorter prompt.", kind="invalid_request_error", code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.content.iter_any():  # bounded while it arrives (chunked bodies too)
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def _forward(self, call: _Call) -> web.StreamResponse:
        deadline = call.arrived + self.settings.hold_timeout
        held = False
        while True:
            pool = self.fleet.serving_pool(call.model)
            if pool is None:
                held = True
                refusal = await self._hold(call, deadline)
                if refusal is not None:
                    return refusal
                continue
            if call.adapter is not None and not self._adapter_held(call.model, pool, call.adapter):
                if held and self.fleet.clock() < deadline:
                    # Held through a cold start: the new replica gets its adapters loaded next (the
                    # operator's next pass), so the request waits for that within the same deadline.
                    await asyncio.sleep(self.settings.reading_interval)
                    continue
                return self._adapter_not_loaded(call)
            if pool == Role.DECODE and call.route != rq.EMBEDDINGS:
                done = await self._prefill(call)
                answer = await self._send(call, Role.DECODE, handoff.decode_body(call.body, done), None)
            else:
                # Embeddings have nothing to decode: a disaggregated service's decode replicas answer them.
                answer = await self._send(call, pool, call.body, call.prefix if pool == Role.UNIFIED else None)
            if answer is not None:
                return answer
            # The pool lost its last replica before one was picked: held like a cold start.

    def _adapter_held(self, model: str, pool: str, adapter: str) -> bool:
        """A ready replica of the pool that answers (decode, or unified) holds the adapter loaded."""
        picker = self.fleet.picker(model, pool)
        return picker is not None and bool(picker.holders(adapter))

    def _adapter_not_loaded(self, call: _Call) -> web.Response:
        adapter, target = call.adapter or "", call.target
        self.metrics.adapter_not_loaded.labels(adapter).inc()
        return self._refuse(call.model, Outcome.UNAVAILABLE, 503, rq.error_body(
            f"The adapter `{adapter}` of {target.namespace}/{target.service} is not loaded on any ready replica "
            f"now; retry shortly (kubectl -n {target.namespace} get inferenceadapter {adapter} says where it is "
            f"loaded, or why not).", "adapter_not_loaded", code="adapter_not_loaded"),
            ADAPTER_NOT_LOADED_RETRY_AFTER_SECONDS)

    async def _hold(self, call: _Call, deadline: float) -> web.Response | None:
        """No pool can answer (no replica yet, all starting, or scaled to zero): hold the request until
        one can (None), or answer why not."""
        model, target = call.model, call.target
        if self.fleet.held_count(model) >= self.settings.hold_max_requests:
            return self._refuse(model, Outcome.UNAVAILABLE, 503, rq.error_body(
                f"{self.settings.hold_max_requests} requests already wait for a replica of "
                f"{target.namespace}/{target.service} (model {model!r}); retry later.",
                "service_unavailable", code="hold_queue_full"),
                self.fleet.cold(model).retry_after(self.fleet.clock() - call.arrived))
        if not await self.fleet.hold(model, deadline):
            waited = self.fleet.clock() - call.arrived
            return self._refuse(model, Outcome.UNAVAILABLE, 503, rq.error_body(
                f"No replica of {target.namespace}/{target.service} (model {model!r}) became ready "
                f"within {waited:.0f}s.", "service_unavailable", code="no_ready_replica"),
                self.fleet.cold(model).retry_after(waited))
        return None

    async def _send(self, call: _Call, role: str, body: bytes, prefix: Prefix | None) -> web.StreamResponse | None:
        """Send ``body`` to a replica of the ``role`` pool and stream its answer to the client, with the
        retries the module describes; None when the pool has no replica to try."""
        model, target = call.model, call.target
        cost = call.parsed.cost_blocks(target.block_size, call.route)
        tried: list[str] = []
        refusals: list[_Refused] = []
        failure = ""
        # Refused everywhere below maxReplicas: held at most as long as a new replica takes (shedding.py).
        scale_out_deadline = call.arrived + min(self.settings.hold_timeout, self.fleet.cold(model).expected())
        attempt = 0
        revision: str | None = None   # the first replica's: a retry stays with it when it can
        broken: _Broken | None = None
        unreachable_rounds = 0
        while True:
            if attempt >= 2:
                if not refusals:
                    # Nothing answered: not a capacity question. Nothing was admitted either, so the
                    # request goes out again after a pause while its arrival is recent enough.
                    pause = min(UNREACHABLE_PAUSE_MAX_SECONDS, UNREACHABLE_PAUSE_SECONDS * 2 ** unreachable_rounds)
                    if not failure or self.fleet.clock() + pause > \
                            call.arrived + self.settings.unreachable_retry_timeout:
                        break
                    await asyncio.sleep(pause)
                    unreachable_rounds += 1
                    attempt, tried = 0, []
                    self.metrics.retries.labels(model, role, "connect_failed").inc()
                    continue
                route_now = self.fleet.table.routes.get(model, target)
                wait = shedding.wait_before_retrying(
                    len(route_now.pool(role)), route_now.max_of(role),
                    [r.retry_after for r in refusals if r.retry_after is not None],
                    scale_out_deadline - self.fleet.clock())
                if wait is None:
                    break
                await asyncio.sleep(wait)
                attempt, tried = 0, []
                self.metrics.retries.labels(model, role, "scale_out").inc()
            picker = self.fleet.picker(model, role)
            if picker is None:
                return None   # the service left the table: held until it is back or the hold times out
            pick = picker.pick(cost, prefix, exclude=tried, adapter=call.adapter, revision=revision)
            if pick is None:
                if tried:
                    attempt = 2  # every replica there is was tried
                    continue
                return None
            if revision is None:
                revision = pick.replica.revision
                self.metrics.revision_requests.labels(model, revision).inc()
            attempt += 1
            pod = pick.replica.pod
            tried.append(pod)
            if attempt > 1:
                self.metrics.retries.labels(model, role, "rejected" if refusals else "connect_failed").inc()
            ticket = picker.sent(pod, cost, self.fleet.clock(), prefix)
            try:
                return await self._exchange(call, role, body, pick)
            except _Refused as r:
                refusals.append(r)
            except _Unreachable as u:
                failure = u.message
            except _Broken as b:
                broken = b
                break
            finally:
                picker.finished(pod, ticket)
        if broken is not None:
            return await self._resume(call, role, broken, cost)
        if refusals:
            # Every replica tried refused: the earliest any of them expects room is the hint.
            hints = [r.retry_after for r in refusals if r.retry_after is not None]
            last = refusals[-1]
            self.metrics.requests.labels(model, Outcome.REJECTED).inc()
            out = web.Response(status=last.status, body=last.body, content_type=last.content_type)
            if hints:
                out.headers["Retry-After"] = str(max(1, math.ceil(min(hints))))
            return out
        pool = "" if role == Role.UNIFIED else f"{role} "
        return self._refuse(model, Outcome.ERROR, 502, rq.error_body(
            f"No {pool}replica of {target.namespace}/{target.service} answered: {failure}", "server_error",
            code="replica_unreachable"), UNREACHABLE_RETRY_AFTER_SECONDS)

    async def _exchange(self, call: _Call, role: str, body: bytes, pick: Pick) -> web.StreamResponse:
        """Send to one replica. Raises _Refused (it answered 429 or 503: not admitted) or
        _Unreachable (nothing answered) before anything is written to the client."""
        model = call.model
        self.metrics.picks.labels(model, role, pick.reason).inc()
        if pick.affinity_hit:
            self.metrics.prefix_affinity_hits.labels(model).inc()
        url = f"http://{pick.replica.address}{call.route}"
        try:
            upstream = await self.http.post(url, data=body, headers=call.headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise _Unreachable(f"{pick.replica.pod} ({pick.replica.address}): {type(e).__name__}: {e}") from None
        done = False  # the answer was read to its end: the connection goes back to the pool
        try:
            if upstream.status in RETRIED_STATUSES:
                refusal = await upstream.read()
                done = True
                if _replica_down(upstream.status, refusal):
                    raise _Unreachable(f"{pick.replica.pod} ({pick.replica.address}) is not serving: "
                                       f"{refusal[:300]!r}")
                raise _Refused(upstream.status, refusal, upstream.content_type, _retry_after(upstream))
            if upstream.status == ENGINE_FAILED_STATUS:
                # The guard's engine failed mid-request before answering (killed, crashed): nothing went
                # to the client, so another replica may take the request.
                answer = await upstream.read()
                done = True
                raise _Unreachable(f"{pick.replica.pod} ({pick.replica.address}) answered "
                                   f"{upstream.status}: {answer[:300]!r}")
            relay = call.relay if upstream.status == 200 and _is_sse(upstream) else None
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_BY_HOP and not (relay is not None and k.lower() == "content-length"):
                    response.headers.add(k, v)
            if upstream.headers.get("Content-Length") is not None and relay is None:
                response.content_length = int(upstream.headers["Content-Length"])
            await response.prepare(call.request)
            if relay is not None:
                relay.response = relay.response or response
                if not await self._pump(call, relay, upstream):
                    relay.stream.broke()
                    raise _Broken(pick.replica.pod, pick.replica.revision)
            else:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            done = True
            await response.write_eof()
            outcome = Outcome.OK if upstream.status < 400 else (
                Outcome.REJECTED if upstream.status in (429, 503) else
                Outcome.INVALID if upstream.status < 500 else Outcome.ERROR)
            self.metrics.requests.labels(model, outcome).inc()
            return response
        except asyncio.CancelledError:
            self.metrics.requests.labels(model, Outcome.CANCELLED).inc()
            raise
        except (aiohttp.ClientError, ConnectionResetError) as e:
            # The replica or the client broke off mid-answer: bytes went out, so no retry.
            self.metrics.requests.labels(model, Outcome.ERROR).inc()
            log.warning("answer from %s broke off: %s", pick.replica.pod, e)
            raise
        finally:
            # Reused when read to the end; otherwise (client gone, replica broke off) closed, which
            # is what tells the guard, and through it vLLM, to stop.
            if done:
                upstream.release()
            else:
                upstream.close()

    # --- streams that survive their replica (resume.py) ------------------------------------

    async def _pump(self, call: _Call, relay: _Relay, upstream: aiohttp.ClientResponse,
                    before_end: Callable[[], None] | None = None) -> bool:
        """The replica's events to the client through the relay: True when its answer ended with [DONE]
        (or an error event it answered), False when it broke off before. The client going away raises.
        ``before_end`` runs once, before the events that end the stream go out: a client that reads the
        end and then the router's metrics sees what it counted."""
        stream, response = relay.stream, relay.response
        assert response is not None
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            try:
                data = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, ConnectionResetError, asyncio.IncompleteReadError) as e:
                log.warning("%s: a stream broke off after %d events: %s", call.model, stream.events,
                            f"{type(e).__name__}: {e}")
                break
            events = stream.feed(data)
            if stream.done and before_end is not None:
                before_end()
                before_end = None
            for event in events:
                if relay.broke_at is not None:
                    self.metrics.resume_gap_seconds.labels(call.target.service).observe(
                        self.fleet.clock() - relay.broke_at)
                    relay.broke_at = None
                await response.write(event)
        return stream.done

    async def _resume(self, call: _Call, role: str, broken: _Broken, cost: int) -> web.StreamResponse:
        """Continue a stream whose replica broke off mid-answer on other replicas of its revision, at most
        --max-resumptions times; the client's stream ends well-formed either way."""
        relay = call.relay
        assert relay is not None and relay.response is not None
        stream, response = relay.stream, relay.response
        service, model = call.target.service, call.model
        relay.broke_at = self.fleet.clock()
        broke = [broken.pod]    # never sent a continuation again
        tried = list(broke)     # this round of replicas
        refusals: list[float | None] = []
        deadline = self.fleet.clock() + self.settings.resume_timeout
        failure = f"the replica {broken.pod} broke off mid-answer"
        while True:
            if stream.finished:
                # It had said all it would: what is left is the ending (finish, usage, [DONE]).
                await response.write(stream.ending())
                return await self._ended(model, service, response, Resumption.RESUMED)
            why = stream.why_not()
            if why is not None:
                return await self._end_in_error(model, service, response, Resumption.REFUSED, (
                    f"The answer's replica broke off mid-stream and the request cannot be resumed faithfully on "
                    f"another replica: {why}. Send it again."), resume.Code.NOT_RESUMABLE)
            if len(broke) > self.settings.max_resumptions:
                return await self._end_in_error(model, service, response, Resumption.FAILED, (
                    f"The answer's replica broke off mid-stream ({failure}); resumed {len(broke) - 1} times "
                    f"(--max-resumptions). Send it again."), resume.Code.BROKEN)
            picker = self.fleet.picker(model, role)
            pick = None if picker is None else picker.pick(cost, None, exclude=tried, adapter=call.adapter,
                                                           revision=broken.revision, strict=True)
            wait = None if pick is not None else self._resume_wait(picker, broken.revision, broke, refusals, deadline)
            if wait is not None:
                await asyncio.sleep(wait)
                tried, refusals = list(broke), []
                continue
            if picker is None or pick is None:
                return await self._end_in_error(model, service, response, Resumption.FAILED, (
                    f"The answer's replica broke off mid-stream ({failure}) and no other ready replica of its "
                    f"revision{' holding the adapter' if call.adapter else ''} could continue it. Send it again."),
                    resume.Code.BROKEN)
            pod = pick.replica.pod
            tried.append(pod)
            self.metrics.picks.labels(model, role, pick.reason).inc()
            ticket = picker.sent(pod, cost, self.fleet.clock(), None)
            try:
                if await self._continue(call, relay, pick,
                                        lambda: self._ended_now(model, service, Resumption.RESUMED)):
                    await response.write_eof()
                    return response
                failure = f"then {pod} broke off too"
                broke.append(pod)
                tried = list(broke)
            except _Refused as r:
                failure = f"{pod} refused the continuation ({r.status})"
                refusals.append(r.retry_after)
            except _Unreachable as u:
                failure = u.message
                broke.append(pod)
            finally:
                picker.finished(pod, ticket)

    def _resume_wait(self, picker: Picker | None, revision: str, broke: list[str], refusals: list[float | None],
                     deadline: float) -> float | None:
        """How long a continuation that found no replica waits before it looks again (None: it does not,
        the stream ends): for the earliest room the replicas that refused it expect (429/503: the load of
        the one that died came to them), else for a replica of its revision on its way back (its engine
        restarting after the same failure, or its pod Ready before this router's next reading says so);
        within --resume-timeout-seconds."""
        waits = []
        if refusals:
            hints = [h for h in refusals if h is not None]
            waits.append(max(MIN_RESUME_WAIT_SECONDS, min(hints) if hints else self.settings.reading_interval))
        if picker is not None and picker.recovering(revision, exclude=broke):
            waits.append(max(MIN_RESUME_WAIT_SECONDS, self.settings.reading_interval / 4))
        return next((w for w in waits if self.fleet.clock() + w <= deadline), None)

    async def _continue(self, call: _Call, relay: _Relay, pick: Pick, before_end: Callable[[], None]) -> bool:
        """The continuation to one replica: True when its answer ended the stream (``before_end`` ran
        just before its end went out)."""
        stream = relay.stream
        body = json.dumps(stream.continuation()).encode()
        url = f"http://{pick.replica.address}{call.route}"
        headers = {k: v for k, v in call.headers.items() if k.lower() != "content-length"}
        try:
            upstream = await self.http.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise _Unreachable(f"{pick.replica.pod} ({pick.replica.address}): {type(e).__name__}: {e}") from None
        done = False
        try:
            if upstream.status != 200 or not _is_sse(upstream):
                answer = await upstream.read()
                done = True
                if upstream.status in RETRIED_STATUSES and not _replica_down(upstream.status, answer):
                    raise _Refused(upstream.status, answer, upstream.content_type, _retry_after(upstream))
                raise _Unreachable(f"{pick.replica.pod} answered the continuation {upstream.status}: "
                                   f"{answer[:300]!r}")
            ended = await self._pump(call, relay, upstream, before_end)
            if not ended:
                stream.broke()
            done = ended
            return ended
        finally:
            if done:
                upstream.release()
            else:
                upstream.close()

    async def _end_in_error(self, model: str, service: str, response: web.StreamResponse, outcome: str,
                            message: str, code: str) -> web.StreamResponse:
        log.warning("%s: %s", model, message)
        await response.write(resume.error_event(message, code))
        return await self._ended(model, service, response, outcome)

    async def _ended(self, model: str, service: str, response: web.StreamResponse,
                     outcome: str) -> web.StreamResponse:
        self._ended_now(model, service, outcome)
        await response.write_eof()
        return response

    def _ended_now(self, model: str, service: str, outcome: str) -> None:
        self.metrics.resumed_streams.labels(service, outcome).inc()
        self.metrics.requests.labels(model, Outcome.OK if outcome == Resumption.RESUMED else Outcome.ERROR).inc()

    # --- the prefill step of a disaggregated request --------------------------------------

    async def _prefill(self, call: _Call) -> handoff.Handoff | None:
        """Prefill the prompt on a prefill replica: the hand-off for decode, or None when the prefill
        was skipped (counted as a fallback; decode computes the prompt)."""
        model = call.model
        started = self.fleet.clock()
        try:
            params = await asyncio.wait_for(self._prefill_attempts(call), self.settings.prefill_timeout)
        except _PrefillSkipped as skipped:
            self.metrics.prefill_fallbacks.labels(model, skipped.reason).inc()
            # A replica failing is worth a line; capacity (refused, none ready) shows in the metric.
            level = logging.WARNING if skipped.reason in (Fallback.ERROR, Fallback.UNREACHABLE) else logging.DEBUG
            log.log(level, "%s: prefill skipped (%s), decode computes the prompt: %s", model, skipped.reason,
                    skipped.detail)
            return None
        except asyncio.TimeoutError:
            self.metrics.prefill_fallbacks.labels(model, Fallback.TIMEOUT).inc()
            log.debug("%s: no prefill answer within %gs, decode computes the prompt", model,
                      self.settings.prefill_timeout)
            return None
        except asyncio.CancelledError:
            self.metrics.requests.labels(model, Outcome.CANCELLED).inc()
            raise
        self.metrics.prefill_seconds.labels(model).observe(self.fleet.clock() - started)
        self.metrics.handoffs.labels(
            model, TransferParams.NONE if params is None else TransferParams.RETURNED).inc()
        return handoff.Handoff(params)

    async def _prefill_attempts(self, call: _Call) -> dict | None:
        """Up to two prefill replicas, the second after a refusal or a failed connection."""
        model, target = call.model, call.target
        picker = self.fleet.picker(model, Role.PREFILL)
        cost = dataclasses.replace(call.parsed, max_tokens=1).cost_blocks(target.block_size, call.route)
        body = handoff.prefill_body(call.body, call.route)
        # The answer is read here, not passed on: uncompressed, whatever the client accepts.
        headers = {k: v for k, v in call.headers.items() if k.lower() != "accept-encoding"}
        headers["Accept-Encoding"] = "identity"
        reason, detail = Fallback.NO_REPLICA, "no prefill replica is ready"
        if picker is None:
            raise _PrefillSkipped(reason, detail)
        tried: list[str] = []
        for attempt in range(2):
            pick = picker.pick(cost, call.prefix, exclude=tried, adapter=call.adapter)
            if pick is None:
                break
            pod = pick.replica.pod
            tried.append(pod)
            if attempt:
                self.metrics.retries.labels(
                    model, Role.PREFILL, "rejected" if reason == Fallback.REFUSED else "connect_failed").inc()
            ticket = picker.sent(pod, cost, self.fleet.clock(), call.prefix)
            try:
                return await self._prefill_exchange(call, body, headers, pick)
            except _Refused as r:
                reason, detail = Fallback.REFUSED, f"{pod} answered {r.status}"
            except _Unreachable as u:
                reason, detail = Fallback.UNREACHABLE, u.message
            finally:
                picker.finished(pod, ticket)
        raise _PrefillSkipped(reason, detail)

    async def _prefill_exchange(self, call: _Call, body: bytes, headers: dict, pick: Pick) -> dict | None:
        """One prefill request, its whole answer read. Raises _Refused, _Unreachable or _PrefillSkipped."""
        model, pod = call.model, pick.replica.pod
        self.metrics.picks.labels(model, Role.PREFILL, pick.reason).inc()
        if pick.affinity_hit:
            self.metrics.prefix_affinity_hits.labels(model).inc()
        try:
            async with self.http.post(f"http://{pick.replica.address}{call.route}", data=body,
                                      headers=headers) as upstream:
                answer = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _Unreachable(f"{pod} ({pick.replica.address}): {type(e).__name__}: {e}") from None
        if upstream.status in RETRIED_STATUSES:
            raise _Refused(upstream.status, answer, upstream.content_type, _retry_after(upstream))
        if upstream.status >= 300:
            raise _PrefillSkipped(Fallback.ERROR, f"{pod} answered {upstream.status}: {answer[:300]!r}")
        try:
            return handoff.returned_params(answer)
        except handoff.UnreadableAnswer as e:
            raise _PrefillSkipped(Fallback.ERROR, f"{pod} answered {upstream.status} with {e}") from None


@dataclasses.dataclass(frozen=True)
class _Call:
    """One client request on its way through the router."""
    request: web.Request
    route: str                      # the OpenAI path
    body: bytes                     # as the client sent it
    headers: dict[str, str]         # the client's, less hop-by-hop ones
    parsed: rq.Parsed
    target: Route
    arrived: float
    prefix: Prefix | None           # the prompt's leading blocks, for prefix affinity
    adapter: str | None = None      # the LoRA adapter the request names; None: the base model
    relay: _Relay | None = None     # a streamed completion relayed event by event, to resume it on a break

    @property
    def model(self) -> str:
        """The service's served model name: its pickers and metrics (an adapter's request counts there)."""
        return self.target.model


@dataclasses.dataclass
class _Relay:
    """A streamed completion's answer to the client, across the replicas that produce it."""
    stream: resume.Stream
    response: web.StreamResponse | None = None   # the client's, once prepared
    broke_at: float | None = None                 # the last break, until the next replica's first event


class _Broken(Exception):
    """A relayed stream's replica broke off after the client's stream began."""

    def __init__(self, pod: str, revision: str):
        self.pod, self.revision = pod, revision


def _is_sse(resp: aiohttp.ClientResponse) -> bool:
    """An event stream the relay can read (not compressed: bytes pass through undecoded otherwise)."""
    return resp.headers.get("Content-Type", "").startswith("text/event-stream") and \
        resp.headers.get("Content-Encoding", "identity") == "identity"


class _PrefillSkipped(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


class _Refused(Exception):
    def __init__(self, status: int, body: bytes, content_type: str, retry_after: float | None):
        self.status, self.body, self.content_type, self.retry_after = status, body, content_type, retry_after


def _replica_down(status: int, body: bytes) -> bool:
    """A guard's 503 that says the replica itself cannot serve now (its engine is down, or it is shutting
    down): not an answer about capacity. The request goes to another replica as after a failed connection,
    and the client never gets this 503 while another replica can take it or answers with a 429 it honours."""
    if status != 503:
        return False
    try:
        code = (json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return False
    return code in REPLICA_DOWN_CODES


class _Unreachable(Exception):
    def __init__(self, message: str):
        self.message = message


def client_session(settings: RouterSettings) -> aiohttp.ClientSession:
    # No total timeout: an answer streams as long as the guard lets it (it times requests out itself).
    # Bytes pass as they come (no decompression), so Content-Encoding and Content-Length stay true.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout),
        auto_decompress=False)


async def serve(kube: KubeClient, settings: RouterSettings, host: str, port: int,
                stop: asyncio.Event) -> None:
    """Run until ``stop`` is set, then drain: unready (still serving) for the grace, then stop
    listening and let answers in progress finish."""
    metrics = RouterMetrics()
    fleet = Fleet(settings, metrics)
    http = client_session(settings)
    router = Router(fleet, http)
    tasks = [asyncio.create_task(discovery.run(fleet, kube), name="router-discovery"),
             asyncio.create_task(fleet.read(http), name="router-readings")]
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=settings.drain_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("router listening on %s:%d (%s)", host, port,
                 ", ".join(settings.namespaces) if settings.namespaces else "every namespace")
        await stop.wait()
        fleet.draining = True
        log.info("draining: unready for %gs, then answers in progress get up to %gs", settings.drain_grace,
                 settings.drain_timeout)
        await asyncio.sleep(settings.drain_grace)
    finally:
        await runner.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.close()
