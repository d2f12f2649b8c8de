"""The prefill step of a disaggregated request (handoff.py is the pure part): a prefill replica, chosen
by prefix affinity and load, computes the prompt's KV and answers with one token and the hand-off; one that
does not answer in time, or at all, is skipped and decode computes the prompt itself."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import aiohttp

from gpufleet_api import tracing as names
from gpufleet_api.engine_pods import PREFILL
from gpufleet_kit.http_limits import HANDOFF_REPLY_CAP, ReplyTooLarge, read_capped
from gpufleet_kit.tracing import current

from . import spans
from .errors import RouterError
from .exchange import Call, Refused, Unreachable, retry_after_of
from .fleet import Fleet
from .metrics import Fallback, Outcome, TransferParams
from .policy import handoff
from .policy.choice import Pick
from .settings import RETRIED_STATUSES

log = logging.getLogger("gpufleet_router")


class PrefillSkipped(RouterError):
    """The prefill was not done (``reason``: a metrics.Fallback); decode computes the prompt."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


class Prefills:
    """Runs the prefill step of disaggregated requests."""

    def __init__(self, fleet: Fleet, http: aiohttp.ClientSession):
        self.fleet, self.http = fleet, http
        self.metrics, self.settings = fleet.metrics, fleet.settings

    async def prefill(self, call: Call) -> handoff.Handoff | None:
        """Prefill the prompt on a prefill replica: the hand-off for decode, or None when the prefill
        was skipped (counted as a fallback; decode computes the prompt)."""
        model = call.model
        started = self.fleet.clock()
        trace = current()
        step = trace.step(names.ROUTER_PREFILL_SPAN)
        try:
            params = await asyncio.wait_for(self._prefill_attempts(call), self.settings.prefill_timeout)
        except PrefillSkipped as skipped:
            self._fell_back(step, skipped.reason, skipped.detail)
            self.metrics.prefill_fallbacks.labels(model, skipped.reason).inc()
            # A replica failing is worth a line; capacity (refused, none ready) shows in the metric.
            level = logging.WARNING if skipped.reason in (Fallback.ERROR, Fallback.UNREACHABLE) else logging.DEBUG
            log.log(level, "%s: prefill skipped (%s), decode computes the prompt: %s", model, skipped.reason,
                    skipped.detail)
            return None
        except asyncio.TimeoutError:
            self._fell_back(step, Fallback.TIMEOUT, f"no prefill answer within {self.settings.prefill_timeout:g}s")
            self.metrics.prefill_fallbacks.labels(model, Fallback.TIMEOUT).inc()
            log.debug("%s: no prefill answer within %gs, decode computes the prompt", model,
                      self.settings.prefill_timeout)
            return None
        except asyncio.CancelledError:
            self.metrics.requests.labels(model, Outcome.CANCELLED).inc()
            raise
        self.metrics.prefill_seconds.labels(model).observe(self.fleet.clock() - started)
        transfer = TransferParams.NONE if params is None else TransferParams.RETURNED
        self.metrics.handoffs.labels(model, transfer).inc()
        if trace.on:
            trace.end_step(step, {names.TRANSFER_PARAMS: transfer})
        return handoff.Handoff(params)

    @staticmethod
    def _fell_back(step: Any, reason: str, detail: str) -> None:
        """The hand-off skipped: the prefill span says why, and the tail rule keeps the request."""
        trace = current()
        if trace.on:
            trace.end_step(step, {names.FALLBACK_REASON: reason}, error=f"fell back: {detail[:300]}")
            trace.keep("fallback")

    async def _prefill_attempts(self, call: Call) -> dict | None:
        """Up to two prefill replicas, the second after a refusal or a failed connection."""
        model, target = call.model, call.target
        picker = self.fleet.picker(model, PREFILL)
        cost = dataclasses.replace(call.parsed, max_tokens=1).cost_blocks(target.block_size, call.route)
        body = handoff.prefill_body(call.body, call.route)
        # The answer is read here, not passed on: uncompressed, whatever the client accepts.
        headers = {k: v for k, v in call.headers.items() if k.lower() != "accept-encoding"}
        headers["Accept-Encoding"] = "identity"
        reason, detail = Fallback.NO_REPLICA, "no prefill replica is ready"
        if picker is None:
            raise PrefillSkipped(reason, detail)
        tried: list[str] = []
        for attempt in range(2):
            pick = picker.pick(cost, call.prefix, exclude=tried, adapter=call.adapter)
            if pick is None:
                break
            pod = pick.replica.pod
            retry = ""
            if attempt:
                retry = "rejected" if reason == Fallback.REFUSED else "connect_failed"
                self.metrics.retries.labels(model, PREFILL, retry).inc()
            trace = current()
            span = spans.sending(trace, headers, PREFILL, pick, picker, tried, call.adapter, attempt + 1, retry)
            tried.append(pod)
            ticket = picker.sent(pod, cost, self.fleet.clock(), call.prefix)
            ended = False
            try:
                params = await self._prefill_exchange(call, body, headers, pick)
                spans.answered(trace, span, 200)
                ended = True
                return params
            except Refused as r:
                reason, detail = Fallback.REFUSED, f"{pod} answered {r.status}"
                spans.refused(trace, span, r.status, r.body)
                ended = True
            except Unreachable as u:
                reason, detail = Fallback.UNREACHABLE, u.message
                spans.failed(trace, span, f"unreachable: {u.message}")
                ended = True
            finally:
                picker.finished(pod, ticket)
                if not ended:   # skipped (an error answer), or the prefill's time ran out
                    spans.failed(trace, span, "prefill failed")
        raise PrefillSkipped(reason, detail)

    async def _prefill_exchange(self, call: Call, body: bytes, headers: dict, pick: Pick) -> dict | None:
        """One prefill request, its whole answer read. Raises Refused, Unreachable or PrefillSkipped."""
        model, pod = call.model, pick.replica.pod
        self.metrics.picks.labels(model, PREFILL, pick.reason).inc()
        if pick.affinity_hit:
            self.metrics.prefix_affinity_hits.labels(model).inc()
        try:
            async with self.http.post(f"http://{pick.replica.address}{call.route}", data=body,
                                      headers=headers) as upstream:
                answer = await read_capped(upstream, HANDOFF_REPLY_CAP, f"{pod} ({pick.replica.address})")
        except ReplyTooLarge as e:
            raise PrefillSkipped(Fallback.ERROR, str(e)) from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Unreachable(f"{pod} ({pick.replica.address}): {type(e).__name__}: {e}") from None
        if upstream.status in RETRIED_STATUSES:
            raise Refused(upstream.status, answer, upstream.content_type, retry_after_of(upstream))
        if upstream.status >= 300:
            raise PrefillSkipped(Fallback.ERROR, f"{pod} answered {upstream.status}: {answer[:300]!r}")
        try:
            return handoff.returned_params(answer)
        except handoff.UnreadableAnswer as e:
            raise PrefillSkipped(Fallback.ERROR, f"{pod} answered {upstream.status} with {e}") from None
