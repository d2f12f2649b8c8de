"""The router's relay against in-process engines that die mid-stream (the connection reset, or the stream
ended without [DONE]): the client's stream goes on from another replica of the same revision, with one id,
one role and usage counting the whole answer; what cannot be resumed ends in an error event, not a silent
truncation; with --no-resume-streams the client's stream breaks as the replica's did."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.choice import Picker
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session

MODEL = "tiny"
WORDS = [f" w{i}" for i in range(10)]
PROMPT = "Count:"


class FakeEngine:
    """A guard in front of a deterministic model: the answer is WORDS, one a token, continued from however
    many of them the prompt (or the final assistant message) already holds. ``die_after``: the stream breaks
    after that many words (``how``: "reset" the connection, or "eof" without [DONE])."""

    def __init__(self, name: str, free: int = 50, die_after: int | None = None, how: str = "reset"):
        self.name, self.free, self.die_after, self.how = name, free, die_after, how
        self.bodies: list[dict] = []
        self.fail_with: int | None = None    # answer this status (non-streamed), e.g. 502 engine_error
        self.refuse = 0                      # refuse this many requests with 429 (Retry-After 0) first
        self.drop = 0                        # close this many connections unanswered first (nothing admitted)
        self.dropped = 0
        self.hold_end: asyncio.Event | None = None  # after [DONE], keep the connection open until set
        self.server: TestServer | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f"gpufleet_guard_kv_free_blocks {self.free}\ngpufleet_guard_kv_reserved_blocks 0\n"
                                 f"gpufleet_guard_kv_total_blocks 100\ngpufleet_guard_kv_watermark_blocks 0\n"
                                 f"gpufleet_guard_ready 1\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        if self.drop:
            self.drop -= 1
            self.dropped += 1
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        body = await request.json()
        self.bodies.append(body)
        if self.refuse:
            self.refuse -= 1
            return web.json_response({"error": {"message": "full", "type": "rate_limit_error"}}, status=429,
                                     headers={"Retry-After": "0"})
        if self.fail_with:
            return web.json_response({"error": {"message": "engine failed", "type": "engine_error"}},
                                     status=self.fail_with)
        chat = request.path.endswith("chat/completions")
        if chat:
            last = body["messages"][-1]
            done_text = last["content"] if body.get("continue_final_message") else ""
            prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        else:
            done_text = body["prompt"].removeprefix(PROMPT)
            prompt_tokens = len(body["prompt"].split())
        start = done_text.count(" w")
        limit = body.get("max_completion_tokens", body.get("max_tokens")) or 100
        words = WORDS[start:start + limit]
        options = body.get("stream_options") or {}
        usage, continuous = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
        ident, kind = f"{self.name}-{len(self.bodies)}", "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, tokens: int | None = None) -> bytes:
            chunk: dict = {"id": ident, "object": kind, "created": len(self.bodies), "model": MODEL,
                           "choices": choices}
            if tokens is not None:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                  "total_tokens": prompt_tokens + tokens}
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        def choice(text: str, finish: str | None = None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Replica": self.name})
        await resp.prepare(request)
        if chat:
            await resp.write(event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}], 0 if continuous else None))
        for i, word in enumerate(words):
            if self.die_after is not None and i == self.die_after:
                if self.how == "reset":
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write_eof()          # a clean end, but no [DONE]
                return resp
            await resp.write(event([choice(word)], i + 1 if continuous else None))
        finish = "length" if start + limit < len(WORDS) else "stop"
        await resp.write(event([choice("", finish)], len(words) if continuous else None))
        if usage:
            await resp.write(event([], len(words)))
        await resp.write(b"data: [DONE]\n\n")
        if self.hold_end is not None:
            await self.hold_end.wait()
        await resp.write_eof()
        return resp

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self


class Rig:
    def __init__(self, engines: list[FakeEngine], settings: RouterSettings, revisions: dict[str, str],
                 down: dict[str, str]):
        self.engines = {e.name: e for e in engines}
        self.metrics = RouterMetrics()
        self.fleet = Fleet(settings, self.metrics)
        self.http = client_session(settings)
        self.server = TestServer(Router(self.fleet, self.http).app(), host="127.0.0.1")
        self.client = aiohttp.ClientSession()
        self.revisions = revisions
        self.route = self.route_of(down)

    def route_of(self, down: dict[str, str]) -> Route:
        """``down``: pod -> "restarting" (not serving, may come back) or "terminating"."""
        return Route("ml", "svc", MODEL, 16, 1, 4, tuple(
            Replica(e.name, e.address, serving=e.name not in down, revision=self.revisions.get(e.name, ""),
                    terminating=down.get(e.name) == "terminating") for e in self.engines.values()))

    async def start(self) -> Rig:
        await self.server.start_server()
        self.fleet.update(Table({MODEL: self.route}))
        await self.fleet.read_once(self.http)
        return self

    async def close(self) -> None:
        await self.client.close()
        await self.http.close()
        await self.server.close()
        for e in self.engines.values():
            assert e.server is not None
            await e.server.close()

    async def stream(self, payload: dict, route: str = "/v1/completions") -> tuple[list, bytes]:
        """(the events as parsed, the raw body) of a streamed request."""
        async with self.client.post(f"http://127.0.0.1:{self.server.port}{route}", json=payload) as r:
            assert r.status == 200
            raw = await r.read()
        events = []
        for part in raw.split(b"\n\n"):
            if part:
                data = part.removeprefix(b"data: ")
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return events, raw

    def count(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def rig_of():
    rigs: list[Rig] = []

    async def make(*engines: FakeEngine, settings: RouterSettings | None = None,
                   revisions: dict[str, str] | None = None, down: dict[str, str] | None = None) -> Rig:
        started = [await e.start() for e in engines]
        rig = await Rig(started, settings or RouterSettings(prefix_blocks=0), revisions or {}, down or {}).start()
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.close()


def text_of(events: list) -> str:
    out = ""
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_a_completion_whose_replica_dies_goes_on_from_another(rig_of, how):
    rig = await rig_of(FakeEngine("a", free=90, die_after=3, how=how), FakeEngine("b", free=10))
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert text_of(events) == "".join(WORDS[:8]) and events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert {(c["id"], c["created"]) for c in chunks} == {("a-1", 1)}          # the first replica's
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9}
    assert all("usage" not in c for c in chunks[:-1])                      # usage at the end, as asked
    [continued] = rig.engines["b"].bodies
    assert continued["prompt"] == PROMPT + "".join(WORDS[:3]) and continued["max_tokens"] == 5
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="resumed") == 1
    assert rig.count("gpufleet_router_resume_gap_seconds_count", service="svc") == 1
    assert rig.count("gpufleet_router_requests_total", model=MODEL, outcome="ok") == 1


async def test_a_resumed_stream_is_counted_before_its_end_reaches_the_client(rig_of):
    # The continuation's replica sends [DONE] but closes its connection only later: a client that has read the
    # end and then looks at the router's metrics sees the stream counted as resumed.
    rig = await rig_of(FakeEngine("a", free=90, die_after=3), FakeEngine("b", free=10))
    rig.engines["b"].hold_end = release = asyncio.Event()
    url = f"http://127.0.0.1:{rig.server.port}/v1/completions"
    async with rig.client.post(url, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}) as r:
        received = b""
        while not received.endswith(b"data: [DONE]\n\n"):
            received += await r.content.readuntil(b"\n\n")
        try:
            assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="resumed") == 1
        finally:
            release.set()
    assert rig.count("gpufleet_router_requests_total", model=MODEL, outcome="ok") == 1


async def test_a_chat_whose_replica_dies_continues_the_assistant_message(rig_of):
    rig = await rig_of(FakeEngine("a", free=90, die_after=4), FakeEngine("b", free=10))
    events, _ = await rig.stream({"model": MODEL, "messages": [{"role": "user", "content": "Count"}],
                                  "stream": True}, "/v1/chat/completions")
    chunks = [e for e in events if isinstance(e, dict)]
    assert text_of(events) == "".join(WORDS) and events[-1] == "[DONE]"
    assert sum("role" in c["choices"][0]["delta"] for c in chunks) == 1        # one role announcement
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)                              # not asked for
    [continued] = rig.engines["b"].bodies
    assert continued["messages"][-1] == {"role": "assistant", "content": "".join(WORDS[:4])}
    assert continued["continue_final_message"] is True and continued["add_generation_prompt"] is False


async def test_what_cannot_be_resumed_ends_in_an_error_event(rig_of):
    rig = await rig_of(FakeEngine("a", free=90, die_after=2), FakeEngine("b", free=10))
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True, "logprobs": 1})
    assert events[-2]["error"]["code"] == "stream_not_resumable" and "logprobs" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]" and rig.engines["b"].bodies == []
    # Not resumable: sent as the client asked (no usage added).
    assert "stream_options" not in rig.engines["a"].bodies[0]
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="refused") == 1


async def test_resumptions_are_bounded_then_the_stream_ends_in_an_error_event(rig_of):
    rig = await rig_of(*(FakeEngine(n, free=f, die_after=1) for n, f in (("a", 90), ("b", 50), ("c", 40),
                                                                          ("d", 10))),
                       settings=RouterSettings(prefix_blocks=0, max_resumptions=2))
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert text_of(events) == "".join(WORDS[:3])                            # one word from each of three
    assert events[-2]["error"]["code"] == "stream_broken" and events[-1] == "[DONE]"
    assert rig.engines["d"].bodies == []
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="failed") == 1


async def test_a_resumption_stays_with_the_revision_of_the_replica_that_died(rig_of):
    rig = await rig_of(FakeEngine("a", free=90, die_after=2), FakeEngine("b", free=80), FakeEngine("c", free=10),
                       revisions={"a": "r1", "b": "r2", "c": "r1"})
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert text_of(events) == "".join(WORDS) and rig.engines["b"].bodies == [] and len(rig.engines["c"].bodies) == 1
    assert rig.count("gpufleet_router_revision_requests_total", model=MODEL, revision="r1") == 1


async def test_no_other_replica_of_the_revision_ends_the_stream_in_an_error_event(rig_of):
    rig = await rig_of(FakeEngine("a", free=90, die_after=2), FakeEngine("b", free=10),
                       revisions={"a": "r1", "b": "r2"})
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert events[-2]["error"]["code"] == "stream_broken" and "revision" in events[-2]["error"]["message"]
    assert rig.engines["b"].bodies == []


async def test_a_stream_waits_for_a_replica_of_its_revision_on_its_way_back(rig_of):
    # The other replica's engine was restarting when this one died (both went down under the same load):
    # the continuation waits for it to be Ready again, within --resume-timeout-seconds.
    rig = await rig_of(FakeEngine("a", free=90, die_after=3), FakeEngine("b", free=10), down={"b": "restarting"})
    picker = rig.fleet.picker(MODEL)
    assert picker is not None
    asked = []

    def recovering(revision: str, exclude=()) -> bool:
        # The router found no replica to continue on and asks whether one is on its way back: b is,
        # and becomes Ready while the router waits.
        out = Picker.recovering(picker, revision, exclude)
        asked.append(out)
        asyncio.get_running_loop().call_soon(lambda: rig.fleet.update(Table({MODEL: rig.route_of({})})))
        return out
    picker.recovering = recovering  # type: ignore[method-assign]
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert asked == [True]
    assert text_of(events) == "".join(WORDS) and events[-1] == "[DONE]"
    assert len(rig.engines["b"].bodies) == 1
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="resumed") == 1


async def test_a_replica_that_does_not_come_back_in_time_ends_the_stream_in_an_error_event(rig_of):
    rig = await rig_of(FakeEngine("a", free=90, die_after=2), FakeEngine("b", free=10), down={"b": "restarting"},
                       settings=RouterSettings(prefix_blocks=0, resume_timeout=0.3))
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert events[-2]["error"]["code"] == "stream_broken" and events[-1] == "[DONE]"
    assert rig.engines["b"].bodies == []
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="failed") == 1


async def test_a_terminating_replica_is_not_waited_for(rig_of):
    # Deleted pods do not come back: the stream ends at once, not at --resume-timeout-seconds.
    rig = await rig_of(FakeEngine("a", free=90, die_after=2), FakeEngine("b", free=10), down={"b": "terminating"},
                       settings=RouterSettings(prefix_blocks=0, resume_timeout=3600))
    events, _ = await asyncio.wait_for(rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True}), 60)
    assert events[-2]["error"]["code"] == "stream_broken"


async def test_with_resumption_off_the_clients_stream_breaks_as_the_replicas_did(rig_of):
    rig = await rig_of(FakeEngine("a", free=90, die_after=2), FakeEngine("b", free=10),
                       settings=RouterSettings(prefix_blocks=0, resume_streams=False))
    payload = {"model": MODEL, "prompt": PROMPT, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        await rig.stream(payload)
    assert rig.engines["a"].bodies == [payload] and rig.engines["b"].bodies == []


async def test_a_request_whose_engine_failed_before_answering_goes_to_another_replica(rig_of):
    failing = FakeEngine("a", free=90)
    failing.fail_with = 502
    rig = await rig_of(failing, FakeEngine("b", free=10))
    async with rig.client.post(f"http://127.0.0.1:{rig.server.port}/v1/completions",
                               json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3}) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
    assert rig.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="connect_failed") == 1


async def test_a_continuation_refused_for_room_waits_for_the_retry_after_and_goes_on(rig_of):
    survivor = FakeEngine("b", free=10)
    rig = await rig_of(FakeEngine("a", free=90, die_after=3), survivor)
    survivor.refuse = 2     # the load of the replica that died came here: no room at first
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert text_of(events) == "".join(WORDS) and events[-1] == "[DONE]"
    assert len(survivor.bodies) == 3
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="resumed") == 1


async def test_a_continuation_refused_until_the_timeout_ends_in_an_error_event(rig_of):
    survivor = FakeEngine("b", free=10)
    rig = await rig_of(FakeEngine("a", free=90, die_after=3), survivor,
                       settings=RouterSettings(prefix_blocks=0, resume_timeout=0.0, reading_interval=1.0))
    survivor.refuse = 100
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert events[-2]["error"]["code"] == "stream_broken" and "refused" in events[-2]["error"]["message"]
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="failed") == 1


async def test_a_continuation_whose_connection_failed_is_sent_again_after_a_pause(rig_of):
    # CI's real node: the one other replica's guard did not accept the continuation's connection within
    # --connect-timeout (its engine had just restarted on a busy node). Nothing reached it, so it is not a
    # replica that broke off: the continuation goes to it again and the stream is resumed.
    survivor = FakeEngine("b", free=10)
    rig = await rig_of(FakeEngine("a", free=90, die_after=3), survivor)
    survivor.drop = 2
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert text_of(events) == "".join(WORDS) and events[-1] == "[DONE]"
    assert survivor.dropped == 2 and len(survivor.bodies) == 1
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="resumed") == 1
    assert rig.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="connect_failed") == 2


async def test_a_continuation_that_never_connects_ends_at_the_resume_timeout_in_an_error_event(rig_of):
    survivor = FakeEngine("b", free=10)
    rig = await rig_of(FakeEngine("a", free=90, die_after=3), survivor,
                       settings=RouterSettings(prefix_blocks=0, resume_timeout=1.0))
    survivor.drop = 1000
    events, _ = await rig.stream({"model": MODEL, "prompt": PROMPT, "stream": True})
    assert events[-2]["error"]["code"] == "stream_broken" and events[-1] == "[DONE]"
    assert "b (" in events[-2]["error"]["message"]          # the failure named: b's connection
    # Pauses of 0.25 s then 0.5 s fit in 1 s, 1 s more does not: three tries, not a spin.
    assert survivor.dropped == 3 and survivor.bodies == []
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="failed") == 1
