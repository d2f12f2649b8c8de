"""vLLM's HTTP API on the guard's port: every route of ``vllm_routes`` wired to its handling.

Admitted routes go through ``Guard.handle``; health and information are
answered with the guard's state folded in; the rest is passed through to
vLLM unchanged; administration only for the operator's token (operator_only.py) on the guard's
port, or on the admin socket that only the pod's own containers reach (``register_admin``). A path vLLM
does not serve is answered as vLLM answers it (404, or 405 with Allow, in FastAPI's
``{"detail": ...}``).
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_engine.serving.errors import error_response
from gpufleet_engine.serving.guard import Guard, body_budget_message
from gpufleet_engine.serving.operator_only import operator_only
from gpufleet_engine.serving.operator_tokens import OperatorTokens
from gpufleet_engine.serving.upstream import FORWARDED_REQUEST_HEADERS, FORWARDED_RESPONSE_HEADERS
from gpufleet_engine.vllm.routes import ROUTES, Handling, VllmRoute, allowed_methods
from gpufleet_kit.body_budget import BodyTooLarge, BudgetExhausted, read_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def vllm_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error in vLLM's own JSON format (its HTTPException handler)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def register(app: web.Application, guard: Guard, tokens: OperatorTokens) -> None:
    """Add every route of the table the guard does not answer itself, then vLLM's 404/405 for the rest.
    Call it after the guard's own routes: the catch-all must come last."""
    for route in ROUTES:
        handler = _handler(route, guard, tokens)
        if handler is None:
            continue
        for method in route.methods:
            app.router.add_route(method, route.path, handler)
    app.router.add_route("*", "/{path:.*}", _not_vllm)


def register_admin(app: web.Application, guard: Guard) -> None:
    """vLLM's admin routes on the admin socket (server.build_admin_app), where reaching them is the proof."""
    for route in ROUTES:
        if route.handling is Handling.POD_ONLY:
            for method in route.methods:
                app.router.add_route(method, route.path, _passed(guard))


def _passed(guard: Guard) -> Handler:
    async def passed(request: web.Request) -> web.StreamResponse:
        return await passthrough(guard, request)
    return passed


def _unauthenticated(message: str) -> web.Response:
    return vllm_error(401, message, "Unauthorized")


def _handler(route: VllmRoute, guard: Guard, tokens: OperatorTokens) -> Handler | None:
    if route.handling is Handling.ADMITTED:
        assert route.accounted_as is not None
        accounted_as = route.accounted_as

        async def admitted(request: web.Request) -> web.StreamResponse:
            return await guard.handle(request, accounted_as)
        return admitted
    if route.handling is Handling.STATE:
        return _STATE[route.path](guard)
    if route.handling is Handling.PASSED:
        return _passed(guard)
    if route.handling is Handling.POD_ONLY:
        # They change or inspect the engine's state: the operator's token, whatever the source address.
        return operator_only(tokens, _passed(guard), _unauthenticated)
    if route.handling is Handling.NOT_SERVED:
        reason = route.reason

        async def not_served(request: web.Request) -> web.StreamResponse:
            return routing_error(404, f"Not Found: {request.path} is not served through gpufleet's guard: "
                                 f"{reason}.")
        return not_served
    return None  # GUARD: the guard's own route (server.py)


def routing_error(status: int, detail: str, headers: dict[str, str] | None = None) -> web.Response:
    """What vLLM's server (FastAPI) answers for a path or method it has no route for, byte for byte."""
    return web.json_response({"detail": detail}, status=status, headers=headers,
                             dumps=lambda v: json.dumps(v, separators=(",", ":")))


async def _not_vllm(request: web.Request) -> web.StreamResponse:
    allowed = allowed_methods(request.path)
    if allowed:
        return routing_error(405, "Method Not Allowed", headers={"Allow": ", ".join(sorted(allowed))})
    return routing_error(404, "Not Found")


def _engine_down(guard: Guard, problem: str) -> web.Response:
    return error_response(503, Reason.ENGINE_DOWN, f"The model engine is not available: {problem}",
                          guard.config.retry_after_seconds)


async def passthrough(guard: Guard, request: web.Request) -> web.StreamResponse:
    """The request to vLLM as it came (method, path, query, body, the forwarded headers), and
    vLLM's answer back; streams are relayed chunk by chunk."""
    # Its body counts in the guard's bodyBudgetBytes as the proxied routes' do, until vLLM has answered.
    with guard.body_budget.claim() as claim:
        try:
            body = await read_body(request, guard.body_limit(), claim) if request.can_read_body else None
        except BodyTooLarge:
            return vllm_error(413, guard.body_too_large().message, "RequestEntityTooLargeError")
        except BudgetExhausted as e:
            return error_response(503, Reason.BODY_BUDGET, body_budget_message(e), guard.config.retry_after_seconds)
        return await _send_on(guard, request, body)


async def _send_on(guard: Guard, request: web.Request, body: bytes | None) -> web.StreamResponse:
    headers = {h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers}
    assert guard.upstream.session is not None
    try:
        async with guard.upstream.session.request(request.method, guard.upstream.url(request.path_qs),
                                                  data=body, headers=headers) as resp:
            out_headers = {h: resp.headers[h] for h in FORWARDED_RESPONSE_HEADERS if h in resp.headers}
            if "content-encoding" in resp.headers:
                out_headers["content-encoding"] = resp.headers["content-encoding"]
            if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                return web.Response(body=await resp.read(), status=resp.status, headers=out_headers)
            out = web.StreamResponse(status=resp.status, headers=out_headers)
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
    except aiohttp.ClientConnectorError as e:
        guard.on_engine_unreachable()
        return _engine_down(guard, str(e))
    except aiohttp.ClientError as e:
        return error_response(502, "engine_error", f"The model engine failed mid-request: {e}")


def _health(guard: Guard) -> Handler:
    async def health(request: web.Request) -> web.StreamResponse:
        # vLLM answers 200 or 503 with no body. Unhealthy too while the guard would refuse work:
        # a router that reads /health stops sending before the guard has to say 503.
        if guard.not_ready_reasons():
            return web.Response(status=503)
        assert guard.upstream.session is not None
        try:
            async with guard.upstream.session.get(guard.upstream.url("/health")) as resp:
                return web.Response(status=resp.status)
        except aiohttp.ClientError:
            guard.on_engine_unreachable()
            return web.Response(status=503)
    return health


def _load(guard: Guard) -> Handler:
    async def load(request: web.Request) -> web.StreamResponse:
        # vLLM counts the requests it runs; the ones queued in the guard are load it cannot see.
        queued = sum(guard.admission.queue.depth(c.name) for c in guard.config.queue_classes)
        return web.json_response({"server_load": guard.admission.scheduler.running + queued})
    return load


def _models(guard: Guard) -> Handler:
    async def models(request: web.Request) -> web.StreamResponse:
        if not guard.engine_up:
            return _engine_down(guard, guard.engine_problem)
        return await passthrough(guard, request)
    return models


_STATE: dict[str, Callable[[Guard], Handler]] = {
    "/health": _health, "/ping": _health, "/load": _load, "/v1/models": _models,
}
