"""The guard's request path: classify, count, admit, forward, account.

``Guard`` holds the state one guard process needs (KV ledger, queue,
scheduler, metrics, drain, engine status) and the handler for the proxied
OpenAI routes. Refusals are exceptions inside and turn into OpenAI-style JSON
errors at one place, ``_refuse``.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from gpufleet_engine.admission import context, route_costs, sli
from gpufleet_engine.admission.context import ContextTooLong, InvalidRequest, Limits
from gpufleet_engine.admission.demand import Demand, OutputPredictor
from gpufleet_engine.admission.kv_ledger import KvLedger
from gpufleet_engine.admission.parse_lane import ParseLane
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.retry_hint import RetryAdvisor
from gpufleet_engine.admission.scheduler import Grant, Rejection, Scheduler
from gpufleet_engine.admission.tokens import Tokenizer
from gpufleet_engine.admission.ttft_limit import ttft_limit_for
from gpufleet_engine.contract.guard_config import GuardConfig, QueueClass
from gpufleet_engine.contract.guard_metrics import Reason
from gpufleet_engine.serving.audit import SequenceLength, kv_waste
from gpufleet_engine.serving.drain import Drain
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_engine.serving.upstream import FORWARDED_REQUEST_HEADERS, FORWARDED_RESPONSE_HEADERS, Upstream
from gpufleet_engine.vllm.stats import VllmStats

log = logging.getLogger("gpufleet_engine.serving.guard")

TRUNCATED_HEADER = "x-gpufleet-truncated-tokens"
# Bodies with more text than this are tokenized on a worker thread so one long
# prompt does not stall every other request's event-loop work; others inline,
# where a thread hop would cost more than the tokenization. Only text counts:
# numbers (token-id prompts, stop_token_ids, logit_bias) are not tokenized, and
# a burst of such bodies sent to threads spends its time starting threads.
_INLINE_TOKENIZE_BYTES = 16384
_NOT_TEXT = b"0123456789,.-+[]{}: \n"
# The body limit: a prompt of maxContextTokens tokens takes at most ~12 bytes
# a token as JSON (escaped text or token ids); 64 leaves room for message
# structure, tools and small batches, and 1 MiB for everything else.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_FLOOR = 1024 * 1024
# A long stream's inter-chunk gaps reach the ITL histogram every this many gaps, not only at its end.
_FLUSH_GAPS = 256
# usage.completion_tokens (OpenAI routes) or usage.output_tokens (/v1/responses, /v1/messages).
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')


def text_bytes(raw: bytes) -> int:
    """Bytes of ``raw`` that are not numbers or JSON punctuation: about the text to tokenize."""
    if len(raw) <= _INLINE_TOKENIZE_BYTES:
        return len(raw)
    return len(raw.translate(None, _NOT_TEXT))


def max_body_bytes(max_context_tokens: int) -> int:
    """The largest request body the guard reads (413 beyond), derived from the context limit."""
    return BODY_BYTES_FLOOR + BODY_BYTES_PER_TOKEN * max_context_tokens


@dataclass
class _Tracked:
    """An in-flight request as the audit sees it."""
    tokens: int | None


class _Reservation:
    """What one admitted request holds in the ledger, in output tokens per sequence, and how far
    its answer has streamed (SSE events per sequence: about one token each)."""

    def __init__(self, key: tuple[str, str], prepared: context.Prepared, reserved_output: int,
                 variance: float = 0.0):
        self.key = key
        self.prepared = prepared
        self.sequences = len(prepared.prompt_tokens) * prepared.sequences_per_prompt
        self.initial_output = reserved_output
        self.output = reserved_output
        self.variance = variance   # tokens² per sequence, around ``output``
        # Extend when this many events have streamed back (every sequence's share of its reservation).
        self.next_extension = reserved_output * self.sequences if reserved_output < prepared.max_tokens else -1
        self.events = 0


class Guard:
    def __init__(self, config: GuardConfig, tokenizer: Tokenizer | None, upstream: Upstream,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.tokenizer = tokenizer
        self.upstream = upstream
        self.clock = clock
        # The context vLLM serves: engine.maxModelLen, else read from its /v1/models (served_context.py).
        self.served_context: int | None = config.engine.max_model_len if config.engine else None
        self.context_problem = "not read from vLLM's /v1/models yet"
        self.default_max_tokens: int | None = None
        self.limits: Limits | None = None
        self.metrics = GuardMetrics([c.name for c in config.queue_classes], slo=config.slo)
        # KV waste compares vLLM's blocks in use with the tokens the guard counted when it read them.
        self.metrics.kv_waste = lambda: kv_waste(self.stats, self.block_size, self.sequences_at_read)[0]
        self.predicted = config.reservation == "Predicted"
        self.predictor = OutputPredictor()
        self.max_body_bytes = max_body_bytes(0)
        self.update_limits()
        self.ledger = KvLedger(config.kv_watermark_percent, config.reservation_quantile_percent / 100)
        self.queue: MultiLevelQueue = MultiLevelQueue(config.queue_classes, config.aging_seconds,
                                                      config.max_queue_length)
        self.retry = RetryAdvisor(config.retry_after_seconds, clock=clock)
        self.lane = ParseLane()
        self._sending_ahead = 0  # requests sent ahead of their parse, not parsed yet (_send_ahead)
        self.scheduler = Scheduler(self.ledger, self.queue, config.max_concurrency,
                                   config.retry_after_seconds, clock=clock,
                                   aging_seconds=config.aging_seconds, ttft=ttft_limit_for(config),
                                   crowd=self.retry.crowd, arriving=lambda: self.lane.waiting)
        self.drain = Drain()
        self.metrics.max_concurrency.set(config.max_concurrency)
        self.engine_up = False
        self.engine_problem = "vLLM has not been reached yet"
        self.tokenizer_problem = "loading"
        self.stats: VllmStats | None = None
        self.tracked: dict[Grant, _Tracked] = {}
        self.sequences_at_read: list[SequenceLength] = []  # in-flight lengths when vLLM's metrics were read
        self.on_engine_unreachable: Callable[[], None] = lambda: None
        self.refresh_gauges()

    # --- engine status -------------------------------------------------

    @property
    def ready(self) -> bool:
        return (self.engine_up and self.ledger.known and self.tokenizer is not None and self.limits is not None
                and not self.drain.draining)

    def update_limits(self) -> None:
        """The context limits from the config and the context vLLM serves (None while unknown)."""
        served, configured = self.served_context, self.config.max_context_tokens
        if served is None:
            self.limits = None
            return
        if configured is not None and configured > served:
            log.warning("maxContextTokens %d exceeds the %d tokens vLLM serves; admitting up to %d",
                        configured, served, served)
        limit = served if configured is None else min(configured, served)
        self.limits = Limits(limit, self.config.over_length_policy == "TruncateLeft", served,
                             self.default_max_tokens)
        self.max_body_bytes = max_body_bytes(limit)

    def served_context_learned(self, tokens: int) -> None:
        self.served_context = tokens
        self.context_problem = ""
        self.update_limits()
        self.refresh_gauges()

    def set_default_max_tokens(self, tokens: int | None) -> None:
        self.default_max_tokens = tokens
        self.update_limits()

    def not_ready_reasons(self) -> list[str]:
        reasons = []
        if self.drain.draining:
            reasons.append(Reason.DRAINING)
        if not self.engine_up:
            reasons.append(f"engine down: {self.engine_problem}")
        elif not self.ledger.known:
            reasons.append("KV pool size not read yet")
        if self.tokenizer is None:
            reasons.append(f"tokenizer not loaded: {self.tokenizer_problem}")
        if self.limits is None:
            reasons.append(f"context length unknown: {self.context_problem}")
        return reasons

    def engine_stats(self, stats: VllmStats) -> None:
        self.stats = stats
        self.sequences_at_read = self.sequences()
        self.ledger.observe(stats.kv_snapshot())
        first_read = not self.engine_up  # warn once per (re)connection, not every poll
        if first_read and stats.block_size and stats.block_size != self.config.block_size:
            log.warning("vLLM reports block size %d, guard.json says %d; using vLLM's",
                        stats.block_size, self.config.block_size)
        self.engine_up = True
        self.engine_problem = ""
        self.scheduler.dispatch()  # a request waiting for blocks may fit vLLM's fresh view
        self.refresh_gauges()

    def engine_down(self, problem: str) -> None:
        self.engine_up = False
        self.engine_problem = problem
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Set the state gauges from the scheduler and the ledger: when /metrics is scraped (and on
        engine and config changes), not on every admission and release, where a dozen gauge
        writes a request were CPU taken from vLLM on a shared host for values nobody read."""
        m = self.metrics
        for c in self.config.queue_classes:
            m.queue_depth.labels(c.name).set(self.queue.depth(c.name))
        m.in_flight.set(self.scheduler.running)
        m.concurrency_limit.set(self.scheduler.limit)
        m.kv_free_blocks.set(self.ledger.free_blocks())
        m.kv_reserved_blocks.set(self.ledger.reserved_blocks)
        m.kv_total_blocks.set(self.ledger.total_blocks)
        m.kv_watermark_blocks.set(self.ledger.watermark)
        m.engine_up.set(1 if self.engine_up else 0)
        m.ready.set(1 if self.ready else 0)

    @property
    def block_size(self) -> int:
        return (self.stats.block_size if self.stats and self.stats.block_size else self.config.block_size)

    def sequences(self) -> list[SequenceLength]:
        return [SequenceLength(t.tokens) for t in self.tracked.values()]

    # --- the proxied routes ---------------------------------------------

    async def handle(self, request: web.Request, route: str) -> web.StreamResponse:
        arrived = self.clock()
        default_class = self.config.queue_class(self.config.default_class_by_route[route])
        asked = request.headers.get(self.config.class_header)
        queue_class = self.config.queue_class(asked.strip()) if asked else default_class
        if queue_class is None:
            names = ", ".join(c.name for c in self.config.queue_classes)
            return self._refuse(default_class, Rejection(
                Reason.INVALID_REQUEST, 400, f"Unknown request class {asked!r} in header "
                f"{self.config.class_header}; use one of: {names}."))
        allowed = self.config.classes_allowed(route)
        if queue_class not in allowed:
            # A client may yield priority, never take it (classHeaderPolicy).
            names = ", ".join(c.name for c in allowed)
            return self._refuse(default_class, Rejection(
                Reason.INVALID_REQUEST, 403, f"Request class {queue_class.name!r} is above what {route} "
                f"allows a client to ask for; use one of: {names}."))
        if self.drain.refusing:
            return self._refuse(queue_class, Rejection(
                Reason.DRAINING, 503, "This replica is shutting down and takes no new requests. "
                "Retry; another replica will serve it.", self.config.retry_after_seconds))
        if not self.engine_up or self.tokenizer is None or self.limits is None:
            problem = (self.engine_problem if not self.engine_up else f"tokenizer: {self.tokenizer_problem}"
                       if self.tokenizer is None else f"context length: {self.context_problem}")
            return self._refuse(queue_class, Rejection(
                Reason.ENGINE_DOWN, 503, f"The model engine is not available: {problem}",
                self.config.retry_after_seconds))
        self.drain.enter()
        try:
            return await self._admit_and_forward(request, route, queue_class, arrived)
        finally:
            self.drain.leave()

    async def _prepare(self, raw: bytes, path: str, queue_class: QueueClass, arrived: float) -> context.Prepared:
        """``path``: vLLM's route the request was sent to; its cost model is route_costs'. Raises
        Rejection when, its turn come (parse_lane.py), the request is refused before parsing."""
        if text_bytes(raw) > _INLINE_TOKENIZE_BYTES:
            # A long prompt: tokenized on a thread, off the loop and out of the lane.
            body = _json(raw)
            return await asyncio.to_thread(route_costs.prepare, path, body, self.tokenizer, self._limits())
        # The requests read since it arrived may have shown an overload; the ones ahead in line,
        # once it is its turn.
        early = self.scheduler.early_refusal(queue_class)
        if early is not None:
            raise early
        async with self.lane.turn():
            early = self.scheduler.early_refusal(queue_class, waited=self.clock() - arrived)
            if early is not None:
                raise early   # raised inside: the lane passes on without a loop turn
            return route_costs.prepare(path, _json(raw), self.tokenizer, self._limits())

    def _limits(self) -> Limits:
        assert self.limits is not None  # handle() refuses requests until the context is known
        return self.limits

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, or Rejection 413 past the limit, before any of it is parsed. A declared length
        over the limit is refused without reading; a chunked body stops being read at the limit."""
        limit = self.max_body_bytes
        declared = request.content_length
        if declared is None or declared <= limit:
            # Read here rather than with request.read(): the limit follows the context length,
            # which the guard learns from vLLM and may reload, after the app was built.
            body = bytearray()
            async for chunk in request.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > limit:
                    break
            else:
                return bytes(body)
        context_tokens = self.limits.max_context_tokens if self.limits else 0
        raise Rejection(Reason.REQUEST_TOO_LARGE, 413,
                        f"The request body is larger than this model's limit of {limit} bytes (derived "
                        f"from its maximum context of {context_tokens} tokens).")

    def _reservation(self, route: str, queue_class: QueueClass, prepared: context.Prepared) -> _Reservation:
        """Output tokens per sequence to reserve: the learned mean and its variance (Predicted), or
        the budget."""
        key = (route, queue_class.name)
        budget = prepared.max_tokens
        demand = self.predictor.reserve(key, budget) if self.predicted and budget else Demand(budget)
        output = demand.tokens
        if self.predicted and budget and self.ledger.known:
            # Never reserve more than the pool: what does not fit it would be
            # refused while vLLM could still serve it (answers end early).
            while output > 1 and not self.ledger.fits_empty(prepared.block_cost(self.block_size, output)):
                output = max(1, output // 2)
        return _Reservation(key, prepared, output, demand.variance)

    def _never_fits(self, prepared: context.Prepared, reservation: _Reservation) -> Rejection | None:
        """400 for a request no replica of this size could run, whatever the load."""
        cost = prepared.block_cost(self.block_size, reservation.output)
        if self.ledger.fits_empty(cost):
            return None
        bs, total = self.block_size, self.ledger.total_blocks
        sequences = reservation.sequences
        what = (f"{prepared.total_prompt_tokens} prompt tokens and up to {prepared.max_tokens} completion "
                f"tokens per sequence, {sequences} sequence{'s' if sequences > 1 else ''}")
        return Rejection(
            Reason.EXCEEDS_KV_POOL, 400,
            f"This request cannot fit this model's KV cache even when it is empty: it has {what}, "
            f"{cost} blocks of {bs} tokens at least, but a replica holds {self.ledger.capacity} "
            f"({total} blocks, {total * bs} tokens). Send fewer or shorter prompts, fewer sequences (n) "
            f"or a lower max_tokens.")

    async def _admit_and_forward(self, request: web.Request, route: str, queue_class: QueueClass,
                                 arrived: float) -> web.StreamResponse:
        early = self.scheduler.early_refusal(queue_class)
        if early is not None:
            # Not even a one-block request fits: refuse before parsing and
            # tokenizing. Under overload most traffic is retries, and the CPU
            # they would cost belongs to the engine.
            return self._refuse(queue_class, early)
        try:
            raw = await self._read_body(request)
            grant = self._grant_ahead(raw, queue_class)
            if grant is not None:
                return await self._send_ahead(request, route, queue_class, arrived, raw, grant)
            prepared = await self._prepare(raw, request.path, queue_class, arrived)
        except Rejection as r:
            return self._refuse(queue_class, r)
        except ContextTooLong as e:
            return self._refuse(queue_class, Rejection(Reason.CONTEXT_LENGTH, 400, str(e), param="max_tokens"))
        except InvalidRequest as e:
            return self._refuse(queue_class, Rejection(Reason.INVALID_REQUEST, 400, f"Invalid request: {e}",
                                                       param=e.param))
        return await self._admit(request, route, queue_class, arrived, raw, prepared)

    async def _admit(self, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                     raw: bytes, prepared: context.Prepared) -> web.StreamResponse:
        reservation = self._reservation(route, queue_class, prepared)
        never = self._never_fits(prepared, reservation)
        if never is not None:
            return self._refuse(queue_class, never)

        exchange = _Exchange(self, request, route, queue_class, arrived, prepared, reservation)
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                cost = prepared.block_cost(self.block_size, reservation.output)
                grant = await self.scheduler.acquire(cost, queue_class, self._block_variance(reservation),
                                                     start_tokens=prepared.total_prompt_tokens
                                                     if prepared.stream else 0)
                self.retry.admitted()
                try:
                    return await exchange.forward(raw, grant)
                finally:
                    self._done(grant)
        except Rejection as r:
            return self._refuse(queue_class, r, stream=prepared.stream)
        except TimeoutError:
            return await exchange.timed_out()
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client goes away; leaving
            # the upstream context above already closed vLLM's connection,
            # which makes vLLM abort the request.
            exchange.finish("cancelled")
            raise

    def _grant_ahead(self, raw: bytes, queue_class: QueueClass) -> Grant | None:
        """A grant for sending ``raw`` on before it is parsed (``_send_ahead``), where the replica
        is far from full and nobody is in line to be parsed; else None. Its bound: one sequence
        of the whole context, the most a single-sequence request can hold (a request found to
        need more, n > 1 or a batch, is settled or admitted anew once parsed)."""
        limits = self._limits()
        context_tokens = limits.max_context_tokens
        if (self._sending_ahead or self.lane.waiting or text_bytes(raw) > _INLINE_TOKENIZE_BYTES
                or (limits.max_model_len is not None and context_tokens < limits.max_model_len)):
            # Below vLLM's own context the guard refuses (or truncates) requests vLLM would run:
            # sent ahead, vLLM would start them. At vLLM's context, vLLM refuses what the guard
            # refuses for length, and the copy sent ahead costs it no more than the client would.
            return None
        return self.scheduler.grant_ahead(-(-context_tokens // self.block_size), queue_class, context_tokens)

    async def _send_ahead(self, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                          raw: bytes, grant: Grant) -> web.StreamResponse:
        """Send the body on to vLLM as the client sent it, then parse and count it while it
        travels, instead of before: the guard's way in (parse, count, reserve, ~0.5 ms of Python
        per request) leaves the path to vLLM's first token. Nothing of vLLM's answer reaches
        the client before the parse admits the request as it was sent (``_Exchange.relay``
        waits for it). Where it does not — invalid, too long for the context, a body the guard
        must change (truncation, a max_tokens to fill in), more blocks than the bound held and
        the pool has — vLLM's connection is closed, which aborts the request there, and the
        parsed request takes the ordinary way: refused with the same answer, or admitted anew."""
        self._sending_ahead += 1
        verdict: asyncio.Future[_Exchange] = asyncio.get_running_loop().create_future()
        sent = asyncio.ensure_future(_forward(self, request, raw, grant, verdict))
        try:
            try:
                # aiohttp buffers the headers in the POST's first step and writes them with the
                # body in a task of its own: two loop turns put the request on the wire, on a
                # kept-alive connection (opening a new one takes more; the parse then runs first).
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            finally:
                self._sending_ahead -= 1
            prepared = route_costs.prepare(request.path, _json(raw), self.tokenizer, self._limits())
            reservation = self._reservation(route, queue_class, prepared)
            cost = prepared.block_cost(self.block_size, reservation.output)
            kept = not prepared.changed and self.scheduler.settle(
                grant, cost, self._block_variance(reservation),
                prepared.total_prompt_tokens if prepared.stream else 0)
        except BaseException:
            await self._withdraw(sent, grant, queue_class)
            raise
        if not kept:
            await self._withdraw(sent, grant, queue_class)
            return await self._admit(request, route, queue_class, arrived, raw, prepared)
        self.retry.admitted()
        self.metrics.sent_ahead.labels(queue_class.name, "kept").inc()
        exchange = _Exchange(self, request, route, queue_class, arrived, prepared, reservation)
        exchange.dispatched(grant)
        verdict.set_result(exchange)
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds - (self.clock() - arrived)):
                return await sent  # cancelled with the handler (the client gone) or by the timeout
        except TimeoutError:
            return await exchange.timed_out()
        except asyncio.CancelledError:
            exchange.finish("cancelled")
            raise
        finally:
            self._done(grant)

    def _done(self, grant: Grant) -> None:
        """An admitted request ended: no longer in flight for the audit, its blocks and slot free."""
        self.tracked.pop(grant, None)
        self.scheduler.release(grant)

    async def _withdraw(self, sent: asyncio.Future, grant: Grant, queue_class: QueueClass) -> None:
        """Abort the copy sent ahead and give its bound back."""
        await _abort(sent)
        self.scheduler.release(grant)
        self.metrics.sent_ahead.labels(queue_class.name, "aborted").inc()

    def grow(self, grant: Grant, reservation: _Reservation) -> None:
        """The answer streamed past its reservation: reserve what answers that long went on to use."""
        prepared = reservation.prepared
        seen = reservation.events // reservation.sequences
        demand = self.predictor.extension(reservation.key, seen, prepared.max_tokens)
        new_output = demand.tokens
        if new_output <= reservation.output:
            reservation.next_extension = -1
            return
        old_cost = prepared.block_cost(self.block_size, reservation.output)
        reservation.output = new_output
        reservation.variance = demand.variance
        self.scheduler.extend(grant, prepared.block_cost(self.block_size, new_output) - old_cost,
                              self._block_variance(reservation))
        reservation.next_extension = (new_output * reservation.sequences
                                      if new_output < prepared.max_tokens else -1)
        self.metrics.reservation_extensions.labels(reservation.key[1]).inc()

    def _block_variance(self, reservation: _Reservation) -> float:
        """The variance of a reservation in blocks²: its sequences' answers vary independently."""
        return reservation.sequences * reservation.variance / self.block_size ** 2

    def learn(self, reservation: _Reservation, completion_tokens: int | None) -> None:
        """A finished answer: its length per sequence joins the distribution."""
        if completion_tokens is None or reservation.prepared.max_tokens == 0:
            return
        per_sequence = math.ceil(completion_tokens / reservation.sequences)
        route, name = reservation.key
        self.predictor.observe(reservation.key, per_sequence)
        m = self.metrics
        m.output_tokens.labels(route, name).observe(per_sequence)
        m.output_prediction_ratio.labels(route, name).observe(per_sequence / max(1, reservation.initial_output))
        predicted = self.predictor.prediction(reservation.key)
        if predicted is not None:
            m.output_tokens_predicted.labels(route, name).set(predicted)

    def _refuse(self, queue_class: QueueClass, r: Rejection, stream: bool | None = None) -> web.Response:
        """``stream``: whether the refused request asked to stream; None when it was not read."""
        if r.status == 429 and r.retry_after is not None:
            r.retry_after = self.retry.refused()  # sized to the crowd (retry_hint.py)
        self.metrics.rejections.labels(queue_class.name, r.reason).inc()
        self.metrics.count_sli(queue_class.name, sli.judge_refusal(r.reason, stream))
        invalid = r.status in (400, 403, 413)
        self.metrics.requests.labels(queue_class.name, "invalid" if invalid else "rejected").inc()
        if invalid:
            return invalid_response(r.status, r.message, r.param)
        return error_response(r.status, r.reason, r.message, r.retry_after)


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise InvalidRequest(f"the body is not valid JSON: {e}") from None


