"""Refusals as HTTP answers: the guard's own errors in OpenAI's shape, client errors in vLLM's,
and ``Refusals``, the one place a ``Rejection`` is counted and turned into a response."""
from __future__ import annotations

import math
import random
from typing import Callable

from aiohttp import web

from gpufleet_api import tracing as names
from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_engine.admission import sli
from gpufleet_engine.admission.core import Admission
from gpufleet_engine.admission.grants import Rejection
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_kit.tracing import current


def invalid_response(status: int, message: str, param: str | None = None) -> web.Response:
    """A client error in vLLM's own format, so clients see the same 4xx with or without the guard."""
    kind = {400: "BadRequestError", 403: "PermissionDeniedError", 404: "NotFoundError",
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


class Refusals:
    """Counts each refusal and answers it: a 429's retry hint sized by the admission core."""

    def __init__(self, admission: Admission, metrics: GuardMetrics):
        self._admission = admission
        self._metrics = metrics

    def refuse(self, queue_class: QueueClass, r: Rejection, stream: bool | None = None,
               adapter: str | None = None) -> web.Response:
        """``stream``: whether the refused request asked to stream; None when it was not read.
        ``adapter``: the LoRA adapter it asked for, once read."""
        self._admission.refused(r)
        trace = current()
        if trace.on:
            trace.set_all({names.CLASS: queue_class.name, names.REFUSAL_REASON: r.reason,
                           names.ERROR_TYPE: r.reason})
            trace.keep("refused")
        m = self._metrics
        m.rejections.labels(queue_class.name, r.reason).inc()
        m.count_sli(queue_class.name, sli.judge_refusal(r.reason, stream))
        invalid = r.status in (400, 403, 404, 413)
        outcome = "invalid" if invalid else "rejected"
        m.requests.labels(queue_class.name, outcome).inc()
        if adapter is not None:
            m.adapter_requests.labels(adapter, outcome).inc()
        if invalid:
            return invalid_response(r.status, r.message, r.param)
        return error_response(r.status, r.reason, r.message, r.retry_after)
