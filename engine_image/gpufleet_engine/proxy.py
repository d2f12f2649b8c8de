"""The guard's request path: classify, count, admit, forward, account.

``Guard`` holds the state one guard process needs (KV ledger, queue,
scheduler, metrics, drain, engine status) and the handler for the proxied
OpenAI routes. Refusals are exceptions inside and turn into OpenAI-style JSON
errors at one place, ``_refuse``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp
from aiohttp import web

from . import context
from .admission import KvLedger
from .audit import SequenceLength
from .context import ContextTooLong, InvalidRequest, Limits
from .contract.guard_config import GuardConfig, QueueClass
from .contract.guard_metrics import Reason
from .drain import Drain
from .metrics import GuardMetrics
from .queues import MultiLevelQueue
from .retry_hint import RetryAdvisor
from .scheduler import Grant, Rejection, Scheduler
from .tokens import Tokenizer
from .upstream import FORWARDED_REQUEST_HEADERS, FORWARDED_RESPONSE_HEADERS, Upstream
from .vllm_metrics import VllmStats

log = logging.getLogger("gpufleet_engine.proxy")

TRUNCATED_HEADER = "x-gpufleet-truncated-tokens"
# Bodies larger than this are tokenized on a worker thread so one long prompt
# does not stall every other request's event-loop work; small ones inline,
# where a thread hop would cost more than the tokenization.
_INLINE_TOKENIZE_BYTES = 16384


@dataclass
class _Tracked:
    """An in-flight request as the audit sees it."""
    tokens: int | None


class Guard:
    def __init__(self, config: GuardConfig, tokenizer: Tokenizer | None, upstream: Upstream,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.tokenizer = tokenizer
        self.upstream = upstream
        self.clock = clock
        self.limits = Limits(config.max_context_tokens, config.over_length_policy == "TruncateLeft")
        self.metrics = GuardMetrics([c.name for c in config.queue_classes])
        self.ledger = KvLedger(config.kv_watermark_percent)
        self.queue: MultiLevelQueue = MultiLevelQueue(config.queue_classes, config.aging_seconds,
                                                      config.max_queue_length)
        self.scheduler = Scheduler(self.ledger, self.queue, config.max_concurrency,
                                   config.retry_after_seconds, clock=clock, on_change=self.refresh_gauges)
        self.retry = RetryAdvisor(config.retry_after_seconds, clock=clock)
        self.drain = Drain()
        self.metrics.max_concurrency.set(config.max_concurrency)
        self.engine_up = False
        self.engine_problem = "vLLM has not been reached yet"
        self.tokenizer_problem = "loading"
        self.stats: VllmStats | None = None
        self.tracked: dict[Grant, _Tracked] = {}
        self.on_engine_unreachable: Callable[[], None] = lambda: None
        self.refresh_gauges()

    # --- engine status -------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.engine_up and self.ledger.known and self.tokenizer is not None and not self.drain.draining

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
        return reasons

    def engine_stats(self, stats: VllmStats) -> None:
        self.stats = stats
        self.ledger.observe(stats.kv_snapshot())
        first_read = not self.engine_up  # warn once per (re)connection, not every poll
        if first_read and stats.block_size and stats.block_size != self.config.block_size:
            log.warning("vLLM reports block size %d, guard.json says %d; using vLLM's",
                        stats.block_size, self.config.block_size)
        self.engine_up = True
        self.engine_problem = ""
        self.refresh_gauges()

    def engine_down(self, problem: str) -> None:
        self.engine_up = False
        self.engine_problem = problem
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        m = self.metrics
        for c in self.config.queue_classes:
            m.queue_depth.labels(c.name).set(self.queue.depth(c.name))
        m.in_flight.set(self.scheduler.running)
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
        if self.drain.draining:
            return self._refuse(queue_class, Rejection(
                Reason.DRAINING, 503, "This replica is shutting down and takes no new requests. "
                "Retry; another replica will serve it.", self.config.retry_after_seconds))
        if not self.engine_up or self.tokenizer is None:
            problem = self.engine_problem if not self.engine_up else f"tokenizer: {self.tokenizer_problem}"
            return self._refuse(queue_class, Rejection(
                Reason.ENGINE_DOWN, 503, f"The model engine is not available: {problem}",
                self.config.retry_after_seconds))
        self.drain.enter()
        try:
            return await self._admit_and_forward(request, route, queue_class, arrived)
        finally:
            self.drain.leave()

    async def _prepare(self, raw: bytes, route: str) -> context.Prepared:
        body = json.loads(raw)
        if len(raw) > _INLINE_TOKENIZE_BYTES:
            return await asyncio.to_thread(context.prepare, route, body, self.tokenizer, self.limits)
        return context.prepare(route, body, self.tokenizer, self.limits)

    async def _admit_and_forward(self, request: web.Request, route: str, queue_class: QueueClass,
                                 arrived: float) -> web.StreamResponse:
        if not self.ledger.evaluate(1).admitted:
            # Not even a one-block request fits: refuse before parsing and
            # tokenizing. Under overload most traffic is retries, and the CPU
            # they would cost belongs to the engine.
            return self._refuse(queue_class, self.scheduler.kv_rejection(1))
        raw = await request.read()
        try:
            prepared = await self._prepare(raw, route)
        except ContextTooLong as e:
            return self._refuse(queue_class, Rejection(Reason.CONTEXT_LENGTH, 400, str(e)))
        except (InvalidRequest, ValueError) as e:
            return self._refuse(queue_class, Rejection(Reason.INVALID_REQUEST, 400, f"Invalid request: {e}"))

        exchange = _Exchange(self, request, queue_class, arrived, prepared)
        try:
            async with asyncio.timeout(self.config.request_timeout_seconds):
                grant = await self.scheduler.acquire(prepared.block_cost(self.block_size), queue_class)
                self.retry.admitted()
                try:
                    return await exchange.forward(raw, route, grant)
                finally:
                    self.tracked.pop(grant, None)
                    self.scheduler.release(grant)
        except Rejection as r:
            return self._refuse(queue_class, r)
        except TimeoutError:
            return await exchange.timed_out()
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client goes away; leaving
            # the upstream context above already closed vLLM's connection,
            # which makes vLLM abort the request.
            exchange.finish("cancelled")
            raise

    def _refuse(self, queue_class: QueueClass, r: Rejection) -> web.Response:
        if r.status == 429 and r.retry_after is not None:
            r.retry_after = self.retry.refused()  # sized to the crowd (retry_hint.py)
        self.metrics.rejections.labels(queue_class.name, r.reason).inc()
        self.metrics.requests.labels(queue_class.name, "rejected").inc()
        return error_response(r.status, r.reason, r.message, r.retry_after)


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

    def __init__(self, guard: Guard, request: web.Request, queue_class: QueueClass, arrived: float,
                 prepared: context.Prepared):
        self.guard = guard
        self.request = request
        self.queue_class = queue_class
        self.arrived = arrived
        self.prepared = prepared
        self.response: web.StreamResponse | None = None
        self.finished = False

    def finish(self, outcome: str) -> None:
        if self.finished:
            return
        self.finished = True
        m = self.guard.metrics
        m.requests.labels(self.queue_class.name, outcome).inc()
        if outcome == "ok":
            m.request_seconds.labels(self.queue_class.name).observe(self.guard.clock() - self.arrived)

    def _extra_headers(self) -> dict[str, str]:
        if self.prepared.truncated_tokens:
            return {TRUNCATED_HEADER: str(self.prepared.truncated_tokens)}
        return {}

    async def forward(self, raw: bytes, route: str, grant: Grant) -> web.StreamResponse:
        guard = self.guard
        guard.metrics.queue_seconds.labels(self.queue_class.name).observe(grant.queued_seconds)
        single = len(self.prepared.prompt_tokens) == 1 and self.prepared.sequences_per_prompt == 1
        tracked = _Tracked(self.prepared.prompt_tokens[0] if single and self.prepared.stream else None)
        guard.tracked[grant] = tracked
        payload = json.dumps(self.prepared.body).encode() if self.prepared.changed else raw
        headers = {h: self.request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in self.request.headers}
        headers["content-type"] = "application/json"
        assert guard.upstream.session is not None
        try:
            async with guard.upstream.session.post(guard.upstream.url(route), data=payload,
                                                   headers=headers) as resp:
                out_headers = {h: resp.headers[h] for h in FORWARDED_RESPONSE_HEADERS if h in resp.headers}
                out_headers.update(self._extra_headers())
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    return await self._stream(resp, out_headers, tracked)
                body = await resp.read()
        except aiohttp.ClientConnectorError:
            guard.on_engine_unreachable()
            self.finished = True  # counted as a refusal below, not as a request outcome
            return guard._refuse(self.queue_class, Rejection(
                Reason.ENGINE_DOWN, 503, "The model engine is not accepting connections. Retry later.",
                guard.config.retry_after_seconds))
        except aiohttp.ClientError as e:
            if self.response is not None:
                log.warning("vLLM dropped a stream: %r", e)
                self.finish("error")
                return self.response
            guard.on_engine_unreachable()
            self.finish("error")
            return error_response(502, "engine_error", f"The model engine failed mid-request: {e}")
        self.finish(_outcome(resp.status))
        return web.Response(body=body, status=resp.status, headers=out_headers)

    async def _stream(self, resp: aiohttp.ClientResponse, headers: dict[str, str],
                      tracked: _Tracked) -> web.StreamResponse:
        m = self.guard.metrics
        name = self.queue_class.name
        clock = self.guard.clock
        # Per chunk only a clock read and a histogram observe: every CPU cycle
        # the guard spends per token is taken from vLLM on a shared host.
        itl = m.itl_seconds.labels(name)
        out = web.StreamResponse(status=resp.status, headers=headers)
        self.response = out
        last: float | None = None
        try:
            await out.prepare(self.request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
                now = clock()
                if last is None:
                    m.ttft_seconds.labels(name).observe(now - self.arrived)
                else:
                    itl.observe(now - last)
                last = now
                if tracked.tokens is not None:
                    # One SSE event per generated token in vLLM's default
                    # streaming, give or take the role and usage events.
                    tracked.tokens += chunk.count(b"data: ")
        except ConnectionResetError:
            self.finish("cancelled")  # the client went away; leaving the context aborts vLLM's request
            return out
        await out.write_eof()
        self.finish(_outcome(resp.status))
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


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    return "invalid" if status < 500 else "error"