def invalid_response(status: int, message: str, param: str | None = None) -> web.Response:
    """A client error in vLLM's own format, so clients see the same 4xx with or without the guard."""
    kind = {400: "BadRequestError", 403: "PermissionDeniedError",
            413: "RequestEntityTooLargeError"}.get(status, "BadRequestError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def error_response(status: int, code: str, message: str, retry_after: float | None = None,
                   jitter: Callable[[], float] = random.random) -> web.Response:
    headers = {}
    if retry_after is not None:
        # Retry-After takes whole seconds; the OpenAI clients also read the
        # finer retry-after-ms. That one is spread over 0.5–1.5× the hint:
        # clients refused together would otherwise come back together, in
        # herds that leave freed KV blocks idle between them.
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
        headers["retry-after-ms"] = str(int(retry_after * 1000 * (0.5 + jitter())))
    body = {"error": {"message": message, "type": _error_type(status), "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
            504: "timeout"}.get(status, "server_error")


class _Exchange:
    """One admitted request on its way to vLLM and back."""

    def __init__(self, guard: Guard, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                 prepared: context.Prepared, reservation: _Reservation):
        self.guard = guard
        self.request = request
        self.route = route
        self.queue_class = queue_class
        self.arrived = arrived
        self.prepared = prepared
        self.reservation = reservation
        self.response: web.StreamResponse | None = None
        self.tracked = _Tracked(None)
        self.finished = False
        self.ttft_seconds: float | None = None
        self.gaps = self.late_gaps = 0

    def finish(self, outcome: str) -> None:
        if self.finished:
            return
        self.finished = True
        m = self.guard.metrics
        seconds = self.guard.clock() - self.arrived
        m.requests.labels(self.queue_class.name, outcome).inc()
        if outcome == "ok":
            m.request_seconds.labels(self.queue_class.name).observe(seconds)
        m.count_sli(self.queue_class.name, sli.judge(self.guard.config.slo, sli.Request(
            self.prepared.stream, outcome, seconds, self.ttft_seconds, self.gaps, self.late_gaps)))

    def _extra_headers(self) -> dict[str, str]:
        if self.prepared.truncated_tokens:
            return {TRUNCATED_HEADER: str(self.prepared.truncated_tokens)}
        return {}

    def dispatched(self, grant: Grant) -> None:
        """Admitted and on its way to vLLM: its queue time counted, and in flight for the audit
        from now (a request that does not stream gets vLLM's headers only with its whole answer)."""
        guard = self.guard
        guard.metrics.queue_seconds.labels(self.queue_class.name).observe(grant.queued_seconds)
        single = len(self.prepared.prompt_tokens) == 1 and self.prepared.sequences_per_prompt == 1
        self.tracked = _Tracked(self.prepared.prompt_tokens[0] if single and self.prepared.stream else None)
        guard.tracked[grant] = self.tracked

    async def forward(self, raw: bytes, grant: Grant) -> web.StreamResponse:
        self.dispatched(grant)
        payload = json.dumps(self.prepared.body).encode() if self.prepared.changed else raw
        return await _forward(self.guard, self.request, payload, grant, self)

    async def relay(self, resp: aiohttp.ClientResponse, grant: Grant) -> web.StreamResponse:
        """vLLM's answer to the client, and the request accounted."""
        out_headers = {h: resp.headers[h] for h in FORWARDED_RESPONSE_HEADERS if h in resp.headers}
        out_headers.update(self._extra_headers())
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._stream(resp, out_headers, grant)
        body = await resp.read()
        self.finish(_outcome(resp.status))
        if resp.status == 200:
            self.guard.learn(self.reservation, _completion_tokens(body))
        return web.Response(body=body, status=resp.status, headers=out_headers)

    def unreachable(self) -> web.Response:
        guard = self.guard
        guard.on_engine_unreachable()
        self.finished = True  # counted as a refusal below, not as a request outcome
        return guard._refuse(self.queue_class, Rejection(
            Reason.ENGINE_DOWN, 503, "The model engine is not accepting connections. Retry later.",
            guard.config.retry_after_seconds), stream=self.prepared.stream)

    def failed(self, e: aiohttp.ClientError) -> web.StreamResponse:
        if self.response is not None:
            log.warning("vLLM dropped a stream: %r", e)
            self.finish("error")
            return self.response
        log.warning("vLLM failed a request before answering: %r", e)
        self.guard.on_engine_unreachable()
        self.finish("error")
        return error_response(502, "engine_error", f"The model engine failed mid-request: {e}")

    async def _stream(self, resp: aiohttp.ClientResponse, headers: dict[str, str],
                      grant: Grant) -> web.StreamResponse:
        tracked, route = self.tracked, self.route  # locals: read per chunk
        m = self.guard.metrics
        name = self.queue_class.name
        clock = self.guard.clock
        # Per chunk only a clock read, a bisection and a few local sums: every CPU cycle the
        # guard spends per token is taken from vLLM on a shared host. The gaps are counted into
        # the ITL histogram's buckets here and added to it every FLUSH_GAPS and at the end.
        itl = m.itl_seconds.labels(name)
        bounds = m.itl_seconds.bounds
        counts = [0] * (len(bounds) + 1)
        gap_sum = 0.0
        itl_objective = self.guard.config.slo.itl_p99_seconds
        bisect_left = bisect.bisect_left
        late = gaps = 0
        flush_at = _FLUSH_GAPS
        out = web.StreamResponse(status=resp.status, headers=headers)
        self.response = out
        reservation = self.reservation
        last: float | None = None
        previous = chunk = b""
        try:
            try:
                await out.prepare(self.request)
                async for data in resp.content.iter_any():
                    previous, chunk = chunk, data  # the usage event may straddle the last two
                    await out.write(chunk)
                    now = clock()
                    if last is None:
                        self.ttft_seconds = now - self.arrived
                        m.ttft_seconds.labels(name).observe(self.ttft_seconds)
                        self.guard.scheduler.first_token(grant, now, self.prepared.total_prompt_tokens)
                    else:
                        gap = now - last
                        counts[bisect_left(bounds, gap)] += 1
                        gap_sum += gap
                        gaps += 1
                        if gap > itl_objective:
                            late += 1
                        if gaps == flush_at:
                            itl.add(counts, gap_sum)
                            counts = [0] * len(counts)
                            gap_sum = 0.0
                            flush_at += _FLUSH_GAPS
                    last = now
                    # One SSE event per generated token in vLLM's default
                    # streaming, give or take the role and usage events.
                    events = chunk.count(b"data: ")
                    reservation.events += events
                    if tracked.tokens is not None:
                        tracked.tokens += events
                    if 0 <= reservation.next_extension <= reservation.events:
                        self.guard.grow(grant, reservation)
            finally:
                # However the stream ends (done, the client gone, the timeout): its gaps count.
                itl.add(counts, gap_sum)
                self.gaps, self.late_gaps = gaps, late
        except ConnectionResetError:
            self.finish("cancelled")  # the client went away; leaving the context aborts vLLM's request
            return out
        await out.write_eof()
        self.finish(_outcome(resp.status))
        if resp.status == 200:
            counted = _completion_tokens(previous[-512:] + chunk)  # the usage event, when the client asked for it
            if counted is None:
                # Without usage: the events, less [DONE] and chat's role event per sequence.
                overhead = 1 + (reservation.sequences if route == context.CHAT else 0)
                counted = max(0, reservation.events - overhead)
            self.guard.learn(reservation, counted)
        return out

    async def timed_out(self) -> web.StreamResponse:
        seconds = self.guard.config.request_timeout_seconds
        message = f"The request did not finish within {seconds:g}s (requestTimeoutSeconds)."
        self.finish("timeout")
        if self.response is None:
            return error_response(504, "timeout", message)
        # Headers are gone already; end the stream with an error event the
        # way vLLM reports errors mid-stream.
        try:
            event = {"error": {"message": message, "type": "timeout", "param": None, "code": 504}}
            await self.response.write(f"data: {json.dumps(event)}\n\n".encode())
            await self.response.write_eof()
        except ConnectionResetError:
            pass
        return self.response


async def _forward(guard: Guard, request: web.Request, payload: bytes, grant: Grant,
                   exchange: _Exchange | asyncio.Future[_Exchange]) -> web.StreamResponse:
    """POST ``payload`` to vLLM and relay its answer. ``exchange``: a future when the request is
    sent ahead of its parse (``Guard._send_ahead``): nothing is relayed or accounted before it
    is set; the task is cancelled instead when the parse does not admit the request as sent."""
    headers = {h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers}
    headers["content-type"] = "application/json"
    assert guard.upstream.session is not None
    try:
        async with _post_once_more_if_closed(guard.upstream.session, guard.upstream.url(request.path), payload,
                                             headers) as resp:
            return await (await _admitted(exchange)).relay(resp, grant)
    except aiohttp.ClientConnectorError:
        return (await _admitted(exchange)).unreachable()
    except aiohttp.ClientError as e:
        return (await _admitted(exchange)).failed(e)


async def _admitted(exchange: _Exchange | asyncio.Future[_Exchange]) -> _Exchange:
    """The exchange, once the parse of a request sent ahead has admitted it."""
    return exchange if isinstance(exchange, _Exchange) else await exchange


async def _abort(sent: asyncio.Future) -> None:
    """Cancel a request sent ahead (``Guard._send_ahead``) and wait until it is gone: leaving
    aiohttp's request early closes vLLM's connection, which aborts the request there."""
    sent.cancel()
    await asyncio.wait([sent])
    if not sent.cancelled():
        sent.exception()  # retrieved: it ended before the cancel took, and it is moot


@contextlib.asynccontextmanager
async def _post_once_more_if_closed(session: aiohttp.ClientSession, url: str, payload: bytes,
                                    headers: dict[str, str]):
    """POST, sent again once if the pooled connection turned out closed before any answer: vLLM
    closed it while idle and never read the request, so sending it again duplicates nothing."""
    answered = False
    try:
        async with session.post(url, data=payload, headers=headers) as resp:
            answered = True
            yield resp
            return
    except aiohttp.ServerDisconnectedError:
        if answered:
            raise
    async with session.post(url, data=payload, headers=headers) as resp:
        yield resp


def _completion_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of a response body or final SSE chunk, if it is there."""
    found = _COMPLETION_TOKENS.search(body)
    return int(found.group(1)) if found else None


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "invalid" if status < 500 else "error"
