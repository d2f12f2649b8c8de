"""The guard's request path: classify, count, admit, forward, account.

``Guard`` wires one guard process together: the admission core
(``gpufleet_engine.admission.core.Admission``), the metrics, the drain, the
engine's status and the handler for the proxied OpenAI routes. Refusals are
exceptions inside and turn into OpenAI-style JSON errors at one place
(``errors.Refusals``); an admitted request is an ``exchange.Exchange``; one
sent on before its parse is ``send_ahead``'s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from aiohttp import web

from gpufleet_api import tracing as names
from gpufleet_api.guard.guard_config import GuardConfig, QueueClass
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_api.tenants.usage import GUARD_TENANT_HEADER, GUARD_WEIGHT_HEADER
from gpufleet_engine.admission import context
from gpufleet_engine.admission.context import ContextTooLong, InvalidRequest
from gpufleet_engine.admission.core import Admission
from gpufleet_engine.admission.grants import Grant, Rejection
from gpufleet_engine.admission.tenant_keys import tenant_name, tenant_weight
from gpufleet_engine.admission.tokens import Tokenizer
from gpufleet_engine.serving.drain import Drain
from gpufleet_engine.serving.errors import Refusals
from gpufleet_engine.serving.exchange import Exchange, Services, Tracked
from gpufleet_engine.serving.memory_report import SequenceLength, kv_waste
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_engine.serving.send_ahead import INLINE_TOKENIZE_BYTES, SendAhead, parse_json, text_bytes
from gpufleet_engine.serving.upstream import Upstream
from gpufleet_engine.vllm.stats import VllmStats
from gpufleet_kit.body_budget import BodyBudget, BodyTooLarge, BudgetExhausted, Claim, read_body
from gpufleet_kit.tracing import Tracing, bind, current, unbind

log = logging.getLogger("gpufleet_engine.serving.guard")


class Guard:
    def __init__(self, config: GuardConfig, tokenizer: Tokenizer | None, upstream: Upstream,
                 clock: Callable[[], float] = time.monotonic, tracing: Tracing | None = None):
        self.upstream = upstream
        self.tracing = tracing or Tracing.off()
        self.clock = clock
        self.context_problem = "not read from vLLM's /v1/models yet"
        self.metrics = GuardMetrics([c.name for c in config.queue_classes], slo=config.slo, role=config.role)
        self.admission = Admission(config, tokenizer, clock=clock, on_context_warning=_warn_context)
        # KV waste compares vLLM's blocks in use with the tokens the guard counted when it read them.
        self.metrics.kv_waste = lambda: kv_waste(self.stats, self.block_size, self.sequences_at_read)[0]
        self.refusals = Refusals(self.admission, self.metrics)
        self.drain = Drain()
        self.engine_up = False
        self.engine_problem = "vLLM has not been reached yet"
        self.tokenizer_problem = "loading"
        self.stats: VllmStats | None = None
        self.tracked: dict[Grant, Tracked] = {}
        self.sequences_at_read: list[SequenceLength] = []  # in-flight lengths when vLLM's metrics were read
        self.on_engine_unreachable: Callable[[], None] = lambda: None
        self.on_engine_up: Callable[[], None] = lambda: None  # vLLM answers again (or for the first time)
        self.services = Services(self.admission, self.metrics, self.refusals, upstream, self.tracked,
                                 lambda: self.on_engine_unreachable())
        self.send_ahead = SendAhead(self.services, self._admit)
        self.body_budget = BodyBudget(config.body_budget_bytes)
        self.configure(config)

    def configure(self, config: GuardConfig) -> None:
        """Put ``config``'s live fields into effect: at start-up and on every live reload (reload.py)."""
        self.admission.configure(config)
        self.body_budget.limit = config.body_budget_bytes   # bodies held past a lowered limit drain out
        self.metrics.add_classes([c.name for c in config.queue_classes])
        self.metrics.max_concurrency.set(config.max_concurrency)
        self.refresh_gauges()

    @property
    def config(self) -> GuardConfig:
        return self.admission.config

    # --- engine status -------------------------------------------------

    @property
    def ready(self) -> bool:
        return (self.engine_up and self.admission.ledger.known and self.admission.known
                and not self.drain.draining)

    def served_context_learned(self, tokens: int) -> None:
        self.admission.served_context_learned(tokens)
        self.context_problem = ""
        self.refresh_gauges()

    def served_context_problem(self, problem: str) -> None:
        self.context_problem = problem

    def tokenizer_loaded(self, tokenizer: Tokenizer, default_max_tokens: int | None) -> None:
        self.admission.tokenizer_loaded(tokenizer, default_max_tokens)
        self.tokenizer_problem = ""
        self.refresh_gauges()

    def tokenizer_failed(self, problem: str) -> None:
        self.tokenizer_problem = problem

    def not_ready_reasons(self) -> list[str]:
        reasons = []
        if self.drain.draining:
            reasons.append(Reason.DRAINING)
        if not self.engine_up:
            reasons.append(f"engine down: {self.engine_problem}")
        elif not self.admission.ledger.known:
            reasons.append("KV pool size not read yet")
        if self.admission.tokenizer is None:
            reasons.append(f"tokenizer not loaded: {self.tokenizer_problem}")
        if self.admission.limits is None:
            reasons.append(f"context length unknown: {self.context_problem}")
        return reasons

    def engine_stats(self, stats: VllmStats) -> None:
        self.stats = stats
        self.sequences_at_read = self.sequences()
        first_read = not self.engine_up  # warn once per (re)connection, not every poll
        if first_read and stats.block_size and stats.block_size != self.config.block_size:
            log.warning("vLLM reports block size %d, guard.json says %d; using vLLM's",
                        stats.block_size, self.config.block_size)
        self.engine_up = True
        self.engine_problem = ""
        self.admission.engine_read(stats.kv_snapshot(), stats.block_size)
        self.refresh_gauges()
        if first_read:
            self.on_engine_up()

    def engine_down(self, problem: str) -> None:
        self.engine_up = False
        self.engine_problem = problem
        self.refresh_gauges()

    def begin_drain(self) -> None:
        self.drain.begin()
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Set the state gauges from the scheduler and the ledger: when /metrics is scraped (and on
        engine and config changes), not on every admission and release, where a dozen gauge
        writes a request were CPU taken from vLLM on a shared host for values nobody read."""
        m, a = self.metrics, self.admission
        for c in self.config.queue_classes:
            m.queue_depth.labels(c.name).set(a.queue.depth(c.name))
        m.in_flight.set(a.scheduler.running)
        m.in_flight_answering.set(sum(t.answering for t in self.tracked.values()))
        m.concurrency_limit.set(a.scheduler.limit)
        m.kv_free_blocks.set(a.ledger.free_blocks())
        m.kv_reserved_blocks.set(a.ledger.reserved_blocks)
        m.kv_total_blocks.set(a.ledger.total_blocks)
        m.kv_watermark_blocks.set(a.ledger.watermark)
        m.engine_up.set(1 if self.engine_up else 0)
        m.ready.set(1 if self.ready else 0)

    @property
    def block_size(self) -> int:
        return self.admission.block_size

    def sequences(self) -> list[SequenceLength]:
        return [SequenceLength(t.tokens) for t in self.tracked.values()]

    # --- the proxied routes ---------------------------------------------

    async def handle(self, request: web.Request, route: str) -> web.StreamResponse:
        if not self.tracing.on:
            return await self._handle(request, route)
        # The request's server span (docs/tracing.md): a client's W3C traceparent honoured, the
        # steps below (admission, the exchange with vLLM, a refusal) written to it where they happen.
        tenant = request.headers.get(GUARD_TENANT_HEADER)
        trace = self.tracing.begin(names.GUARD_REQUEST_SPAN, request.headers, {
            names.HTTP_ROUTE: route, names.GEN_AI_OPERATION: names.OPERATIONS.get(route, route),
            names.GEN_AI_REQUEST_MODEL: self.config.served_model_name, names.SERVICE: self.config.service,
            **({names.TENANT: tenant} if tenant else {})})
        token = bind(trace)
        status = 0
        try:
            response = await self._handle(request, route)
            status = response.status
            return response
        finally:
            unbind(token)
            if status >= 500:
                trace.keep("error")
            trace.end({names.HTTP_STATUS: status} if status else {names.OUTCOME: "cancelled"})

    async def _handle(self, request: web.Request, route: str) -> web.StreamResponse:
        arrived = self.clock()
        config = self.config
        refuse = self.refusals.refuse
        default_class = config.queue_class(config.default_class_by_route[route])
        assert default_class is not None  # the contract checks the routes' classes
        asked = request.headers.get(config.class_header)
        queue_class = config.queue_class(asked.strip()) if asked else default_class
        if queue_class is None:
            names = ", ".join(c.name for c in config.queue_classes)
            return refuse(default_class, Rejection(
                Reason.INVALID_REQUEST, 400, f"Unknown request class {asked!r} in header "
                f"{config.class_header}; use one of: {names}."))
        allowed = config.classes_allowed(route)
        if queue_class not in allowed:
            # A client may yield priority, never take it (classHeaderPolicy).
            names = ", ".join(c.name for c in allowed)
            return refuse(default_class, Rejection(
                Reason.INVALID_REQUEST, 403, f"Request class {queue_class.name!r} is above what {route} "
                f"allows a client to ask for; use one of: {names}."))
        if self.drain.refusing:
            return refuse(queue_class, Rejection(
                Reason.DRAINING, 503, "This replica is shutting down and takes no new requests. "
                "Retry; another replica will serve it.", config.retry_after_seconds))
        if not self.engine_up or not self.admission.known:
            problem = (self.engine_problem if not self.engine_up else f"tokenizer: {self.tokenizer_problem}"
                       if self.admission.tokenizer is None else f"context length: {self.context_problem}")
            return refuse(queue_class, Rejection(
                Reason.ENGINE_DOWN, 503, f"The model engine is not available: {problem}",
                config.retry_after_seconds))
        self.drain.enter()
        # The tenant's key in the class's fair lane, kept until the request is done with the guard.
        tenants = self.admission.tenants
        tenant = tenants.enter(tenant_name(request.headers.get(GUARD_TENANT_HEADER)),
                               tenant_weight(request.headers.get(GUARD_WEIGHT_HEADER)))
        try:
            # The body counts in bodyBudgetBytes from before it is read until the answer is done (it is
            # held through the queue and sent on from it), however the handling ends.
            with self.body_budget.claim() as claim:
                return await self._admit_and_forward(request, route, queue_class, arrived, claim, tenant)
        finally:
            tenants.leave(tenant)
            self.drain.leave()

    async def _prepare(self, raw: bytes, path: str, queue_class: QueueClass, arrived: float,
                       tenant: str) -> context.Prepared:
        """``path``: vLLM's route the request was sent to; its cost model is route_costs'. Raises
        Rejection when, its turn come (parse_lane.py), the request is refused before parsing."""
        admission = self.admission
        if text_bytes(raw) > INLINE_TOKENIZE_BYTES:
            # A long prompt: tokenized on a thread, off the loop and out of the lane.
            body = parse_json(raw)
            return await asyncio.to_thread(admission.prepare, path, body)
        # The requests read since it arrived may have shown an overload; the ones ahead in line,
        # once it is its turn.
        early = admission.early_refusal(queue_class, tenant=tenant)
        if early is not None:
            raise early
        async with admission.lane.turn():
            early = admission.early_refusal(queue_class, waited=self.clock() - arrived, tenant=tenant)
            if early is not None:
                raise early   # raised inside: the lane passes on without a loop turn
            return admission.prepare(path, parse_json(raw))

    async def _read_body(self, request: web.Request, claim: Claim) -> bytes:
        """The body, or Rejection before any of it is parsed: 413 past the limit (a declared length over
        it refused unread, a chunked body read no further), 503 when it does not fit in bodyBudgetBytes."""
        try:
            return await read_body(request, self.body_limit(), claim)
        except BodyTooLarge:
            raise self.body_too_large() from None
        except BudgetExhausted as e:
            raise Rejection(Reason.BODY_BUDGET, 503, body_budget_message(e),
                            self.config.retry_after_seconds) from None

    def body_limit(self) -> int:
        """The largest body read: the model's limit (from its context), and never more than the whole
        budget, which a larger body could never fit in."""
        return min(self.admission.max_body_bytes, self.body_budget.limit)

    def body_too_large(self) -> Rejection:
        limit = self.body_limit()
        if limit < self.admission.max_body_bytes:
            why = "this guard's whole budget for request bodies (bodyBudgetBytes in guard.json)"
        else:
            limits = self.admission.limits
            why = f"derived from its maximum context of {limits.max_context_tokens if limits else 0} tokens"
        return Rejection(Reason.REQUEST_TOO_LARGE, 413,
                         f"The request body is larger than this model's limit of {limit} bytes ({why}).")

    async def _admit_and_forward(self, request: web.Request, route: str, queue_class: QueueClass,
                                 arrived: float, claim: Claim, tenant: str) -> web.StreamResponse:
        refuse = self.refusals.refuse
        early = self.admission.early_refusal(queue_class, tenant=tenant)
        if early is not None:
            # Not even a one-block request fits: refuse before parsing and
            # tokenizing. Under overload most traffic is retries, and the CPU
            # they would cost belongs to the engine.
            return refuse(queue_class, early)
        try:
            raw = await self._read_body(request, claim)
            grant = self.send_ahead.grant_ahead(raw, queue_class, tenant)
            if grant is not None:
                return await self.send_ahead.send(request, route, queue_class, arrived, raw, grant)
            prepared = await self._prepare(raw, request.path, queue_class, arrived, tenant)
        except Rejection as r:
            return refuse(queue_class, r)
        except ContextTooLong as e:
            return refuse(queue_class, Rejection(Reason.CONTEXT_LENGTH, 400, str(e), param="max_tokens"))
        except InvalidRequest as e:
            return refuse(queue_class, Rejection(Reason.INVALID_REQUEST, 400, f"Invalid request: {e}",
                                                 param=e.param))
        return await self._admit(request, route, queue_class, arrived, raw, prepared, tenant)

    async def _admit(self, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                     raw: bytes, prepared: context.Prepared, tenant: str) -> web.StreamResponse:
        with self.services.using(prepared.adapter):
            return await self._admit_prepared(request, route, queue_class, arrived, raw, prepared, tenant)

    async def _admit_prepared(self, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                              raw: bytes, prepared: context.Prepared, tenant: str) -> web.StreamResponse:
        admission = self.admission
        adapter = prepared.adapter
        reservation = admission.reserve(route, queue_class, prepared)
        never = admission.never_fits(reservation)
        if never is not None:
            return self.refusals.refuse(queue_class, never, adapter=adapter)

        exchange = Exchange(self.services, request, route, queue_class, arrived, prepared, reservation)
        trace = current()
        step = trace.step(names.GUARD_ADMISSION_SPAN, {
            names.CLASS: queue_class.name, names.RESERVED_BLOCKS: reservation.cost(admission.block_size)}
            if trace.on else None)
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                try:
                    grant = await admission.acquire(reservation, queue_class, tenant)
                except BaseException as e:
                    trace.end_step(step, error=getattr(e, "reason", type(e).__name__))
                    raise
                trace.end_step(step, {names.QUEUE_WAIT_SECONDS: grant.queued_seconds} if trace.on else None)
                try:
                    return await exchange.forward(raw, grant)
                finally:
                    self._done(grant)
        except Rejection as r:
            return self.refusals.refuse(queue_class, r, stream=prepared.stream, adapter=adapter)
        except TimeoutError:
            return await exchange.timed_out()
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client goes away; leaving
            # the upstream context above already closed vLLM's connection,
            # which makes vLLM abort the request.
            exchange.finish("cancelled")
            raise

    def _done(self, grant: Grant) -> None:
        """An admitted request ended: no longer in flight for the audit, its blocks and slot free."""
        self.tracked.pop(grant, None)
        self.admission.release(grant)


def body_budget_message(e: BudgetExhausted) -> str:
    return (f"This replica holds {e.held} bytes of request bodies now and this body's {e.wanted} more would pass "
            f"its budget of {e.limit} bytes (bodyBudgetBytes in guard.json); retry shortly.")


def _warn_context(configured: int, served: int) -> None:
    log.warning("maxContextTokens %d exceeds the %d tokens vLLM serves; admitting up to %d",
                configured, served, served)
