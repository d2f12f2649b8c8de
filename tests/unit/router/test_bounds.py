"""The router's untrusted input, bounded: a client body nested 100,000 levels deep gets a 400 in OpenAI's
format naming the problem (never a 500); a guard that answers 100 MiB (its /metrics, a refusal, a prefill's
answer) is read to its cap only and reported unreadable; and what the router keeps per model, service or
adapter goes with its route."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet_api.bounded_json import MAX_DEPTH
from gpufleet_kit.http_limits import JSON_REPLY_CAP, METRICS_REPLY_CAP
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import RouterSettings
from tests.support.huge_reply import MIB, HugeReply
from tests.unit.router.test_server import MODEL, Harness, completion, harness  # noqa: F401 (a fixture)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
async def test_a_body_nested_100000_deep_is_a_400_naming_the_problem(harness, route):  # noqa: F811
    for body in (b"[" * 100_000, b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 b'{"model": "tiny", "prompt": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}"):
        async with harness.post(body, route=route) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "json_too_deep"
        assert f"nested deeper than {MAX_DEPTH} levels" in error["message"]
    assert all(not g.bodies for g in harness.guards.values())   # no replica saw them
    assert harness.count("gpufleet_router_requests_total", model="", outcome="invalid") == 3


async def test_a_body_within_the_bound_still_goes_through(harness):  # noqa: F811
    nested = [[[["deep enough"]]]]
    async with harness.post(completion(prompt="hi", logit_bias={}, extra=nested)) as r:
        assert r.status == 200
        await r.read()


class HugeGuard:
    """A guard that answers everything with 100 MiB: /metrics as text, a completion as a 429 or a 502."""

    def __init__(self, status: int):
        self.metrics = HugeReply()
        self.answer = HugeReply(content_type="application/json")
        self.status = status
        self.server: TestServer | None = None

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=self.status, headers={"Content-Type": "application/json",
                                                                "Retry-After": "1"})
        try:
            await resp.prepare(request)
            while self.answer.written < self.answer.size:
                await resp.write(b"x" * (64 << 10))
                self.answer.written += 64 << 10
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp

    async def start(self) -> HugeGuard:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics.serve)
        app.router.add_post("/v1/completions", self.complete)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"


async def test_a_guard_whose_metrics_answer_100_mib_is_unreadable_and_said_so(caplog):
    guard = await HugeGuard(429).start()
    h = Harness([], RouterSettings(reading_timeout=30))
    try:
        h.publish([h.route(Replica("huge-0", guard.address))])
        with caplog.at_level(logging.WARNING, logger="gpufleet_router"):
            await h.fleet.read_once(h.http)
        assert h.fleet.picker(MODEL).readings.get("huge-0") is None
        assert h.count("gpufleet_router_readings_failed_total", model=MODEL) == 1
        message = " ".join(r.getMessage() for r in caplog.records)
        assert "huge-0" in message and "unreadable" in message and str(METRICS_REPLY_CAP) in message
        assert guard.metrics.written < 2 * METRICS_REPLY_CAP + 16 * MIB
    finally:
        await h.http.close()
        await guard.server.close()


@pytest.mark.parametrize("status", [429, 502])
async def test_a_refusal_of_100_mib_is_not_read_whole(status):
    """A guard's 429 (or 502) is read whole to decide on a retry: capped, the replica is one to avoid and
    the client gets the router's 502 naming it, not 100 MiB passed on."""
    guard = await HugeGuard(status).start()
    h = Harness([], RouterSettings(unreachable_retry_timeout=0.1))
    await h.server.start_server()
    try:
        h.publish([h.route(Replica("huge-0", guard.address))])
        h.fleet.picker(MODEL).observe("huge-0", None)
        async with h.post(completion()) as r:
            body = await r.read()
        assert r.status == 502 and len(body) < 64 << 10
        error = json.loads(body)["error"]
        assert "huge-0" in error["message"] and str(JSON_REPLY_CAP) in error["message"]
        assert guard.answer.written < 2 * JSON_REPLY_CAP + 16 * MIB
    finally:
        await h.client.close()
        await h.http.close()
        await h.server.close()
        await guard.server.close()


def route(model: str, namespace: str = "ml") -> Route:
    return Route(namespace=namespace, service=model, model=model, block_size=16, min_replicas=1, max_replicas=2,
                 replicas=(Replica(f"{model}-0", "127.0.0.1:1"),))


def per_model_state(h: Harness) -> dict[str, set[str]]:
    """Every model, service or adapter the router keeps something for."""
    f, m = h.fleet, h.metrics
    labelled = {}
    for name, metric in vars(m).items():
        if hasattr(metric, "collect"):
            values = set()
            for family in metric.collect():
                for sample in family.samples:
                    values |= {v for k, v in sample.labels.items() if k in ("model", "service")}
            labelled[name] = values - {""}
    return {"pickers": {model for model, _ in f.pickers}, "held": set(f.held), "cold_since": set(f.cold_since),
            "cold_starts": set(f.cold_starts), **labelled}


async def test_per_model_state_goes_with_the_models_route():
    h = Harness([], RouterSettings(hold_timeout=0.01))
    try:
        def touch(model: str) -> None:
            """What a request for ``model`` leaves behind: each per-model metric, a cold start, a hold."""
            m = h.metrics
            m.requests.labels(model, "ok").inc()
            m.picks.labels(model, "unified", "kv_free").inc()
            m.prefix_affinity_hits.labels(model).inc()
            m.prefix_keyed.labels(model).inc()
            m.retries.labels(model, "unified", "rejected").inc()
            m.request_seconds.labels(model).observe(0.1)
            m.prefill_seconds.labels(model).observe(0.1)
            m.handoffs.labels(model, "none").inc()
            m.prefill_fallbacks.labels(model, "error").inc()
            m.revision_requests.labels(model, "").inc()
            m.readings_failed.labels(model).inc()
            m.adapter_requests.labels(f"{model}-lora").inc()
            m.adapter_not_loaded.labels(f"{model}-lora").inc()
            m.resumed_streams.labels(model, "resumed").inc()
            m.resume_gap_seconds.labels(model).observe(0.1)
            m.held_total.labels("ml", model).inc()
            m.cold_start_seconds.labels("ml", model).observe(1)
            h.fleet.cold(model).record(1.0)

        current = {"kept"}
        h.fleet.update(Table({"kept": route("kept"), "gone": route("gone")}))
        for model in ("kept", "gone"):
            touch(model)
            assert not await h.fleet.hold(model, h.fleet.clock() + 0.01)   # no replica ready: held, timed out
        h.fleet.update(Table({"kept": route("kept")}))
        for i in range(20):   # models come and go
            model = f"m{i}"
            h.fleet.update(Table({"kept": route("kept"), model: route(model)}))
            touch(model)
            assert not await h.fleet.hold(model, h.fleet.clock() + 0.01)
            h.fleet.update(Table({"kept": route("kept")}))
        state = per_model_state(h)
        stray = {name: values - current for name, values in state.items() if values - current}
        assert not stray, stray
        assert state["pickers"] == {"kept"} and state["cold_starts"] == {"kept"}
        assert h.count("gpufleet_router_requests_total", model="kept", outcome="ok") == 1   # kept: untouched
    finally:
        await h.http.close()
