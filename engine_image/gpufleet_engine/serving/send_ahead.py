"""Sending a request on to vLLM before it is parsed, while the replica is far from full.

The body goes to vLLM as the client sent it, and the guard parses and counts it
while it travels instead of before: the guard's way in (parse, count, reserve,
~0.5 ms of Python per request) leaves the path to vLLM's first token. Nothing of
vLLM's answer reaches the client before the parse admits the request as it was
sent (``Exchange.relay`` waits for it). Where it does not — invalid, too long for
the context, a body the guard must change (truncation, a max_tokens to fill in),
more blocks than the bound held and the pool has — vLLM's connection is closed,
which aborts the request there, and the parsed request takes the ordinary way:
refused with the same answer, or admitted anew.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from aiohttp import web

from gpufleet_api import bounded_json
from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_engine.admission import context
from gpufleet_engine.admission.context import InvalidRequest
from gpufleet_engine.admission.grants import Grant
from gpufleet_engine.admission.reservations import Reservation
from gpufleet_engine.serving.exchange import Exchange, Services, abort, forward

# Bodies with more text than this are tokenized on a worker thread so one long
# prompt does not stall every other request's event-loop work; others inline,
# where a thread hop would cost more than the tokenization. Only text counts:
# numbers (token-id prompts, stop_token_ids, logit_bias) are not tokenized, and
# a burst of such bodies sent to threads spends its time starting threads.
INLINE_TOKENIZE_BYTES = 16384
_NOT_TEXT = b"0123456789,.-+[]{}: \n"

# Admit anew a parsed request the copy sent ahead did not fit: (request, route, class, arrived, raw, prepared,
# tenant).
Admit = Callable[[web.Request, str, QueueClass, float, bytes, context.Prepared, str],
                 Awaitable[web.StreamResponse]]


def text_bytes(raw: bytes) -> int:
    """Bytes of ``raw`` that are not numbers or JSON punctuation: about the text to tokenize."""
    if len(raw) <= INLINE_TOKENIZE_BYTES:
        return len(raw)
    return len(raw.translate(None, _NOT_TEXT))


def parse_json(raw: bytes):
    """A client's body, parsed with its nesting bounded (gpufleet_api.bounded_json); InvalidRequest (a 400)."""
    try:
        return bounded_json.loads(raw)
    except bounded_json.TooDeep as e:
        raise InvalidRequest(f"the body is {e}") from None
    except ValueError as e:  # bad JSON or bad UTF-8
        raise InvalidRequest(f"the body is not valid JSON: {e}") from None


class SendAhead:
    def __init__(self, services: Services, admit: Admit):
        self._services = services
        self._admit = admit
        self.sending = 0  # requests sent ahead of their parse, not parsed yet

    def grant_ahead(self, raw: bytes, queue_class: QueueClass, tenant: str = UNKNOWN_TENANT) -> Grant | None:
        """A grant for sending ``raw`` on before it is parsed, where the replica is far from full
        and nobody is in line to be parsed; else None (``Admission.grant_ahead`` has the bound)."""
        admission = self._services.admission
        if self.sending or admission.lane.waiting or text_bytes(raw) > INLINE_TOKENIZE_BYTES:
            return None
        return admission.grant_ahead(queue_class, tenant)

    async def send(self, request: web.Request, route: str, queue_class: QueueClass, arrived: float,
                   raw: bytes, grant: Grant) -> web.StreamResponse:
        """Send ``raw`` on with ``grant``, parse it meanwhile, and keep it or withdraw it."""
        services = self._services
        admission = services.admission
        self.sending += 1
        verdict: asyncio.Future[Exchange] = asyncio.get_running_loop().create_future()
        sent = asyncio.ensure_future(forward(services.upstream, request, raw, grant, verdict))
        try:
            try:
                # aiohttp buffers the headers in the POST's first step and writes them with the
                # body in a task of its own: two loop turns put the request on the wire, on a
                # kept-alive connection (opening a new one takes more; the parse then runs first).
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            finally:
                self.sending -= 1
            prepared = admission.prepare(request.path, parse_json(raw))
            reservation = admission.reserve(route, queue_class, prepared)
            kept = not prepared.changed and admission.settle(grant, reservation)
        except BaseException:
            await self._withdraw(sent, grant, queue_class)
            raise
        if not kept:
            await self._withdraw(sent, grant, queue_class)
            return await self._admit(request, route, queue_class, arrived, raw, prepared, grant.tenant)
        with services.using(prepared.adapter):
            return await self._keep(sent, verdict, request, route, queue_class, arrived, prepared, reservation,
                                    grant)

    async def _keep(self, sent: asyncio.Future, verdict: asyncio.Future[Exchange], request: web.Request,
                    route: str, queue_class: QueueClass, arrived: float, prepared: context.Prepared,
                    reservation: Reservation, grant: Grant) -> web.StreamResponse:
        """The copy sent ahead is the request: relay its answer and account it."""
        services = self._services
        admission = services.admission
        services.metrics.sent_ahead.labels(queue_class.name, "kept").inc()
        exchange = Exchange(services, request, route, queue_class, arrived, prepared, reservation)
        exchange.dispatched(grant)
        verdict.set_result(exchange)
        try:
            async with asyncio.timeout(admission.config.request_timeout_seconds - (admission.clock() - arrived)):
                return await sent  # cancelled with the handler (the client gone) or by the timeout
        except TimeoutError:
            return await exchange.timed_out()
        except asyncio.CancelledError:
            exchange.finish("cancelled")
            raise
        finally:
            services.tracked.pop(grant, None)
            admission.release(grant)

    async def _withdraw(self, sent: asyncio.Future, grant: Grant, queue_class: QueueClass) -> None:
        """Abort the copy sent ahead and give its bound back."""
        await abort(sent)
        self._services.admission.release(grant)
        self._services.metrics.sent_ahead.labels(queue_class.name, "aborted").inc()
