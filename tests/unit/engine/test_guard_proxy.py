"""The guard's HTTP behaviour in front of a scripted vLLM (see conftest.FakeVllm)."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp

from tests.support.token_issuer import Issuer
from tests.support.waiting import wait_for

METRICS_DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not exported")


async def metrics(session, guard) -> str:
    async with session.get(guard.url + "/metrics") as r:
        return await r.text()


async def until(check, what: str, timeout: float = 5):
    """Until ``check()`` holds; the fake vLLM and the guard share this event loop, so polling
    every few milliseconds sees each state change within a scheduling round."""
    return await wait_for(check, timeout=timeout, interval=0.005, what=what)


async def test_streaming_is_passed_through_byte_for_byte(guard_factory, fake_vllm):
    guard = await guard_factory()
    body = {"model": "m", "prompt": "a b c", "max_tokens": 5, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_vllm.url + "/v1/completions", json=body) as r:
            direct = await r.read()
        async with s.post(guard.url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
            via_guard = await r.read()
        text = await metrics(s, guard)
    assert via_guard == direct
    assert sample(text, "gpufleet_guard_ttft_seconds_count", **{"class": "standard"}) == 1
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "ok"}) == 1


async def test_a_request_over_the_kv_watermark_gets_429_with_retry_after(guard_factory, fake_vllm):
    fake_vllm.usage = 0.75                      # 48 of 64 blocks used, 10 kept free → 6 left
    guard = await guard_factory(retryAfterSeconds=2)
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions",
                          json={"prompt": "x " * 100, "max_tokens": 100}) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "2" and 1000 <= int(r.headers["retry-after-ms"]) <= 3000
            error = (await r.json())["error"]
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10}) as r:
            assert r.status == 200                  # a one-block request still fits
        text = await metrics(s, guard)
    assert error["code"] == "kv_watermark" and "needs 7 blocks" in error["message"]
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "standard", "reason": "kv_watermark"}) == 1
    assert len(fake_vllm.seen_bodies) == 1


async def test_over_long_context_is_refused_before_vllm_with_the_counts(guard_factory, fake_vllm):
    # Below vLLM's own context (which would run it), the guard refuses before sending anything on.
    # At vLLM's context a request may be sent on ahead of its parse: test_guard_send_ahead.py.
    fake_vllm.max_model_len = 2048
    guard = await guard_factory(maxContextTokens=50)
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x " * 45, "max_tokens": 10}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        text = await metrics(s, guard)
    # vLLM's own error shape, so a client sees the same 400 with or without the guard.
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["param"] == "max_tokens"
    assert "45 prompt tokens" in error["message"] and "maximum context is 50 tokens" in error["message"]
    assert sample(text, "gpufleet_guard_rejections_total", **{"class": "standard", "reason": "context_length"}) == 1
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "invalid"}) == 1
    assert fake_vllm.seen_bodies == []


async def test_truncate_left_forwards_the_newest_tokens_and_says_how_many_were_cut(guard_factory, fake_vllm):
    fake_vllm.max_model_len = 2048  # the guard's limit below vLLM's: nothing is sent ahead of the parse
    guard = await guard_factory(maxContextTokens=50, overLengthPolicy="TruncateLeft")
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x " * 45, "max_tokens": 10}) as r:
            assert r.status == 200
            assert r.headers["x-gpufleet-truncated-tokens"] == "5"
    assert [b["prompt"] for b in fake_vllm.seen_bodies] == [[1] * 40]


async def test_engine_down_means_fast_503_and_not_ready(guard_factory, fake_vllm):
    guard = await guard_factory()
    fake_vllm.metrics_up = False
    await until(lambda: not guard.guard.engine_up, "the guard's engine monitor to see vLLM down")
    async with aiohttp.ClientSession() as s:
        async with s.get(guard.url + "/readyz") as r:
            assert r.status == 503 and "engine down" in (await r.json())["reasons"][0]
        forwarded = len(fake_vllm.seen_bodies)
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 503 and "Retry-After" in r.headers
            assert (await r.json())["error"]["code"] == "engine_down"
        # Fast: refused at the door, neither queued nor sent on to wait for vLLM (no clock raced).
        admission = guard.guard.admission
        assert len(fake_vllm.seen_bodies) == forwarded
        assert admission.scheduler.running == 0 and len(admission.queue) == 0
        fake_vllm.metrics_up = True
        await guard.wait_ready(2)
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 200


async def test_a_client_disconnect_cancels_the_vllm_request(guard_factory, fake_vllm):
    fake_vllm.token_delay = 0.05                 # a slow stream: still running when the client leaves
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        r = await s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True})
        await r.content.readuntil(b"\n\n")       # first token arrived
        r.close()                                # the client goes away
        await until(lambda: fake_vllm.disconnects and guard.guard.drain.active == 0,
                    "vLLM's request cancelled and the guard's handler finished")
        text = await metrics(s, guard)
    assert fake_vllm.disconnects == 1 and fake_vllm.completed == 0
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "cancelled"}) == 1
    assert sample(text, "gpufleet_guard_in_flight") == 0
    assert guard.guard.admission.ledger.reserved_blocks == 0


async def test_in_flight_answering_counts_the_streams_whose_first_token_went_out(guard_factory, fake_vllm):
    # What a fault injected into vLLM now cuts mid-answer (the real-node kill test waits for one).
    fake_vllm.hold_after_first = asyncio.Event()
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        begun = await s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
        await begun.content.readuntil(b"\n\n")           # its first token reached the client
        fake_vllm.hold = asyncio.Event()                  # the next one waits before its first token
        waiting = asyncio.create_task(s.post(guard.url + "/v1/completions",
                                             json={"prompt": "x", "max_tokens": 5, "stream": True}))
        await until(lambda: fake_vllm.running == 2, "both streams at vLLM")
        text = await metrics(s, guard)
        assert sample(text, "gpufleet_guard_in_flight") == 2
        assert sample(text, "gpufleet_guard_in_flight_answering") == 1
        fake_vllm.hold.set()
        fake_vllm.hold_after_first.set()
        assert (await begun.text()).endswith("data: [DONE]\n\n")
        second = await waiting
        assert (await second.text()).endswith("data: [DONE]\n\n")
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_in_flight") == 0
    assert sample(text, "gpufleet_guard_in_flight_answering") == 0


async def test_a_request_past_its_timeout_gets_504_and_vllm_stops_working_on_it(guard_factory, fake_vllm):
    fake_vllm.token_delay = 0.1                  # 50 tokens take 5 s: past the 0.3 s timeout
    guard = await guard_factory(requestTimeoutSeconds=0.3)
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50}) as r:
            assert r.status == 504
            assert "requestTimeoutSeconds" in (await r.json())["error"]["message"]
        async with s.post(guard.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
            assert r.status == 200
            events = (await r.text()).strip().split("\n\n")
        await until(lambda: fake_vllm.disconnects == 2, "vLLM to see both timed-out requests go")
        text = await metrics(s, guard)
    assert json.loads(events[-1][len("data: "):])["error"]["type"] == "timeout"
    assert fake_vllm.disconnects == 2 and fake_vllm.completed == 0
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "timeout"}) == 2


async def test_drain_refuses_new_requests_and_lets_in_flight_ones_finish(guard_factory, fake_vllm):
    fake_vllm.hold = asyncio.Event()             # the streams stay in flight until released
    guard = await guard_factory()
    guard.guard.drain.accept_seconds = 0         # no endpoint grace: refusing at once
    async with aiohttp.ClientSession() as s:
        async def long_stream():
            async with s.post(guard.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 40, "stream": True}) as r:
                return r.status, await r.text()

        in_flight = [asyncio.create_task(long_stream()) for _ in range(3)]
        await until(lambda: fake_vllm.running == 3, "the three streams to reach vLLM")
        drained = asyncio.create_task(guard.drain(timeout=10))
        await until(lambda: guard.guard.drain.draining, "the guard to start draining")
        async with s.get(guard.url + "/readyz") as r:
            assert r.status == 503 and (await r.json())["reasons"] == ["draining"]
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
        assert not drained.done(), "the drain ended with requests in flight"
        fake_vllm.hold.set()
        results = await asyncio.gather(*in_flight)
        assert await drained is True
    for status, text in results:
        assert status == 200 and text.count("data: ") == 41 and text.endswith("data: [DONE]\n\n")


async def test_a_draining_guard_admits_through_the_endpoint_grace_and_closes_connections(guard_factory, fake_vllm):
    # kube-proxy and clients' pooled connections keep sending here for a few seconds after
    # SIGTERM: those requests are served (on a closing connection), not failed.
    guard = await guard_factory()
    guard.guard.drain.accept_seconds = 0.6
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200 and r.headers.get("Connection", "").lower() != "close"
        drained = asyncio.create_task(guard.drain(timeout=10))
        await until(lambda: guard.guard.drain.draining, "the guard to start draining")
        async with s.get(guard.url + "/readyz") as r:
            assert r.status == 503
        for stream in (False, True):
            async with s.post(guard.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 2, "stream": stream}) as r:
                assert r.status == 200 and r.headers["Connection"].lower() == "close"
                await r.read()
        assert not drained.done(), "the drain ended inside the endpoint grace"
        await until(lambda: guard.guard.drain.refusing, "the endpoint grace to pass")
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
        assert await drained is True


async def test_interactive_requests_overtake_queued_background_ones(guard_factory, fake_vllm):
    fake_vllm.hold = asyncio.Event()             # the first request holds the only slot meanwhile
    guard = await guard_factory(maxConcurrency=1, defaultClassByRoute={"/v1/completions": "interactive"})
    async with aiohttp.ClientSession() as s:
        async def send(name: str, cls: str):
            async with s.post(guard.url + "/v1/completions", headers={"x-gpufleet-class": cls},
                              json={"prompt": name, "max_tokens": 5}) as r:
                assert r.status == 200

        blocker = asyncio.create_task(send("first", "standard"))
        await until(lambda: guard.guard.admission.scheduler.running == 1, "the first request dispatched")
        background = [asyncio.create_task(send(f"bg{i}", "background")) for i in range(3)]
        await until(lambda: guard.guard.admission.queue.depth("background") == 3, "three background requests queued")
        interactive = asyncio.create_task(send("int", "interactive"))
        await until(lambda: guard.guard.admission.queue.depth("interactive") == 1, "the interactive request queued")
        fake_vllm.hold.set()
        await asyncio.gather(blocker, *background, interactive)
    # The order vLLM was given them: one slot, so also the order they were served in.
    order = [b["prompt"] for b in fake_vllm.seen_bodies]
    assert order[:2] == ["first", "int"] and sorted(order[2:]) == ["bg0", "bg1", "bg2"], order


async def test_an_unknown_class_is_a_400_listing_the_classes(guard_factory):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", headers={"x-gpufleet-class": "vip"},
                          json={"prompt": "x"}) as r:
            assert r.status == 400
            assert "use one of: interactive, standard, background" in (await r.json())["error"]["message"]


async def test_a_client_header_can_lower_its_priority_but_not_raise_it(guard_factory, fake_vllm):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        async def status(route: str, cls: str) -> tuple[int, str]:
            async with s.post(guard.url + route, headers={"x-gpufleet-class": cls},
                              json={"prompt": cls, "messages": [{"role": "user", "content": "x"}]}) as r:
                return r.status, await r.text()

        code, text = await status("/v1/completions", "interactive")   # completions default to standard
        assert code == 403 and "use one of: standard, background" in json.loads(text)["error"]["message"]
        assert (await status("/v1/completions", "background"))[0] == 200
        assert (await status("/v1/completions", "standard"))[0] == 200
        assert (await status("/v1/chat/completions", "interactive"))[0] == 200
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "standard", "outcome": "invalid"}) == 1
    assert len(fake_vllm.seen_bodies) == 3                     # the refused one never reached vLLM


async def test_a_route_default_or_a_trusted_gateway_header_allows_higher_classes(guard_factory, fake_vllm):
    per_route = await guard_factory(defaultClassByRoute={"/v1/completions": "interactive"})
    trusted = await guard_factory(classHeaderPolicy="Trusted")
    async with aiohttp.ClientSession() as s:
        for guard in (per_route, trusted):
            async with s.post(guard.url + "/v1/completions", headers={"x-gpufleet-class": "interactive"},
                              json={"prompt": "x", "max_tokens": 5}) as r:
                assert r.status == 200, await r.text()


async def test_vllm_errors_pass_through_and_count_as_invalid(guard_factory, fake_vllm):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/chat/completions",
                          json={"model": "fail-400", "messages": [{"role": "user", "content": "x"}],
                                "max_tokens": 1}) as r:
            assert r.status == 400 and (await r.json())["error"]["message"] == "bad"
        async with s.get(guard.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "m"
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "interactive", "outcome": "invalid"}) == 1


async def test_the_exported_metrics_are_exactly_the_catalogued_guard_metrics(guard_factory):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        text = await metrics(s, guard)
    # prometheus_client adds a *_created gauge beside each counter and histogram.
    exported = {(n, t) for n, t in re.findall(r"^# TYPE (gpufleet_guard_\w+) (\w+)", text, re.M)
                if not n.endswith("_created")}
    catalogued = set(re.findall(r"^\| (gpufleet_guard_\w+) \| (\w+) \|", METRICS_DOC.read_text(), re.M))
    assert exported == catalogued


async def test_audit_without_gpu_memory_reports_kv_and_says_what_is_missing(guard_factory, monkeypatch):
    monkeypatch.delenv("GPUFLEET_GPU_MEMORY_DIR", raising=False)
    issuer = Issuer()
    guard = await guard_factory(controlAuth=issuer.control_auth())
    async with aiohttp.ClientSession() as s:
        async with s.get(guard.url + "/audit", headers=issuer.bearer()) as r:
            report = await r.json()
    assert report["kv"]["totalBlocks"] == 64 and report["kv"]["watermarkBlocks"] == 10
    assert report["fragmentationRatio"] is None
    assert report["unavailable"] == ["device: GPU memory reporting is off: GPUFLEET_GPU_MEMORY_DIR is not set "
                                     "in the guard's environment"]


async def test_prestop_drain_wait_returns_once_in_flight_requests_are_done(guard_factory, fake_vllm, tmp_path):
    from gpufleet_engine.launch.entrypoint import drain_and_wait

    fake_vllm.token_delay = 0.02
    guard = await guard_factory(adminSocket=str(tmp_path / "guard.sock"))  # the preStop hook's way in
    guard.guard.drain.accept_seconds = 0.3
    cfg = guard.config
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 25, "stream": True}) as r:
            await r.content.readuntil(b"\n\n")
            waiting = asyncio.create_task(asyncio.to_thread(drain_and_wait, cfg, 0.05))
            body = await r.read()
        said = await waiting
        async with s.get(guard.url + "/readyz") as ready:
            assert ready.status == 503
    assert said == "drained: no requests left"
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_full_pool_answers_429_without_reading_the_request(guard_factory, fake_vllm):
    fake_vllm.usage = 55 / 64                    # 9 free < the 10-block watermark: nothing fits
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", data=b"not even json") as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert "needs at least one block" in (await r.json())["error"]["message"]


def test_the_documented_outcomes_and_reasons_are_the_ones_the_guard_uses():
    from gpufleet_engine.serving.prometheus import OUTCOMES, REASONS

    doc = METRICS_DOC.read_text()
    outcomes = re.search(r"^\| gpufleet_guard_requests_total .*outcome = (.*) \|$", doc, re.M).group(1)
    reasons = re.search(r"^\| gpufleet_guard_rejections_total .*reason = (.*) \|$", doc, re.M).group(1)
    assert [o.split(" (")[0] for o in outcomes.split(", ")] == list(OUTCOMES)
    assert reasons.split(", ") == list(REASONS)


def test_retry_hints_are_spread_so_refused_clients_do_not_return_in_a_herd():
    from gpufleet_engine.serving.errors import error_response

    hints = [int(error_response(429, "kv_watermark", "m", 1.0).headers["retry-after-ms"]) for _ in range(200)]
    assert min(hints) >= 500 and max(hints) <= 1500
    assert max(hints) - min(hints) > 500       # spread over the window, not one value
    assert {error_response(429, "x", "m", 1.0).headers["Retry-After"] for _ in range(20)} == {"1"}
