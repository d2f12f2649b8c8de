"""The endpoint picker's gRPC service: Envoy's ``ExternalProcessor.Process``, one bidirectional stream per HTTP
request (grpc.aio, on the router's own event loop and Fleet). ``Exchange`` follows one stream through its
messages (protocol.py says what each one carries): the request's headers, its body buffered (bounded by
--max-body-bytes, counted in the router's --body-budget-bytes) until its end, then the pick (choosing.py) and the
body back; the answer's headers (with the gateway's report of the endpoint that served) and body passed on; the
pick's accounting ended with the answer, or with the stream however it ends (the gateway gone, a reset)."""
from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from gpufleet_api import tracing as names
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_kit.body_budget import BodyBudget, BudgetExhausted, Claim
from gpufleet_kit.tracing import Tracing, bind, unbind

from .. import spans
from ..fleet import Fleet
from ..metrics import Outcome
from ..policy import requests as rq
from ..settings import BODY_BUDGET_RETRY_AFTER_SECONDS
from . import protocol
from .choosing import Chooser, Refusal, Routed

log = logging.getLogger("gpufleet_router.epp")


class Processor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, fleet: Fleet, chooser: Chooser, body_budget: BodyBudget, tracing: Tracing | None = None):
        self.fleet, self.chooser, self.body_budget = fleet, chooser, body_budget
        self.metrics = fleet.metrics
        self.tracing = tracing or Tracing.off()

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self)
        try:
            async for message in request_iterator:
                for out in await exchange.on(message):
                    yield out
                if exchange.answered:
                    return
        finally:
            exchange.end()


class Exchange:
    """One request's stream."""

    def __init__(self, processor: Processor):
        self.p = processor
        self.fleet, self.chooser, self.metrics = processor.fleet, processor.chooser, processor.metrics
        self.claim: Claim = processor.body_budget.claim()
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.subset_error = ""
        self.body = bytearray()
        self.routed: Routed | None = None
        self.status: int | None = None
        self.answered = False    # an immediate response went out: the stream is over
        self.ended = False

    async def on(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = protocol.header_map(message.request_headers)
            self._read_subset(message)
            if message.request_headers.end_of_stream:
                return self._answer(self.chooser.choose_bodyless(self.subset), body=None)
            return []
        if kind == "request_body":
            return await self._body(message.request_body)
        if kind == "request_trailers":
            # The body ended with the trailers rather than with its last chunk.
            out = [] if self.routed is not None else await self._decide(end_of_stream=False)
            return out if self.answered else out + [protocol.request_trailers()]
        if kind == "response_headers":
            self.status = protocol.status_of(protocol.header_map(message.response_headers))
            if self.routed is not None:
                self.chooser.served(self.routed, protocol.served_endpoint(protocol.metadata_of(message)))
            if message.response_headers.end_of_stream:
                self.end()
            return [protocol.response_headers()]
        if kind == "response_body":
            if message.response_body.end_of_stream:
                self.end()
            return [protocol.response_body(message.response_body.body, message.response_body.end_of_stream)]
        if kind == "response_trailers":
            self.end()
            return [protocol.response_trailers()]
        return []

    def _read_subset(self, message: pb.ProcessingRequest) -> None:
        try:
            self.subset = protocol.subset_hint(protocol.metadata_of(message))
        except protocol.BadSubset as e:
            self.subset_error = str(e)

    async def _body(self, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        limit = self.fleet.settings.max_body_bytes
        if len(self.body) + len(chunk.body) > limit:
            return self._answer(Refusal(413, rq.error_body(
                f"The request body is over the router's limit of {limit} bytes; send a shorter prompt.",
                "invalid_request_error", code="request_too_large")), body=None)
        try:
            self.claim.grow(len(chunk.body))
        except BudgetExhausted as e:
            self.metrics.body_budget_refusals.inc()
            return self._answer(Refusal(503, rq.error_body(
                f"The router holds {e.held} bytes of request bodies now and this body's {e.wanted} more would "
                f"pass its budget of {e.limit} bytes (--body-budget-bytes); retry shortly.",
                "service_unavailable", code=Reason.BODY_BUDGET), BODY_BUDGET_RETRY_AFTER_SECONDS,
                Outcome.UNAVAILABLE), body=None)
        self.body += chunk.body
        if chunk.end_of_stream:
            return await self._decide(end_of_stream=True)
        return []

    async def _decide(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        started = self.fleet.clock()
        if self.subset_error:
            return self._answer(Refusal(500, rq.error_body(
                f"The gateway's request to the endpoint picker is malformed: {self.subset_error}. Fix the "
                f"gateway's subset hint (GIE's endpoint-picker protocol).", "server_error",
                code="bad_subset_hint"), None, Outcome.ERROR), body=None)
        if self.p.tracing.on:
            decided = await self._traced_choice()
        else:
            decided = await self.chooser.choose(self.headers.get(":path", ""), self.headers, bytes(self.body),
                                                self.subset)
        out = self._answer(decided, body=bytes(self.body), end_of_stream=end_of_stream)
        self.metrics.epp_pick_seconds.observe(self.fleet.clock() - started)
        return out

    async def _traced_choice(self) -> Routed | Refusal:
        """The choice in its span (docs/tracing.md): the trace context from the gateway's request headers, and
        the span's own into the header mutation, so the guard's (or the router pod's) spans are its children."""
        path = self.headers.get(":path", "").split("?", 1)[0]
        trace = self.p.tracing.begin(names.EPP_PICK_SPAN, self.headers, {names.HTTP_ROUTE: path})
        token = bind(trace)
        try:
            decided = await self.chooser.choose(path, self.headers, bytes(self.body), self.subset)
        except Exception as e:
            trace.keep("error")
            trace.end({names.ERROR_TYPE: type(e).__name__}, error=str(e)[:300])
            raise
        finally:
            unbind(token)
        if isinstance(decided, Refusal):
            spans.finished(trace, decided.status)
            trace.end({names.HTTP_STATUS: decided.status, names.GEN_AI_REQUEST_MODEL: decided.model})
            return decided
        replica = decided.in_flight.pod if decided.in_flight is not None else decided.router_endpoint or ""
        trace.end({names.GEN_AI_REQUEST_MODEL: decided.model, names.PICK_REASON: decided.reason,
                   names.REPLICA: replica, names.PICK_CANDIDATES: list(decided.destinations)})
        trace.inject(decided.set_headers)
        return decided

    def _answer(self, decided: Routed | Refusal, body: bytes | None,
                end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
        self.claim.release()
        if isinstance(decided, Refusal):
            self.answered = True
            self.metrics.epp_answers.labels(str(decided.status)).inc()
            if decided.outcome is not None:
                self.metrics.requests.labels(decided.model, decided.outcome).inc()
            return [protocol.immediate(decided.status, decided.body, decided.retry_after)]
        self.routed = decided
        self.metrics.epp_answers.labels("routed").inc()
        out = [protocol.route(decided.destinations, decided.set_headers, decided.remove_headers,
                              len(body) if body else 0)]
        if body is not None:
            out += protocol.request_body(body, end_of_stream)
        self.body = bytearray()
        return out

    def end(self) -> None:
        """The answer ended, or the stream did: the pick's accounting ends (once)."""
        self.claim.release()
        if self.ended:
            return
        self.ended = True
        if self.routed is not None:
            self.chooser.finished(self.routed, self.status)
