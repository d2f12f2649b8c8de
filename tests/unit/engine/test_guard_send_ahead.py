"""A request sent on to vLLM ahead of its parse (``Guard._send_ahead``): on the wire before the
guard parses it, nothing of vLLM's answer relayed before the parse admits it as sent, and where
the parse does not (invalid, too long, a body to change, more blocks than the bound held) vLLM's
copy aborted and the request answered exactly as without sending ahead."""
from __future__ import annotations

import asyncio
import socket
import threading

import aiohttp
import pytest

from gpufleet_engine.admission import route_costs
from tests.unit.engine.test_guard_proxy import metrics, sample, until


class Relay:
    """A TCP relay in threads between the guard and the fake vLLM: it sees a request's bytes
    arrive whatever the guard's event loop is doing (the fake shares that loop)."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.posted = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        try:
            while data := src.recv(65536):
                if watch and b"POST /v1/" in data:
                    self.posted.set()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def roomy_vllm(fake_vllm):
    """A pool with room for two whole contexts of 1000 tokens besides the watermark."""
    fake_vllm.blocks = 1024
    return fake_vllm


@pytest.fixture
def parses(monkeypatch):
    """Each parse of the guard, recorded as whether the request was on its way to vLLM when it began."""
    seen: list[bool] = []
    relay_box: list[Relay] = []
    original = route_costs.prepare

    def prepare(*args, **kwargs):
        # Blocking the loop here is the point: only bytes already written can reach the relay.
        seen.append(relay_box[0].posted.wait(0.5) if relay_box else False)
        return original(*args, **kwargs)

    monkeypatch.setattr(route_costs, "prepare", prepare)
    return seen, relay_box


async def test_the_request_is_on_its_way_to_vllm_before_the_guard_parses_it(guard_factory, roomy_vllm, parses):
    seen, relay_box = parses
    relay = Relay(int(roomy_vllm.url.rsplit(":", 1)[1]))
    relay_box.append(relay)
    try:
        # Two loop turns put a request on a kept-alive connection on the wire; opening a new one
        # takes more, and then the parse simply runs first. A slow metrics poll leaves the pooled
        # connections idle, and a first request makes sure one is there.
        guard = await guard_factory(engineUrl=f"http://127.0.0.1:{relay.port}", metricsPollSeconds=30)
        body = {"model": "m", "prompt": "a b c", "max_tokens": 5, "stream": True}
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                relay.posted.clear()
                async with s.post(guard.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    text = await r.text()
            counted = await metrics(s, guard)
    finally:
        relay.close()
    assert seen[-1] is True
    assert text.count("data: ") == 6 and text.endswith("data: [DONE]\n\n")
    assert sample(counted, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "ok"}) == 2
    assert sample(counted, "gpufleet_guard_sent_ahead_total", **{"class": "standard", "outcome": "kept"}) == 2
    assert sample(counted, "gpufleet_guard_sent_ahead_total", **{"class": "standard", "outcome": "aborted"}) == 0
    assert guard.guard.admission.ledger.in_flight == 0 and guard.guard.admission.scheduler.running == 0


async def test_below_vllms_context_or_in_a_full_pool_the_parse_comes_first(guard_factory, roomy_vllm, parses):
    seen, relay_box = parses
    relay = Relay(int(roomy_vllm.url.rsplit(":", 1)[1]))
    relay_box.append(relay)
    roomy_vllm.max_model_len = 2048  # the guard's limit (1000) below vLLM's context
    try:
        guard = await guard_factory(engineUrl=f"http://127.0.0.1:{relay.port}")
        async with aiohttp.ClientSession() as s:
            async with s.post(guard.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}) as r:
                assert r.status == 200
    finally:
        relay.close()
    assert seen == [False]


async def test_no_room_for_two_whole_contexts_no_sending_ahead(guard_factory, fake_vllm):
    guard = await guard_factory()  # 64 blocks: one context of 1000 tokens is 32 of them
    body = {"prompt": "a", "max_tokens": 2}
    assert guard.guard.send_ahead.grant_ahead(b"{}", guard.guard.config.queue_class("standard")) is None
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 200


async def test_refused_after_it_was_sent_ahead_the_answer_is_the_guards_and_vllms_copy_is_aborted(
        guard_factory, roomy_vllm):
    roomy_vllm.token_delay = 0.05   # vLLM's copy still streaming when the guard answers
    guard = await guard_factory(maxContextTokens=50)  # vLLM reports no context: 50 is vLLM's own
    body = {"prompt": "x " * 45, "max_tokens": 10, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        # The guard may refuse before its copy even reached vLLM (a loaded machine connects slowly): then
        # vLLM never sees it. Whichever came first, no copy runs on and none is answered.
        await until(lambda: roomy_vllm.running == 0 and roomy_vllm.disconnects == len(roomy_vllm.seen_bodies),
                    "vLLM's copy to be aborted or never to arrive")
        text = await metrics(s, guard)
    assert error["type"] == "BadRequestError" and "45 prompt tokens" in error["message"]
    assert roomy_vllm.completed == 0
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "invalid"}) == 1
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "standard", "reason": "context_length"}) == 1
    assert sample(text, "gpufleet_guard_sent_ahead_total", **{"class": "standard", "outcome": "aborted"}) == 1
    assert guard.guard.admission.ledger.in_flight == 0 and guard.guard.admission.scheduler.running == 0


async def test_invalid_json_sent_ahead_is_answered_by_the_guard(guard_factory, roomy_vllm):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", data=b'{"prompt": "a", "max_tokens": ',
                          headers={"content-type": "application/json"}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        text = await metrics(s, guard)
    assert "not valid JSON" in error["message"]
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "invalid"}) == 1
    assert guard.guard.admission.ledger.in_flight == 0 and guard.guard.admission.scheduler.running == 0


async def test_a_body_the_guard_must_change_is_sent_again_changed(guard_factory, roomy_vllm):
    roomy_vllm.token_delay = 0.02
    guard = await guard_factory(maxContextTokens=50, overLengthPolicy="TruncateLeft")
    body = {"prompt": "x " * 45, "max_tokens": 10, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["x-gpufleet-truncated-tokens"] == "5"
            text = await r.text()
    # The copy sent as the client sent it (too long: vLLM at this context refuses it) is aborted;
    # the answer is the truncated request's, whole.
    assert [b["prompt"] for b in roomy_vllm.seen_bodies][-1] == [1] * 40
    assert text.count("data: ") == 11
    await until(lambda: roomy_vllm.running == 0, "vLLM's copies to end")
    assert roomy_vllm.completed == 1
    assert guard.guard.admission.ledger.in_flight == 0 and guard.guard.admission.scheduler.running == 0


async def test_the_bound_held_ahead_is_settled_to_the_requests_real_cost(guard_factory, roomy_vllm):
    roomy_vllm.token_delay = 0.05
    guard = await guard_factory(reservation="FullBudget")
    g = guard.guard.admission
    small = {"prompt": "a", "max_tokens": 40, "n": 3, "stream": True}        # 3 × 2 blocks, below the bound of 32
    big = {"prompt": "a", "max_tokens": 900, "n": 2, "stream": True}         # 2 × 29 blocks, above it
    async with aiohttp.ClientSession() as s:
        for body, cost in ((small, 6), (big, 58)):
            async with s.post(guard.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()   # streaming: admitted and running
                assert g.ledger.expected_blocks == cost
                assert g.scheduler.running == 1
                await r.read()
    assert g.ledger.in_flight == 0 and g.scheduler.running == 0 and g.ledger.expected_blocks == 0


async def test_a_client_gone_mid_stream_leaves_nothing_held(guard_factory, roomy_vllm):
    roomy_vllm.token_delay = 0.05
    guard = await guard_factory()
    body = {"prompt": "a b", "max_tokens": 50, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()
        # Left mid-stream: the guard cancels, vLLM's request is aborted, the grant released.
        await until(lambda: roomy_vllm.disconnects == 1, "vLLM's request to be aborted")
        await until(lambda: guard.guard.admission.scheduler.running == 0, "the grant to be released")
    assert guard.guard.admission.ledger.in_flight == 0


async def test_a_request_sent_ahead_is_in_flight_for_the_audit_before_vllm_answers(guard_factory, roomy_vllm):
    # A request that does not stream gets vLLM's headers only with its whole answer: it must count
    # as in flight (of unknown length) from its admission, not from vLLM's answer.
    roomy_vllm.hold = asyncio.Event()
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        sent = asyncio.create_task(s.post(guard.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 5}))
        await until(lambda: roomy_vllm.running == 1, "vLLM to hold the request")
        assert [t.tokens for t in guard.guard.tracked.values()] == [None]
        roomy_vllm.hold.set()
        async with await sent as r:
            assert r.status == 200
    assert guard.guard.tracked == {}
