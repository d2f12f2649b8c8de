"""One admitted request on its way to vLLM and back: forwarded, relayed (streamed or whole),
timed for the SLIs and the TTFT control, its reservation grown while it streams, and what its
answer taught handed to the admission core at its end.

An ``Exchange`` knows the guard's parts it needs through ``Services`` (the admission core,
the metrics, the refusals, the upstream), never the ``Guard`` that made it.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import aiohttp
from aiohttp import web

from gpufleet_api import tracing as names
from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_engine.admission import context, kv_handoff, sli
from gpufleet_engine.admission.core import Admission
from gpufleet_engine.admission.grants import Grant, Rejection
from gpufleet_engine.admission.reservations import Reservation
from gpufleet_engine.serving import spans
from gpufleet_engine.serving.errors import Refusals, error_response
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_engine.serving.upstream import FORWARDED_REQUEST_HEADERS, FORWARDED_RESPONSE_HEADERS, Upstream
from gpufleet_kit.tracing import RequestTrace, current

log = logging.getLogger("gpufleet_engine.serving.guard")

TRUNCATED_HEADER = "x-gpufleet-truncated-tokens"
# A long stream's inter-chunk gaps reach the ITL histogram every this many gaps, not only at its end.
_FLUSH_GAPS = 256
# A stream's answer tokens are charged to its tenant's fair share every this many events, and the rest
# at its end: often enough that a long answer counts while it runs, seldom enough to cost nothing per token.
CHARGE_EVERY_EVENTS = 16
# usage.completion_tokens (OpenAI routes) or usage.output_tokens (/v1/responses, /v1/messages).
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')


@dataclass
class Tracked:
    """An in-flight request as the audit sees it, and whether its first token has gone out."""
    tokens: int | None
    answering: bool = False


@dataclass
class Services:
    """What an exchange may use of the guard: the admission core, the metrics, the refusals,
    the upstream, the in-flight table for the audit, and a poke for the engine monitor."""
    admission: Admission
    metrics: GuardMetrics
    refusals: Refusals
    upstream: Upstream
    tracked: dict[Grant, Tracked]
    engine_unreachable: Callable[[], None]
    # Requests in the guard per LoRA adapter, from its parse to its end: an adapter leaves vLLM
    # only when none is left (serving/adapters.py).
    adapters_in_use: Counter[str] = field(default_factory=Counter)

    @contextlib.contextmanager
    def using(self, adapter: str | None) -> Iterator[None]:
        """A request for ``adapter`` (None: the base model) is in the guard while inside."""
        if adapter is None:
            yield
            return
        self.adapters_in_use[adapter] += 1
        try:
            yield
        finally:
            self.adapters_in_use[adapter] -= 1
            if not self.adapters_in_use[adapter]:
                del self.adapters_in_use[adapter]

    def charge_answer(self, grant: Grant, tokens: int) -> None:
        self.admission.charge_answer(grant, tokens)

    def grow(self, grant: Grant, reservation: Reservation) -> None:
        if self.admission.grow(grant, reservation):
            self.metrics.reservation_extensions.labels(reservation.key[1]).inc()

    def learn(self, reservation: Reservation, completion_tokens: int | None) -> None:
        adapter = reservation.prepared.adapter
        if adapter is not None and completion_tokens:
            self.metrics.adapter_tokens.labels(adapter, "generation").inc(completion_tokens)
        learned = self.admission.learn(reservation, completion_tokens)
        if learned is None:
            return
        route, name = reservation.key
        m = self.metrics
        m.output_tokens.labels(route, name).observe(learned.per_sequence)
        m.output_prediction_ratio.labels(route, name).observe(learned.ratio)
        if learned.predicted is not None:
            m.output_tokens_predicted.labels(route, name).set(learned.predicted)


class Exchange:
    """One admitted request on its way to vLLM and back."""

    def __init__(self, services: Services, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                 prepared: context.Prepared, reservation: Reservation):
        self.services = services
        self.request = request
        self.route = route
        self.queue_class = queue_class
        self.arrived = arrived
        self.prepared = prepared
        self.reservation = reservation
        self.response: web.StreamResponse | None = None
        self.tracked = Tracked(None)
        self.finished = False
        self.ttft_seconds: float | None = None
        self.gaps = self.late_gaps = 0
        self.trace: RequestTrace = current()

    def finish(self, outcome: str) -> None:
        if self.finished:
            return
        self.finished = True
        m = self.services.metrics
        seconds = self.services.admission.clock() - self.arrived
        m.requests.labels(self.queue_class.name, outcome).inc()
        if self.prepared.adapter is not None:
            m.adapter_requests.labels(self.prepared.adapter, outcome).inc()
        phase = self.prepared.phase
        if phase != kv_handoff.WHOLE:
            m.kv_handoffs.labels(phase, outcome).inc()
        # A prefill's answer is its first token: judged against the TTFT objective, streamed or not.
        first_token_only = phase == kv_handoff.PREFILL
        judgement = sli.judge(self.services.admission.config.slo, sli.Request(
            self.prepared.stream or first_token_only, outcome, seconds, self.ttft_seconds, self.gaps,
            self.late_gaps))
        trace = self.trace
        if trace.on:
            spans.finished(trace, outcome, judgement)
        if outcome == "ok":
            m.request_seconds.labels(self.queue_class.name).observe(seconds, trace.exemplar())
        m.count_sli(self.queue_class.name, judgement)

    def first_token(self, grant: Grant, now: float) -> None:
        """The first token reached the client: its TTFT observed, and a sample for the TTFT control
        with the prompt tokens vLLM computed (a decode's hand-off loads most of its prompt)."""
        self.ttft_seconds = now - self.arrived
        self.tracked.answering = True
        trace = self.trace
        if trace.on:
            spans.first_token(trace, self.ttft_seconds, self.services.admission.config.slo.ttft_p99_seconds)
        self.services.metrics.ttft_seconds.labels(self.queue_class.name).observe(self.ttft_seconds,
                                                                                 trace.exemplar())
        if self.prepared.adapter is not None:
            self.services.metrics.adapter_ttft_seconds.labels(self.prepared.adapter).observe(self.ttft_seconds)
        admission = self.services.admission
        admission.scheduler.first_token(grant, now, self.reservation.computed_prompt_tokens(admission.block_size))

    def _extra_headers(self) -> dict[str, str]:
        if self.prepared.truncated_tokens:
            return {TRUNCATED_HEADER: str(self.prepared.truncated_tokens)}
        return {}

    def dispatched(self, grant: Grant) -> None:
        """Admitted and on its way to vLLM: its queue time counted, and in flight for the audit
        from now (a request that does not stream gets vLLM's headers only with its whole answer)."""
        services = self.services
        services.metrics.queue_seconds.labels(self.queue_class.name).observe(grant.queued_seconds)
        if self.prepared.adapter is not None:
            services.metrics.adapter_tokens.labels(self.prepared.adapter, "prompt").inc(
                self.prepared.total_prompt_tokens)
        if self.trace.on:
            spans.dispatched(self.trace, self.queue_class.name, grant, self.prepared)
        single = len(self.prepared.prompt_tokens) == 1 and self.prepared.sequences_per_prompt == 1
        self.tracked = Tracked(self.prepared.prompt_tokens[0] if single and self.prepared.stream else None)
        services.tracked[grant] = self.tracked

    async def forward(self, raw: bytes, grant: Grant) -> web.StreamResponse:
        self.dispatched(grant)
        payload = json.dumps(self.prepared.body).encode() if self.prepared.changed else raw
        return await forward(self.services.upstream, self.request, payload, grant, self)

    async def relay(self, resp: aiohttp.ClientResponse, grant: Grant) -> web.StreamResponse:
        """vLLM's answer to the client, and the request accounted."""
        out_headers = {h: resp.headers[h] for h in FORWARDED_RESPONSE_HEADERS if h in resp.headers}
        out_headers.update(self._extra_headers())
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._stream(resp, out_headers, grant)
        body = await resp.read()
        if resp.status == 200 and self.prepared.phase == kv_handoff.PREFILL:
            self.first_token(grant, self.services.admission.clock())
        self.finish(_outcome(resp.status))
        if resp.status == 200:
            counted = _completion_tokens(body)
            if counted is not None:
                self.trace.set(names.GEN_AI_OUTPUT_TOKENS, counted)
            self.services.charge_answer(grant, counted or 0)  # the guard learns a whole answer's length here
            self.services.learn(self.reservation, counted)
        return web.Response(body=body, status=resp.status, headers=out_headers)

    def unreachable(self) -> web.Response:
        services = self.services
        services.engine_unreachable()
        self.finished = True  # counted as a refusal below, not as a request outcome
        return services.refusals.refuse(self.queue_class, Rejection(
            Reason.ENGINE_DOWN, 503, "The model engine is not accepting connections. Retry later.",
            services.admission.config.retry_after_seconds), stream=self.prepared.stream,
            adapter=self.prepared.adapter)

    def failed(self, e: aiohttp.ClientError) -> web.StreamResponse:
        if self.response is not None:
            log.warning("vLLM dropped a stream: %r", e)
            self.finish("error")
            return self.response
        log.warning("vLLM failed a request before answering: %r", e)
        self.services.engine_unreachable()
        self.finish("error")
        return error_response(502, "engine_error", f"The model engine failed mid-request: {e}")

    async def _stream(self, resp: aiohttp.ClientResponse, headers: dict[str, str],
                      grant: Grant) -> web.StreamResponse:
        tracked, route = self.tracked, self.route  # locals: read per chunk
        m = self.services.metrics
        name = self.queue_class.name
        clock = self.services.admission.clock
        # Per chunk only a clock read, a bisection and a few local sums: every CPU cycle the
        # guard spends per token is taken from vLLM on a shared host. The gaps are counted into
        # the ITL histogram's buckets here and added to it every FLUSH_GAPS and at the end.
        itl = m.itl_seconds.labels(name)
        bounds = m.itl_seconds.bounds
        counts = [0] * (len(bounds) + 1)
        gap_sum = 0.0
        itl_objective = self.services.admission.config.slo.itl_p99_seconds
        bisect_left = bisect.bisect_left
        late = gaps = 0
        worst = 0.0  # the stream's longest gap: its exemplar in the ITL histogram
        flush_at = _FLUSH_GAPS
        out = web.StreamResponse(status=resp.status, headers=headers)
        self.response = out
        reservation = self.reservation
        charge_answer = self.services.charge_answer
        charged = 0  # events charged to the tenant so far
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
                        self.first_token(grant, now)
                    else:
                        gap = now - last
                        counts[bisect_left(bounds, gap)] += 1
                        gap_sum += gap
                        gaps += 1
                        if gap > itl_objective:
                            late += 1
                        if gap > worst:
                            worst = gap
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
                        self.services.grow(grant, reservation)
                    if reservation.events - charged >= CHARGE_EVERY_EVENTS:
                        charge_answer(grant, reservation.events - charged)
                        charged = reservation.events
            finally:
                # However the stream ends (done, the client gone, the timeout): its gaps and tokens count.
                itl.add(counts, gap_sum)
                self.gaps, self.late_gaps = gaps, late
                if gaps and self.trace.on:
                    if spans.slow_stream(gaps, late):
                        self.trace.keep("slo")
                    exemplar = self.trace.exemplar()
                    if exemplar is not None:
                        itl.exemplar(m.itl_seconds.bucket_of(worst), worst, exemplar)
                charge_answer(grant, reservation.events - charged)
                charged = reservation.events
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
            else:
                charge_answer(grant, counted - charged)  # usage counts more tokens than events arrived
            self.trace.set(names.GEN_AI_OUTPUT_TOKENS, counted)
            self.services.learn(reservation, counted)
        return out

    async def timed_out(self) -> web.StreamResponse:
        seconds = self.services.admission.config.request_timeout_seconds
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


async def forward(upstream: Upstream, request: web.Request, payload: bytes, grant: Grant,
                  exchange: Exchange | asyncio.Future[Exchange]) -> web.StreamResponse:
    """POST ``payload`` to vLLM and relay its answer. ``exchange``: a future when the request is
    sent ahead of its parse (send_ahead.py): nothing is relayed or accounted before it
    is set; the task is cancelled instead when the parse does not admit the request as sent."""
    headers = {h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers}
    headers["content-type"] = "application/json"
    assert upstream.session is not None
    trace = current()
    # The exchange with vLLM: a client span whose context goes to vLLM, whose own spans join it.
    step = trace.step(names.GUARD_ENGINE_SPAN, client=True)
    trace.inject(headers)
    error = ""
    try:
        async with _post_once_more_if_closed(upstream.session, upstream.url(request.path), payload,
                                             headers) as resp:
            if resp.status >= 500:
                error = f"vLLM answered {resp.status}"
            return await (await _admitted(exchange)).relay(resp, grant)
    except aiohttp.ClientConnectorError:
        error = "vLLM unreachable"
        return (await _admitted(exchange)).unreachable()
    except aiohttp.ClientError as e:
        error = type(e).__name__
        return (await _admitted(exchange)).failed(e)
    finally:
        trace.end_step(step, error=error)


async def _admitted(exchange: Exchange | asyncio.Future[Exchange]) -> Exchange:
    """The exchange, once the parse of a request sent ahead has admitted it."""
    return exchange if isinstance(exchange, Exchange) else await exchange


async def abort(sent: asyncio.Future) -> None:
    """Cancel a request sent ahead (send_ahead.py) and wait until it is gone: leaving
    aiohttp's request early closes vLLM's connection, which aborts the request there."""
    sent.cancel()
    await asyncio.wait([sent])
    if not sent.cancelled():
        sent.exception()  # retrieved: it ended before the cancel took, and it is moot


@contextlib.asynccontextmanager
async def _post_once_more_if_closed(session: aiohttp.ClientSession, url: str, payload: bytes,
                                    headers: dict[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
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
