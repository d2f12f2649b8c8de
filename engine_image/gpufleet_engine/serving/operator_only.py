"""The guard's control routes accept the operator only: a handler wrapped here answers 401 unless
the request carries the operator's bearer token (operator_tokens.py). The source address counts
for nothing: behind a mesh sidecar or a port-forward every caller is on loopback."""
from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from gpufleet_engine.serving.operator_tokens import OperatorTokens, Refused

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# How a refusal is worded: the guard's own error shape, or vLLM's on vLLM's routes.
Refusal = Callable[[str], web.Response]
CHALLENGE = 'Bearer realm="gpufleet-guard", error="invalid_token"'


def guard_refusal(problem: str) -> web.Response:
    body = {"error": {"message": problem, "type": "authentication_error", "param": "Authorization",
                      "code": "unauthenticated"}}
    return web.json_response(body, status=401, headers={"WWW-Authenticate": CHALLENGE})


def operator_only(tokens: OperatorTokens, handler: Handler, refusal: Refusal = guard_refusal) -> Handler:
    async def checked(request: web.Request) -> web.StreamResponse:
        try:
            tokens.verify(request.headers.get("Authorization"))
        except Refused as e:
            response = refusal(f"{request.method} {request.path} accepts the gpufleet operator only: {e}")
            response.headers["WWW-Authenticate"] = CHALLENGE
            return response
        return await handler(request)
    return checked
