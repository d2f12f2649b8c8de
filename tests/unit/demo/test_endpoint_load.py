"""The demo's load generator over an injected transport: what a streaming
client sees (first token, token count), a refusal with its hint, and a
draining replica's refusal retried on another replica."""
from __future__ import annotations

import json

import httpx

from gpufleet_dev.demo.load import EndpointLoad


def sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def load_over(handler) -> tuple[EndpointLoad, httpx.AsyncClient]:
    load = EndpointLoad(kube=None, namespace="demo", service="chat", model="tiny", prompt_tokens=4, max_tokens=2)
    load.endpoints = ["http://10.0.0.1:8080", "http://10.0.0.2:8080"]
    return load, httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_streamed_completion_records_first_token_and_usage():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["max_tokens"] == 2
        return httpx.Response(200, content=sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                                                {"choices": [], "usage": {"completion_tokens": 2}}))

    load, http = load_over(handler)
    async with http:
        result = await load.one(http)
    assert result.status == 200 and result.tokens == 2 and result.ttft is not None and not result.error


async def test_refusal_keeps_the_retry_hint():
    load, http = load_over(lambda request: httpx.Response(429, headers={"Retry-After": "0"}, text="KV cache full"))
    async with http:
        result = await load.one(http)
    assert (result.status, result.retry_after, result.error) == (429, "0", "KV cache full")
    assert (result.refusals, result.attempts) == (1, 1)  # the default client takes the refusal as its answer


async def test_draining_replica_is_skipped_for_another():
    async def refresh():  # no API server here: the endpoints stay as they are
        return load.endpoints

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.2":
            return httpx.Response(503, text="draining")
        return httpx.Response(200, content=sse({"choices": [], "usage": {"completion_tokens": 1}}))

    load, http = load_over(handler)
    load.refresh_endpoints = refresh
    async with http:
        result = await load.one(http)
    assert result.status == 200 and result.retried == 1 and result.endpoint == "http://10.0.0.1:8080"
