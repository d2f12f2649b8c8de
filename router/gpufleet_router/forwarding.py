"""Forwarding a request to a replica and its answer back, with the router's retries: a 429 or 503 from
the first replica, or a connection that fails before it answers, goes once more to another replica (nothing
has gone to the client yet); refused everywhere below maxReplicas it waits for a scale-out at most as long
as a new replica takes (shedding.py); a request for a service with no replica is held through its cold
start. A disaggregated service's request is prefilled first (prefill.py); a streamed answer that breaks
off mid-stream is resumed (streaming.py)."""
from __future__ import annotations

import asyncio
import logging
import math

import aiohttp
from aiohttp import web

from gpufleet_api.engine_pods import DECODE, UNIFIED
from gpufleet_kit.backoff import delay
from gpufleet_kit.tracing import current

from . import spans
from .exchange import (
    Broken,
    Call,
    Refused,
    Unreachable,
    is_sse,
    read_reply,
    refuse,
    replica_down,
    retry_after_of,
)
from .fleet import Fleet
from .metrics import Outcome
from .policy import adapters, handoff, metering, shedding
from .policy import requests as rq
from .policy.choice import Pick
from .policy.prefixes import Prefix
from .prefill import Prefills
from .settings import (
    ADAPTER_NOT_LOADED_RETRY_AFTER_SECONDS,
    ENGINE_FAILED_STATUS,
    HOP_BY_HOP,
    RETRIED_STATUSES,
    UNREACHABLE_PAUSE_MAX_SECONDS,
    UNREACHABLE_PAUSE_SECONDS,
    UNREACHABLE_RETRY_AFTER_SECONDS,
)
from .streaming import Streams

log = logging.getLogger("gpufleet_router")


