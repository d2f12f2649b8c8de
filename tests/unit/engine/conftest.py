"""Fakes for the guard's unit tests: a word tokenizer and a scripted vLLM.

The fake vLLM is a real aiohttp server on 127.0.0.1 that speaks the parts of
vLLM's API the guard uses (/metrics, /v1/completions, /v1/chat/completions
with SSE, /v1/models), so the guard's HTTP path is exercised for real; only
the model behind it is scripted.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gpufleet_api.guard import guard_config
from gpufleet_engine.serving.server import GuardServer


class WordTokenizer:
    """One token per whitespace-separated word; chat adds 3 tokens per message and 2 for the reply prompt."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join("w" * max(1, i) for i in ids)

    def chat_ids(self, messages, template_kwargs) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [0, 0] + self.encode(m["content"]) + [0]
        if template_kwargs.get("add_generation_prompt", True):
            ids += [0, 0]
        return ids


@pytest.fixture
def tokenizer() -> WordTokenizer:
    return WordTokenizer()


METRICS_TEMPLATE = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0
vllm:num_preemptions_total{{engine="0",model_name="m"}} 0.0
vllm:cache_config_info{{block_size="{block_size}",engine="0",num_gpu_blocks="{blocks}",num_gpu_blocks_override="None"}} 1.0
"""


@dataclass
class FakeVllm:
    blocks: int = 64
    block_size: int = 32
    usage: float = 0.0
    # Seconds between streamed tokens: a slow upstream is what some tests are about
    # (timeouts, disconnects), so this sleep is the behaviour, not synchronisation.
    token_delay: float = 0.0
    # When set, every generation waits for this event before answering: requests stay
    # in flight at vLLM exactly as long as a test needs, without timing assumptions.
    hold: asyncio.Event | None = None
    # When set, a stream waits for this event after its first token: an answer begun and unfinished.
    hold_after_first: asyncio.Event | None = None
    metrics_up: bool = True
    # When set, answers end (at "EOS") after this many tokens, below max_tokens.
    answer_tokens: int | None = None
    # The context vLLM reports in /v1/models; None: the field is left out (not vLLM's server).
    max_model_len: int | None = None
    seen_bodies: list[dict] = field(default_factory=list)
    running: int = 0
    disconnects: int = 0
    completed: int = 0
    url: str = ""

    def app(self) -> web.Application:
        # vLLM's API server sets no body limit of its own: whatever the guard admits reaches it.
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def _metrics(self, request):
        if not self.metrics_up:
            return web.Response(status=500)
        return web.Response(text=METRICS_TEMPLATE.format(usage=self.usage, running=self.running,
                                                         block_size=self.block_size, blocks=self.blocks))

    async def _models(self, request):
        card: dict[str, Any] = {"id": "m", "object": "model"}
        if self.max_model_len is not None:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def _generate(self, request):
        body = await request.json()
        self.seen_bodies.append(body)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 4)
        if self.answer_tokens is not None:
            n = min(n, self.answer_tokens)
        if body.get("model") == "fail-400":
            return web.json_response({"error": {"message": "bad", "code": 400}}, status=400)
        if body.get("model") == "fail-500":
            # What vLLM answers for a request it finished with an error (a KV load that failed
            # under kv_load_failure_policy "fail", among others).
            return web.json_response({"error": {"message": "Internal server error", "type": "InternalServerError",
                                                "param": None, "code": 500}}, status=500)
        self.running += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
            if body.get("stream"):
                resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
                await resp.prepare(request)
                for i in range(n):
                    if self.token_delay:
                        await asyncio.sleep(self.token_delay)
                    await resp.write(f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n'.encode())
                    if i == 0 and self.hold_after_first is not None:
                        await self.hold_after_first.wait()
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                self.completed += 1
                return resp
            if self.token_delay:
                await asyncio.sleep(self.token_delay * n)
            self.completed += 1
            return web.json_response({"choices": [{"index": 0, "text": "t" * n}],
                                      "usage": {"completion_tokens": n}})
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        finally:
            self.running -= 1


@contextlib.asynccontextmanager
async def serving(fake):
    """``fake.app()`` on a loopback port of its own, its address in ``fake.url``."""
    runner = web.AppRunner(fake.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake_vllm():
    async with serving(FakeVllm()) as fake:
        yield fake


@pytest.fixture
async def guard_factory(fake_vllm, tokenizer):
    """Start guards in front of the fake vLLM, with guard.json fields overridden; stop them after."""
    started: list[GuardServer] = []

    async def make(**overrides: Any) -> GuardServer:
        raw = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake_vllm.url,
               "listenHost": "127.0.0.1", "listenPort": 0, "metricsPollSeconds": 0.05,
               "maxContextTokens": 1000, "kvWatermarkPercent": 15, **overrides}  # the tests' arithmetic
        server = GuardServer(guard_config.parse(raw), tokenizer=tokenizer)
        await server.start()
        started.append(server)
        await server.wait_ready(5)
        return server

    yield make
    for s in started:
        await s.stop()
