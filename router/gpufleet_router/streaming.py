"""Streams that survive their replica (resume.py is the pure part): a streamed completion is relayed
event by event, and when its replica breaks off mid-answer it continues on another replica of the same
revision, at most --max-resumptions times; the client's stream ends well-formed either way."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

import aiohttp
from aiohttp import web

from gpufleet_api import tracing as names
from gpufleet_kit.backoff import delay
from gpufleet_kit.tracing import current

from . import spans
from .exchange import (
    Broken,
    Call,
    Refused,
    Relay,
    Unreachable,
    is_sse,
    read_reply,
    replica_down,
    retry_after_of,
)
from .fleet import Fleet
from .loop_lag import Window
from .metrics import Outcome, Resumption
from .policy import resume
from .policy.choice import Pick, Picker
from .settings import (
    MIN_RESUME_WAIT_SECONDS,
    RETRIED_STATUSES,
    UNREACHABLE_PAUSE_MAX_SECONDS,
    UNREACHABLE_PAUSE_SECONDS,
)

log = logging.getLogger("gpufleet_router")


class Streams:
    """Relays streamed answers to clients and resumes the ones whose replica broke off."""

    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession):
        self.fleet, self.http = fleet, http
        self.metrics, self.settings = fleet.metrics, fleet.settings

    async def pump(self, call: Call, relay: Relay, upstream: aiohttp.ClientResponse,
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
            if events and not relay.first_sent:
                relay.first_sent = True
                ttft = self.fleet.clock() - call.arrived
                spans.first_token(current(), call.target, ttft)
                self.metrics.ttft_seconds.labels(call.model).observe(ttft, current().exemplar())
            for event in events:
                if relay.broke_at is not None:
                    gap = self.fleet.clock() - relay.broke_at
                    self.metrics.resume_gap_seconds.labels(call.target.service).observe(gap)
                    relay.broke_at = None
                    trace = current()
                    if trace.on:
                        trace.set(names.RESUME_GAP_SECONDS, gap)
                await response.write(event)
            if stream.overflowed:
                log.warning("%s: a replica sent a stream event over %d bytes; the stream ended in an error event",
                            call.model, resume.MAX_EVENT_BYTES)
                upstream.close()   # not read on: what it sends next is not held anywhere
                break
        return stream.done

    async def resume_after_break(self, call: Call, role: str, broken: Broken, cost: int) -> web.StreamResponse:
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
        unreachable_rounds = 0  # rounds that ended with a replica whose connection failed (nothing was sent)
        connect_failed = False
        deadline = self.fleet.lag.window(self.fleet.clock(), self.settings.resume_timeout)
        failure = f"the replica {broken.pod} broke off mid-answer"
        trace = current()
        if trace.on:
            trace.keep("resumed")
            trace.set(names.BROKEN_REPLICA, broken.pod)
        continuations = 0
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
            wait = None if pick is not None else self._resume_wait(
                picker, broken.revision, broke, refusals, deadline,
                unreachable_rounds + 1 if connect_failed else None)
            if wait is not None:
                if connect_failed:
                    self.metrics.retries.labels(model, role, "connect_failed").inc()
                await asyncio.sleep(wait)
                unreachable_rounds += connect_failed
                tried, refusals, connect_failed = list(broke), [], False
                continue
            if picker is None or pick is None:
                return await self._end_in_error(model, service, response, Resumption.FAILED, (
                    f"The answer's replica broke off mid-stream ({failure}) and no other ready replica of its "
                    f"revision{' holding the adapter' if call.adapter else ''} could continue it. Send it again."),
                    resume.Code.BROKEN)
            pod = pick.replica.pod
            continuations += 1
            span = spans.resuming(trace, call.headers, role, pick, picker, tried, call.adapter, continuations,
                                  broken.pod)
            tried.append(pod)
            self.metrics.picks.labels(model, role, pick.reason).inc()
            ticket = picker.sent(pod, cost, self.fleet.clock(), None)
            ended = False
            try:
                if await self._continue(call, relay, pick,
                                        lambda: self._ended_now(model, service, Resumption.RESUMED)):
                    spans.answered(trace, span, 200)
                    ended = True
                    await response.write_eof()
                    return response
                failure = f"then {pod} broke off too"
                spans.failed(trace, span, f"broken: {failure}")
                ended = True
                broke.append(pod)
                tried = list(broke)
            except Refused as r:
                failure = f"{pod} refused the continuation ({r.status})"
                spans.refused(trace, span, r.status, r.body)
                ended = True
                refusals.append(r.retry_after)
            except Unreachable as u:
                failure = u.message
                spans.failed(trace, span, f"unreachable: {u.message}")
                ended = True
                if u.connected:
                    broke.append(pod)   # it answered the continuation with a failure: not again
                else:
                    connect_failed = True   # nothing was sent: the replica may take it after a pause
            finally:
                picker.finished(pod, ticket)
                if not ended:
                    spans.answered(trace, span, 0)

    def _resume_wait(self, picker: Picker | None, revision: str, broke: list[str], refusals: list[float | None],
                     deadline: Window, unreachable_round: int | None = None) -> float | None:
        """How long a continuation that found no replica waits before it looks again (None: it does not,
        the stream ends): for the earliest room the replicas that refused it expect (429/503: the load of
        the one that died came to them); for a replica whose connection failed this round (``unreachable_round``:
        the how-manieth such round, the pause grows as the forwarding path's does), since nothing reached it;
        else for a replica of its revision on its way back (its engine restarting after the same failure, or its
        pod Ready before this router's next reading says so); within --resume-timeout-seconds."""
        waits = []
        if unreachable_round is not None:
            waits.append(delay(unreachable_round, UNREACHABLE_PAUSE_SECONDS, UNREACHABLE_PAUSE_MAX_SECONDS))
        if refusals:
            hints = [h for h in refusals if h is not None]
            waits.append(max(MIN_RESUME_WAIT_SECONDS, min(hints) if hints else self.settings.reading_interval))
        if picker is not None and picker.recovering(revision, exclude=broke):
            waits.append(max(MIN_RESUME_WAIT_SECONDS, self.settings.reading_interval / 4))
        return next((w for w in waits if deadline.allows(self.fleet.clock() + w)), None)

    async def _continue(self, call: Call, relay: Relay, pick: Pick, before_end: Callable[[], None]) -> bool:
        """The continuation to one replica: True when its answer ended the stream (``before_end`` ran
        just before its end went out)."""
        stream = relay.stream
        body = json.dumps(stream.continuation()).encode()
        url = f"http://{pick.replica.address}{call.route}"
        headers = {k: v for k, v in call.headers.items() if k.lower() != "content-length"}
        try:
            upstream = await self.http.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise Unreachable(f"{pick.replica.pod} ({pick.replica.address}): {type(e).__name__}: {e}") from None
        done = False
        try:
            if upstream.status != 200 or not is_sse(upstream):
                answer = await read_reply(upstream, pick)
                done = True
                if upstream.status in RETRIED_STATUSES and not replica_down(upstream.status, answer):
                    raise Refused(upstream.status, answer, upstream.content_type, retry_after_of(upstream))
                raise Unreachable(f"{pick.replica.pod} answered the continuation {upstream.status}: "
                                   f"{answer[:300]!r}", connected=True)
            ended = await self.pump(call, relay, upstream, before_end)
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
        trace = current()
        if trace.on:
            trace.set(names.RESUMPTION, outcome)
        self.metrics.resumed_streams.labels(service, outcome).inc()
        self.metrics.requests.labels(model, Outcome.OK if outcome == Resumption.RESUMED else Outcome.ERROR).inc()