class Forwarder:
    """Sends each request to a replica of its service and streams the answer to the client."""

    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession):
        self.fleet, self.http = fleet, http
        self.metrics, self.settings = fleet.metrics, fleet.settings
        self.streams = Streams(fleet, http)
        self.prefills = Prefills(fleet, http)

    async def forward(self, call: Call) -> web.StreamResponse:
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
            if pool == DECODE and call.route != rq.EMBEDDINGS:
                done = await self.prefills.prefill(call)
                answer = await self._send(call, DECODE, handoff.decode_body(call.body, done), None)
            else:
                # Embeddings have nothing to decode: a disaggregated service's decode replicas answer them.
                answer = await self._send(call, pool, call.body, call.prefix if pool == UNIFIED else None)
            if answer is not None:
                return answer
            # The pool lost its last replica before one was picked: held like a cold start.

    def _adapter_held(self, model: str, pool: str, adapter: str) -> bool:
        """A ready replica of the pool that answers (decode, or unified) holds the adapter loaded."""
        picker = self.fleet.picker(model, pool)
        return picker is not None and bool(picker.holders(adapter))

    def _adapter_not_loaded(self, call: Call) -> web.Response:
        adapter = call.adapter or ""
        self.metrics.adapter_not_loaded.labels(adapter).inc()
        return refuse(self.metrics, call.model, Outcome.UNAVAILABLE, 503, rq.error_body(
            adapters.not_loaded_message(adapter, call.target), "adapter_not_loaded", code="adapter_not_loaded"),
            ADAPTER_NOT_LOADED_RETRY_AFTER_SECONDS)

    async def _hold(self, call: Call, deadline: float) -> web.Response | None:
        """No pool can answer (no replica yet, all starting, or scaled to zero): hold the request until
        one can (None), or answer why not."""
        refusal = await self.fleet.wait_for_pool(call.model, call.target, call.arrived, deadline)
        if refusal is None:
            return None
        return refuse(self.metrics, call.model, Outcome.UNAVAILABLE, 503, refusal.body, refusal.retry_after)

    async def _send(self, call: Call, role: str, body: bytes, prefix: Prefix | None) -> web.StreamResponse | None:
        """Send ``body`` to a replica of the ``role`` pool and stream its answer to the client, with the
        retries the module describes; None when the pool has no replica to try."""
        model, target = call.model, call.target
        cost = call.parsed.cost_blocks(target.block_size, call.route)
        tried: list[str] = []
        refusals: list[Refused] = []
        failure = ""
        # Refused everywhere below maxReplicas: held at most as long as a new replica takes (shedding.py).
        scale_out_deadline = call.arrived + min(self.settings.hold_timeout, self.fleet.cold(model).expected())
        attempt = 0
        revision: str | None = None   # the first replica's: a retry stays with it when it can
        retry = ""                    # why the next send is a retry (its span says)
        broken: Broken | None = None
        unreachable_rounds = 0
        # How long a request nothing answered is sent again: the router's own stalls do not count.
        window = self.fleet.lag.window(call.arrived, self.settings.unreachable_retry_timeout)
        while True:
            if attempt >= 2:
                if not refusals:
                    # Nothing answered: not a capacity question. Nothing was admitted either, so the
                    # request goes out again after a pause while its arrival is recent enough.
                    pause = delay(unreachable_rounds + 1, UNREACHABLE_PAUSE_SECONDS, UNREACHABLE_PAUSE_MAX_SECONDS)
                    if not failure or not window.allows(self.fleet.clock() + pause):
                        break
                    await asyncio.sleep(pause)
                    unreachable_rounds += 1
                    attempt, tried = 0, []
                    self.metrics.retries.labels(model, role, "connect_failed").inc()
                    retry = "connect_failed"
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
                retry = "scale_out"
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
            if attempt > 1:
                retry = "rejected" if refusals else "connect_failed"
                self.metrics.retries.labels(model, role, retry).inc()
            trace = current()
            span = spans.sending(trace, call.headers, role, pick, picker, tried, call.adapter, attempt, retry)
            tried.append(pod)
            ticket = picker.sent(pod, cost, self.fleet.clock(), prefix)
            status = 0
            try:
                response = await self._exchange(call, role, body, pick)
                status = response.status
                return response
            except Refused as r:
                refusals.append(r)
                spans.refused(trace, span, r.status, r.body)
                status = -1
            except Unreachable as u:
                failure = u.message
                spans.failed(trace, span, f"unreachable: {u.message}")
                status = -1
            except Broken as b:
                broken = b
                spans.failed(trace, span, f"broken: {b.pod} broke off mid-answer")
                status = -1
                break
            finally:
                picker.finished(pod, ticket)
                if status >= 0:   # not ended above: answered, or (0) broke off mid-answer or cancelled
                    spans.answered(trace, span, status)
        if broken is not None:
            return await self.streams.resume_after_break(call, role, broken, cost)
        if refusals:
            # Every replica tried refused: the earliest any of them expects room is the hint.
            hints = [r.retry_after for r in refusals if r.retry_after is not None]
            last = refusals[-1]
            self.metrics.requests.labels(model, Outcome.REJECTED).inc()
            call.meter.guard_refusal = metering.refusal_reason(last.body)
            out = web.Response(status=last.status, body=last.body, content_type=last.content_type)
            if hints:
                out.headers["Retry-After"] = str(max(1, math.ceil(min(hints))))
            return out
        pool = "" if role == UNIFIED else f"{role} "
        return refuse(self.metrics, model, Outcome.ERROR, 502, rq.error_body(
            f"No {pool}replica of {target.namespace}/{target.service} answered: {failure}", "server_error",
            code="replica_unreachable"), UNREACHABLE_RETRY_AFTER_SECONDS)

    async def _exchange(self, call: Call, role: str, body: bytes, pick: Pick) -> web.StreamResponse:
        """Send to one replica. Raises Refused (it answered 429 or 503: not admitted) or
        Unreachable (nothing answered) before anything is written to the client."""
        model = call.model
        self.metrics.picks.labels(model, role, pick.reason).inc()
        if pick.affinity_hit:
            self.metrics.prefix_affinity_hits.labels(model).inc()
        url = f"http://{pick.replica.address}{call.route}"
        try:
            upstream = await self.http.post(url, data=body, headers=call.headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise Unreachable(f"{pick.replica.pod} ({pick.replica.address}): {type(e).__name__}: {e}") from None
        done = False  # the answer was read to its end: the connection goes back to the pool
        try:
            if upstream.status in RETRIED_STATUSES:
                refusal = await read_reply(upstream, pick)
                done = True
                if replica_down(upstream.status, refusal):
                    raise Unreachable(f"{pick.replica.pod} ({pick.replica.address}) is not serving: "
                                       f"{refusal[:300]!r}", connected=True)
                raise Refused(upstream.status, refusal, upstream.content_type, retry_after_of(upstream))
            if upstream.status == ENGINE_FAILED_STATUS:
                # The guard's engine failed mid-request before answering (killed, crashed): nothing went
                # to the client, so another replica may take the request.
                answer = await read_reply(upstream, pick)
                done = True
                raise Unreachable(f"{pick.replica.pod} ({pick.replica.address}) answered "
                                   f"{upstream.status}: {answer[:300]!r}", connected=True)
            relay = call.relay if upstream.status == 200 and is_sse(upstream) else None
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_BY_HOP and not (relay is not None and k.lower() == "content-length"):
                    response.headers.add(k, v)
            if upstream.headers.get("Content-Length") is not None and relay is None:
                response.content_length = int(upstream.headers["Content-Length"])
            await response.prepare(call.request)
            if relay is not None:
                relay.response = relay.response or response
                if not await self.streams.pump(call, relay, upstream):
                    relay.stream.broke()
                    raise Broken(pick.replica.pod, pick.replica.revision)
            else:
                # A JSON answer's usage is read as it passes (bounded): what its tenant is charged.
                tap = metering.BodyTap() if upstream.content_type == "application/json" and \
                    upstream.headers.get("Content-Encoding", "identity") == "identity" else None
                first = is_sse(upstream)   # a stream not relayed event by event: its first bytes are its TTFT
                async for chunk in upstream.content.iter_any():
                    if first:
                        first = False
                        ttft = self.fleet.clock() - call.arrived
                        spans.first_token(current(), call.target, ttft)
                        self.metrics.ttft_seconds.labels(model).observe(ttft, current().exemplar())
                    if tap is not None:
                        tap.feed(chunk)
                    await response.write(chunk)
                if tap is not None:
                    call.meter.counted = tap.counted()
            done = True
            await response.write_eof()
            outcome = Outcome.OK if upstream.status < 400 else (
                Outcome.REJECTED if upstream.status in (429, 503) else
                Outcome.INVALID if upstream.status < 500 else Outcome.ERROR)
            if relay is not None and relay.stream.overflowed:
                outcome = Outcome.ERROR   # the replica's stream was cut off (resume.MAX_EVENT_BYTES)
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
