"""What the router writes on a request's trace at each step (docs/tracing.md), and its tail rule: which
requests are kept whatever head sampling decided. The request's trace is the task's (``tracing.current``):
server.py (and the endpoint picker) begin and bind it, the steps below write to it where they happen.

Each send to a replica is a client span (``router.replica``) whose W3C context goes to the guard in the
request's ``traceparent``, so the guard's spans (and vLLM's) are its children."""
from __future__ import annotations

from typing import Any, MutableMapping

from gpufleet_api import tracing as names
from gpufleet_kit.tracing import RequestTrace

from .policy import metering
from .policy import requests as rq
from .policy.choice import Pick, Picker
from .policy.table import Route


def placed(trace: RequestTrace, route: str, parsed: rq.Parsed, target: Route, asked: str) -> None:
    """The request's model, service and shape once the placement named its service (``asked``: the model
    the request named, a served model or an adapter)."""
    attributes: dict[str, Any] = {
        names.GEN_AI_REQUEST_MODEL: asked, names.SERVICE: target.service, names.STREAM: parsed.stream,
        names.GEN_AI_OPERATION: names.OPERATIONS.get(route, route)}
    if parsed.max_tokens is not None:
        attributes[names.GEN_AI_REQUEST_MAX_TOKENS] = parsed.max_tokens
    trace.set_all(attributes)


def sending(trace: RequestTrace, headers: MutableMapping[str, str], role: str, pick: Pick,
            picker: Picker | None, tried: list[str], adapter: str | None, attempt: int, retry: str = "",
            name: str = names.ROUTER_REPLICA_SPAN, extra: dict[str, Any] | None = None) -> Any:
    """The span of one send to ``pick``'s replica, started now, its context in ``headers`` (the guard's
    spans are its children). ``tried``: the replicas this round tried before (not candidates now)."""
    if not trace.on:
        return None
    attributes: dict[str, Any] = {names.REPLICA: pick.replica.pod, names.ROLE: role,
                                  names.PICK_REASON: pick.reason, names.ATTEMPT: attempt}
    if picker is not None:
        pool = picker.eligible() if adapter is None else picker.holders(adapter)
        attributes[names.PICK_CANDIDATES] = [r.pod for r in pool if r.pod not in tried] or [pick.replica.pod]
    if retry:
        attributes[names.RETRY_REASON] = retry
    if extra:
        attributes.update(extra)
    span = trace.step(name, attributes, client=True)
    trace.inject(headers)
    return span


def resuming(trace: RequestTrace, headers: MutableMapping[str, str], role: str, pick: Pick,
             picker: Picker | None, tried: list[str], adapter: str | None, attempt: int, broken: str) -> Any:
    """The span of one continuation of a stream whose replica (``broken``) broke off mid-answer."""
    return sending(trace, headers, role, pick, picker, tried, adapter, attempt, "resumed",
                   names.ROUTER_RESUME_SPAN, {names.BROKEN_REPLICA: broken})


def refused(trace: RequestTrace, span: Any, status: int, body: bytes) -> None:
    """The replica refused (429/503 about its capacity): the span ends in an error with the refusal's reason."""
    if trace.on:
        reason = metering.refusal_reason(body)
        trace.end_step(span, {names.HTTP_STATUS: status, names.REFUSAL_REASON: reason,
                              names.ERROR_TYPE: reason}, error=f"refused: {reason}")


def failed(trace: RequestTrace, span: Any, error: str) -> None:
    """Nothing answered, the replica failed, or its stream broke off."""
    if trace.on:
        trace.end_step(span, {names.ERROR_TYPE: error.split(":", 1)[0][:60]}, error=error[:300])


def answered(trace: RequestTrace, span: Any, status: int) -> None:
    """The replica's answer went to the client (``status`` 0: it broke off, or the client left, mid-answer)."""
    if trace.on:
        if not status:
            trace.end_step(span, {names.ERROR_TYPE: "broke_off"}, error="the answer broke off mid-way")
        else:
            trace.end_step(span, {names.HTTP_STATUS: status}, error="" if status < 500 else f"answered {status}")


def finished(trace: RequestTrace, status: int) -> None:
    """The tail rule at the request's end (its client answer's status; 0: cancelled): refused (any 4xx,
    429/503 included, the router's own or a guard's passed on) or failed. Resumptions and fallbacks are
    kept where they happen."""
    if status >= 500 and status != 503:
        trace.keep("error")
    elif status >= 400:
        trace.keep("refused")


def first_token(trace: RequestTrace, target: Route, ttft: float) -> None:
    """The request's first token went out ``ttft`` seconds after it came: past its service's TTFT objective,
    its trace is kept (before the TTFT histogram's exemplar is written, so the slow bucket names a kept trace)."""
    if target.ttft_objective_seconds and ttft > target.ttft_objective_seconds:
        if trace.on:
            trace.set(names.TTFT_SECONDS, ttft)
        trace.keep("slo")
