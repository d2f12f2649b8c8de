"""Tenants at the router (docs/tenants.md) against in-process guards: a caller without a valid key gets
401 and reaches no guard; a tenant's request reaches the guard with its tenant and weight and without its
key; a tenant over a limit gets 429 with a Retry-After after which it is served; each admission is settled
once with the tokens the client was told (streamed, JSON, cancelled, retried, resumed), and the usage
counters say the same; a rotated key, a Trusted gateway's tenant, a bad declaration and a namespace
without tenants behave as the page says."""
from __future__ import annotations

import asyncio
import base64
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet_api import API_VERSION
from gpufleet_api.tenants import keys, usage
from gpufleet_api.tenants.declaration import FAIRNESS_ID_HEADERS
from gpufleet_kit.backoff import Backoff
from gpufleet_kit.kube.errors import error_for
from gpufleet_router import discovery
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy import tenancy
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session
from tests.support.fake_kube import FakeKube
from tests.support.waiting import wait_for
from tests.unit.router.test_discovery import engine_pod, isvc
from tests.unit.router.test_resume_relay import PROMPT, WORDS, FakeEngine, text_of

MODEL = "tiny"
NS = "ml"


def key(n: int) -> str:
    return keys.new_key(bytes([n]) * keys.KEY_BYTES)


def key_secret(name: str, *presented: str, namespace: str = NS, labelled: bool = True) -> dict:
    records = "# the tenant's keys\n" + "\n".join(keys.record(k, bytes([i + 1]) * keys.SALT_BYTES)
                                                   for i, k in enumerate(presented))
    meta: dict = {"name": name, "namespace": namespace}
    if labelled:
        meta["labels"] = {usage.KEYS_SECRET_LABEL: "true"}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
            "data": {"keys": base64.b64encode(records.encode()).decode()}}


def declaration(spec: dict, name: str = usage.TENANTS_NAME, namespace: str = NS) -> dict:
    return {"apiVersion": API_VERSION, "kind": usage.TENANTS_KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": spec}


def keyed(*tenants: dict) -> dict:
    return {"identity": "Keys", "tenants": [{"keys": {"name": f"{t['name']}-keys", "key": "keys"}, **t}
                                            for t in tenants]}


SEARCH, BATCH = key(1), key(2)
SECRETS = [key_secret("search-keys", SEARCH), key_secret("batch-keys", BATCH)]


def bearer(k: str) -> dict:
    return {"Authorization": f"Bearer {k}"}


class Engine(FakeEngine):
    """The relay's deterministic engine (WORDS, continued from the prompt), that also answers JSON with
    usage (``cached`` prompt tokens from its prefix cache), refuses with a guard's code, and keeps the
    headers it got."""

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)
        self.headers: list[dict[str, str]] = []
        self.cached = 0
        self.refuse_code = "kv_watermark"

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        if self.refuse:
            self.refuse -= 1
            self.bodies.append(body)
            return web.json_response({"error": {"message": "full", "type": "rate_limit_error", "param": None,
                                                "code": self.refuse_code}}, status=429, headers={"Retry-After": "0"})
        if body.get("stream"):
            return await super().complete(request)
        self.bodies.append(body)
        prompt = len(body["prompt"].split())
        words = WORDS[:body.get("max_tokens") or 100]
        return web.json_response({
            "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "text": "".join(words), "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": len(words), "total_tokens": prompt + len(words),
                      "prompt_tokens_details": {"cached_tokens": self.cached}}})


class Rig:
    def __init__(self, engines: list[Engine], settings: RouterSettings):
        self.engines = {e.name: e for e in engines}
        self.now = 1000.0
        self.metrics = RouterMetrics()
        self.fleet = Fleet(settings, self.metrics, clock=lambda: self.now)
        self.http = client_session(settings)
        self.server = TestServer(Router(self.fleet, self.http).app(), host="127.0.0.1")
        self.client = aiohttp.ClientSession()
        self.finished: list[tuple[str, int]] = []   # (tenant, real tokens) of every Limiter.finish

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> Rig:
        await self.server.start_server()
        replicas = tuple(Replica(e.name, e.address, revision="r1") for e in self.engines.values())
        self.fleet.update(Table({MODEL: Route(NS, "svc", MODEL, 16, 1, len(replicas), replicas)}))
        await self.fleet.read_once(self.http)
        return self

    def tenants(self, spec: dict | None, secrets: list[dict] = SECRETS) -> None:
        self.fleet.update_tenants([declaration(spec)] if spec is not None else [], secrets)
        found = self.fleet.tenancies.get(NS)
        if isinstance(found, tenancy.Tenancy):
            limiter, finish = found.limiter, found.limiter.finish
            if getattr(finish, "spied", False):
                return

            def spy(ticket, real_tokens, now):
                if not ticket.finished:
                    self.finished.append((ticket.tenant, real_tokens))
                finish(ticket, real_tokens, now)
            spy.spied = True   # type: ignore[attr-defined]
            limiter.finish = spy   # type: ignore[method-assign]

    def post(self, payload: dict, headers: dict | None = None):
        return self.client.post(self.url + "/v1/completions", json=payload, headers=headers or {})

    def count(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def usage(self, name: str, tenant: str) -> float:
        return self.count(name, namespace=NS, service="svc", model=MODEL, tenant=tenant)

    async def close(self) -> None:
        await self.client.close()
        await self.http.close()
        await self.server.close()
        for e in self.engines.values():
            assert e.server is not None
            await e.server.close()


@pytest.fixture
async def rig_of():
    rigs: list[Rig] = []

    async def make(*engines: Engine, spec: dict | None = None) -> Rig:
        started = [await e.start() for e in engines]
        rig = await Rig(started, RouterSettings(prefix_blocks=0)).start()
        rig.tenants(spec)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.close()


def completion(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, **extra}


@pytest.mark.parametrize("headers, reason", [
    ({}, usage.KEY_MISSING),
    ({"Authorization": f"Basic {SEARCH}"}, usage.KEY_MALFORMED),
    ({"Authorization": "Bearer " + "x" * (keys.MAX_KEY_LENGTH + 1)}, usage.KEY_MALFORMED),
    (bearer(key(9)), usage.KEY_UNKNOWN),
])
async def test_a_caller_without_a_valid_key_gets_401_and_reaches_no_guard(rig_of, headers, reason):
    rig = await rig_of(Engine("a"), spec=keyed({"name": "search"}))
    async with rig.post(completion(), headers) as r:
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        error = (await r.json())["error"]
    assert error["code"] == reason and error["type"] == "authentication_error"
    assert error["message"] == keys.MESSAGES[reason.removeprefix("key_")]   # type: ignore[index]
    assert SEARCH not in json.dumps(error)
    assert rig.engines["a"].bodies == []
    assert rig.count(usage.REFUSALS + "", namespace=NS, service="svc", model=MODEL, tenant="unknown",
                     reason=reason) == 1
    assert rig.usage(usage.REQUESTS, "unknown") == 0


async def test_a_tenants_request_reaches_the_guard_with_its_tenant_and_weight_and_never_its_key(rig_of):
    rig = await rig_of(Engine("a"), spec=keyed({"name": "search", "weight": 3}, {"name": "batch"}))
    sent = {**bearer(SEARCH), usage.GUARD_TENANT_HEADER: "batch", usage.GUARD_WEIGHT_HEADER: "1000"}
    async with rig.post(completion(), sent) as r:
        assert r.status == 200
        await r.read()
    got = rig.engines["a"].headers[0]
    assert got[usage.GUARD_TENANT_HEADER] == "search" and got[usage.GUARD_WEIGHT_HEADER] == "3"
    assert "authorization" not in got and SEARCH not in json.dumps(got)
    async with rig.post(completion(), bearer(BATCH)) as r:
        assert r.status == 200
        await r.read()
    assert rig.engines["a"].headers[1][usage.GUARD_TENANT_HEADER] == "batch"
    assert rig.engines["a"].headers[1][usage.GUARD_WEIGHT_HEADER] == "1"
    assert rig.usage(usage.REQUESTS, "search") == 1 and rig.usage(usage.REQUESTS, "batch") == 1


async def test_a_namespace_without_tenants_drops_the_tenant_headers_a_client_sends(rig_of):
    rig = await rig_of(Engine("a"))
    sent = {"Authorization": "Bearer anything", usage.GUARD_TENANT_HEADER: "vip", usage.GUARD_WEIGHT_HEADER: "1000"}
    async with rig.post(completion(), sent) as r:
        assert r.status == 200
        await r.read()
    got = rig.engines["a"].headers[0]
    assert usage.GUARD_TENANT_HEADER not in got and usage.GUARD_WEIGHT_HEADER not in got
    assert got["authorization"] == "Bearer anything"   # served as before tenants: the key is vLLM's business
    assert rig.usage(usage.REQUESTS, "unknown") == 1


async def test_trusted_takes_the_gateways_tenant_and_with_as_tenant_the_fairness_id(rig_of):
    spec = {"identity": "Trusted", "trusted": {"tenantHeader": "x-team", "fairnessId": "AsTenant"},
            "tenants": [{"name": "search", "weight": 2}, {"name": "batch"}]}
    rig = await rig_of(Engine("a"), spec=spec)
    for headers, tenant in [({"X-Team": "search"}, "search"), ({FAIRNESS_ID_HEADERS[0]: "batch"}, "batch"),
                            ({FAIRNESS_ID_HEADERS[1]: "search"}, "search")]:
        async with rig.post(completion(), headers) as r:
            assert r.status == 200
            await r.read()
        got = rig.engines["a"].headers[-1]
        assert got[usage.GUARD_TENANT_HEADER] == tenant and "x-team" not in got
    for headers, reason in [({}, usage.KEY_MISSING), ({"X-Team": "someone-else"}, usage.KEY_UNKNOWN)]:
        async with rig.post(completion(), headers) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == reason
    assert len(rig.engines["a"].bodies) == 3
    rig.tenants({**spec, "trusted": {"tenantHeader": "x-team"}})   # fairnessId Ignore: the id names no tenant
    async with rig.post(completion(), {FAIRNESS_ID_HEADERS[0]: "batch"}) as r:
        assert r.status == 401


async def test_over_its_tokens_per_minute_a_tenant_gets_429_and_is_served_after_the_retry_after(rig_of):
    # 30 tokens a minute: half a token a second. The first request's estimate (2 prompt + 20) fits the full
    # bucket, and its real use (1 prompt + 10 answer) is what stays charged.
    rig = await rig_of(Engine("a"), spec=keyed({"name": "search", "limits": {"tokensPerMinute": 30}}))
    async with rig.post(completion(20), bearer(SEARCH)) as r:
        assert r.status == 200
        await r.read()
    assert rig.finished == [("search", 11)]
    async with rig.post(completion(20), bearer(SEARCH)) as r:
        assert r.status == 429
        retry_after = int(r.headers["Retry-After"])
        error = (await r.json())["error"]
    assert retry_after == 6   # 22 wanted, 19 left, 0.5 a second
    assert error["code"] == usage.TOKEN_LIMIT and error["type"] == "rate_limit_error"
    assert len(rig.engines["a"].bodies) == 1
    assert rig.count(usage.REFUSALS, namespace=NS, service="svc", model=MODEL, tenant="search",
                     reason=usage.TOKEN_LIMIT) == 1
    assert rig.count(usage.LIMIT_USED, namespace=NS, tenant="search", limit=usage.TOKEN_LIMIT) == \
        pytest.approx(11 / 30)
    rig.now += retry_after - 1
    async with rig.post(completion(20), bearer(SEARCH)) as r:
        assert r.status == 429
    rig.now += 1
    async with rig.post(completion(20), bearer(SEARCH)) as r:
        assert r.status == 200
        await r.read()


async def test_at_its_concurrency_limit_a_tenant_waits_for_its_own_requests_not_others(rig_of):
    engine = Engine("a")
    engine.hold_end = asyncio.Event()
    rig = await rig_of(engine, spec=keyed({"name": "search", "limits": {"concurrentRequests": 1}}, {"name": "batch"}))
    first = await rig.post(completion(stream=True), bearer(SEARCH))
    assert first.status == 200
    await first.content.readuntil(b"data: [DONE]\n\n")
    async with rig.post(completion(stream=True), bearer(SEARCH)) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == usage.CONCURRENCY_LIMIT
    engine.hold_end.set()   # batch's answer (and the first) end at once
    async with rig.post(completion(stream=True), bearer(BATCH)) as r:
        assert r.status == 200
        await r.read()
    await first.read()
    first.release()
    limiter = rig.fleet.tenancies[NS].limiter   # type: ignore[union-attr]
    await wait_for(lambda: limiter.in_flight("search") == 0, timeout=10, interval=0.01, what="the first settled")
    async with rig.post(completion(stream=True), bearer(SEARCH)) as r:
        assert r.status == 200
        await r.read()


def client_usage(events: list) -> dict:
    return next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))


def events_of(raw: bytes) -> list:
    return ["[DONE]" if p == b"data: [DONE]" else json.loads(p.removeprefix(b"data: "))
            for p in raw.split(b"\n\n") if p]


async def test_a_json_answer_is_settled_once_with_its_usage_and_counted_as_the_client_was_told(rig_of):
    engine = Engine("a")
    engine.cached = 1
    rig = await rig_of(engine, spec=keyed({"name": "search"}))
    async with rig.post(completion(6), bearer(SEARCH)) as r:
        told = (await r.json())["usage"]
    assert told == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7,
                    "prompt_tokens_details": {"cached_tokens": 1}}
    assert rig.finished == [("search", 7)]
    assert rig.usage(usage.PROMPT_TOKENS, "search") == told["prompt_tokens"]
    assert rig.usage(usage.CACHED_PROMPT_TOKENS, "search") == 1
    assert rig.usage(usage.ANSWER_TOKENS, "search") == told["completion_tokens"]


async def test_a_stream_is_settled_once_with_its_usage_and_counted_as_the_client_was_told(rig_of):
    rig = await rig_of(Engine("a"), spec=keyed({"name": "search"}))
    async with rig.post(completion(8, stream=True, stream_options={"include_usage": True}), bearer(SEARCH)) as r:
        told = client_usage(events_of(await r.read()))
    assert told["completion_tokens"] == 8
    assert rig.finished == [("search", told["total_tokens"])]
    assert rig.usage(usage.PROMPT_TOKENS, "search") == told["prompt_tokens"]
    assert rig.usage(usage.ANSWER_TOKENS, "search") == told["completion_tokens"]
    # A stream whose client asked for no usage is counted all the same (the router asks upstream).
    async with rig.post(completion(3, stream=True), bearer(SEARCH)) as r:
        assert not any(isinstance(e, dict) and e.get("usage") for e in events_of(await r.read()))
    assert rig.finished[1] == ("search", told["prompt_tokens"] + 3)


async def test_a_resumed_stream_is_one_request_charged_once_with_every_token_the_client_got(rig_of):
    rig = await rig_of(Engine("a", die_after=3), Engine("b", free=10), spec=keyed({"name": "search"}))
    async with rig.post(completion(8, stream=True, stream_options={"include_usage": True}), bearer(SEARCH)) as r:
        events = events_of(await r.read())
    assert text_of(events) == "".join(WORDS[:8])
    told = client_usage(events)
    assert told["completion_tokens"] == 8
    assert rig.finished == [("search", told["total_tokens"])]
    assert rig.usage(usage.REQUESTS, "search") == 1
    assert rig.usage(usage.ANSWER_TOKENS, "search") == 8
    assert [h[usage.GUARD_TENANT_HEADER] for e in rig.engines.values() for h in e.headers] == ["search", "search"]
    assert rig.count("gpufleet_router_resumed_streams_total", service="svc", outcome="resumed") == 1


async def test_a_request_retried_on_another_replica_is_charged_once_and_keeps_its_tenant(rig_of):
    a, b = Engine("a", free=90), Engine("b", free=10)
    a.refuse = 1
    rig = await rig_of(a, b, spec=keyed({"name": "search"}))
    async with rig.post(completion(4), bearer(SEARCH)) as r:
        assert r.status == 200 and (await r.json())["usage"]["total_tokens"] == 5
    assert rig.finished == [("search", 5)]
    assert [h[usage.GUARD_TENANT_HEADER] for h in a.headers + b.headers] == ["search", "search"]
    assert rig.usage(usage.REQUESTS, "search") == 1


async def test_a_refusal_of_every_guard_is_counted_under_the_guards_reason_and_charges_nothing(rig_of):
    a, b = Engine("a"), Engine("b")
    a.refuse = b.refuse = 1
    a.refuse_code = b.refuse_code = "queue_full"
    rig = await rig_of(a, b, spec=keyed({"name": "search", "limits": {"tokensPerMinute": 60}}))
    async with rig.post(completion(4), bearer(SEARCH)) as r:
        assert r.status == 429 and (await r.json())["error"]["code"] == "queue_full"
    assert rig.finished == [("search", 0)]
    assert rig.count(usage.REFUSALS, namespace=NS, service="svc", model=MODEL, tenant="search",
                     reason="queue_full") == 1
    assert rig.count(usage.LIMIT_USED, namespace=NS, tenant="search", limit=usage.TOKEN_LIMIT) == 0


async def test_a_client_that_leaves_is_settled_once_with_the_tokens_it_was_sent(rig_of):
    engine = Engine("a")
    engine.hold_end = asyncio.Event()
    rig = await rig_of(engine, spec=keyed({"name": "search"}))
    r = await rig.post(completion(5, stream=True), bearer(SEARCH))
    await r.content.readuntil(b"data: [DONE]\n\n")
    r.close()
    await wait_for(lambda: rig.count("gpufleet_router_requests_total", model=MODEL, outcome="cancelled"),
                   timeout=10, interval=0.01, what="the handler unwound")
    engine.hold_end.set()
    assert rig.finished == [("search", 1 + 5)]
    assert rig.fleet.tenancies[NS].limiter.in_flight("search") == 0   # type: ignore[union-attr]


async def test_a_bad_declaration_keeps_the_last_good_one_and_with_none_the_namespace_is_refused(rig_of, caplog):
    rig = await rig_of(Engine("a"))
    caplog.set_level(logging.WARNING, "gpufleet_router")
    rig.tenants(keyed({"name": "search", "limits": {"tokenPerMinute": 5}}))   # misspelt: never "no limit"
    async with rig.post(completion(), bearer(SEARCH)) as r:
        assert r.status == 503
        error = (await r.json())["error"]
    assert error["code"] == "tenants_invalid" and "tokenPerMinute" in error["message"]
    assert f"kubectl -n {NS} edit inferencetenants tenants" in error["message"]
    assert rig.engines["a"].bodies == []

    rig.tenants(keyed({"name": "search", "limits": {"tokensPerMinute": 30}}))
    async with rig.post(completion(20), bearer(SEARCH)) as r:
        assert r.status == 200
        await r.read()
    rig.tenants(keyed({"name": "search", "weight": 0}))
    assert any("its last valid declaration is still enforced" in m for m in caplog.messages)
    async with rig.post(completion(20), bearer(SEARCH)) as r:   # the budget it had is kept: 19 < 22
        assert r.status == 429
    async with rig.post(completion(), bearer(BATCH)) as r:
        assert r.status == 401

    rig.tenants(None)   # the declaration deleted: the namespace is served without tenants
    async with rig.post(completion()) as r:
        assert r.status == 200
        await r.read()


async def test_a_missing_secret_leaves_only_its_tenant_without_keys_and_is_said_once(rig_of, caplog):
    caplog.set_level(logging.WARNING, "gpufleet_router")
    rig = await rig_of(Engine("a"))
    spec = keyed({"name": "search"}, {"name": "batch"})
    rig.tenants(spec, [SECRETS[0], key_secret("batch-keys", BATCH, labelled=False)])
    rig.tenants(spec, [SECRETS[0]])
    assert sum("tenant 'batch' has no valid key" in m for m in caplog.messages) == 1
    async with rig.post(completion(), bearer(BATCH)) as r:
        assert r.status == 401
    async with rig.post(completion(), bearer(SEARCH)) as r:
        assert r.status == 200
        await r.read()


async def test_only_the_declaration_named_tenants_counts(rig_of, caplog):
    caplog.set_level(logging.WARNING, "gpufleet_router")
    rig = await rig_of(Engine("a"))
    rig.fleet.update_tenants([declaration(keyed({"name": "search"}), name="extra")], SECRETS)
    assert NS not in rig.fleet.tenancies
    assert any("only the InferenceTenants named 'tenants'" in m for m in caplog.messages)


async def test_the_usage_of_a_tenant_no_longer_declared_is_forgotten(rig_of):
    rig = await rig_of(Engine("a"), spec=keyed({"name": "search"},
                                                {"name": "batch", "limits": {"requestsPerSecond": 5}}))
    for k in (SEARCH, BATCH):
        async with rig.post(completion(), bearer(k)) as r:
            await r.read()
    assert rig.usage(usage.REQUESTS, "batch") == 1
    assert rig.count(usage.LIMIT_USED, namespace=NS, tenant="batch", limit=usage.RATE_LIMIT) == pytest.approx(0.2)
    rig.tenants(keyed({"name": "search"}))
    assert rig.usage(usage.REQUESTS, "batch") == 0 and rig.usage(usage.REQUESTS, "search") == 1
    assert rig.count(usage.LIMIT_USED, namespace=NS, tenant="batch", limit=usage.RATE_LIMIT) == 0


async def test_a_rotated_key_takes_effect_from_the_watch_without_a_restart():
    """The informers at work: the declaration and the labelled Secret from the (fake) API server, then the
    Secret changed there: the new key is served and the old one refused, with no restart."""
    engine = await Engine("a").start()
    assert engine.server is not None
    kube = FakeKube()
    kube.put(isvc("tiny"))
    kube.put(engine_pod("tiny", "tiny-0", "127.0.0.1", ready=True))
    kube.put(declaration(keyed({"name": "search"})))
    kube.put(key_secret("search-keys", SEARCH))
    kube.put(key_secret("unrelated", BATCH, labelled=False))
    settings = RouterSettings(prefix_blocks=0, guard_port=engine.server.port)
    fleet = Fleet(settings, RouterMetrics())
    http = client_session(settings)
    server = TestServer(Router(fleet, http).app(), host="127.0.0.1")
    await server.start_server()
    watch = asyncio.create_task(discovery.Watcher(fleet, kube).run())
    client = aiohttp.ClientSession()

    async def status(k: str) -> int:
        async with client.post(f"http://127.0.0.1:{server.port}/v1/completions",
                               json={**completion(), "model": "org/tiny"}, headers=bearer(k)) as r:
            await r.read()
            return r.status
    try:
        await asyncio.wait_for(fleet.listed.wait(), 5)
        await fleet.read_once(http)
        assert await status(SEARCH) == 200 and await status(BATCH) == 401
        kube.put(key_secret("search-keys", BATCH))   # rotated: the new key only
        async def rotated() -> bool:
            return await status(BATCH) == 200
        await wait_for(rotated, timeout=5, interval=0.01, what="the new key served")
        assert await status(BATCH) == 200 and await status(SEARCH) == 401
        assert kube.calls["list", "Secret"] == 1
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await client.close()
        await http.close()
        await server.close()
        await engine.server.close()


async def test_list_mode_reads_the_tenants_too():
    kube = FakeKube()
    kube.put(isvc("tiny"))
    kube.put(declaration(keyed({"name": "search"})))
    kube.put(key_secret("search-keys", SEARCH))
    fleet = Fleet(RouterSettings(discovery=discovery.Discovery.LIST), RouterMetrics())
    await fleet.list_once(kube)
    found = fleet.tenancies[NS]
    assert isinstance(found, tenancy.Tenancy)
    assert found.identify(bearer(SEARCH)).tenant == "search"   # type: ignore[union-attr]


async def test_a_namespace_whose_tenants_were_never_read_is_refused_not_served_anonymously(rig_of):
    """Until the router has listed a namespace's InferenceTenants once (refused, or the API server failing at
    its start), it cannot know whether callers there need a key: 503 with Retry-After, never anonymous."""
    rig = await rig_of(Engine("a"))
    for unread in (frozenset({NS}), frozenset({None})):      # the namespace, or the whole cluster's listing
        rig.fleet.update_tenants([], [], unread)
        async with rig.post(completion()) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["Retry-After"] == "5", body
        assert body["error"]["code"] == usage.TENANTS_UNREAD and "inferencetenants" in body["error"]["message"]
    assert rig.engines["a"].headers == []
    rig.fleet.update_tenants([], [], frozenset({"elsewhere"}))
    async with rig.post(completion()) as r:
        assert r.status == 200


class RefusingKube(FakeKube):
    """Lists of the kinds in ``refused`` fail as the API server refuses them (403), others as FakeKube."""

    def __init__(self, refused: set[str]):
        super().__init__()
        self.refused = refused

    async def list(self, api_version, kind, namespace=None, **kw):
        if kind in self.refused:
            raise error_for(403, {}, f"{kind} is forbidden")
        return await super().list(api_version, kind, namespace, **kw)


async def test_list_mode_refuses_a_namespace_whose_tenants_it_cannot_list_and_reads_them_once_it_can():
    kube = RefusingKube({usage.TENANTS_KIND})
    kube.put(isvc("tiny"))
    kube.put(declaration(keyed({"name": "search"})))
    kube.put(key_secret("search-keys", SEARCH))
    fleet = Fleet(RouterSettings(discovery=discovery.Discovery.LIST, namespaces=(NS,)), RouterMetrics())
    await fleet.list_once(kube)
    assert fleet.tenants_unread == frozenset({NS}) and NS not in fleet.tenancies
    kube.refused = set()
    await fleet.list_once(kube)
    assert fleet.tenants_unread == frozenset() and isinstance(fleet.tenancies[NS], tenancy.Tenancy)
    kube.refused = {usage.TENANTS_KIND}        # read once: a later failure keeps what was listed
    await fleet.list_once(kube)
    assert fleet.tenants_unread == frozenset() and isinstance(fleet.tenancies[NS], tenancy.Tenancy)


async def test_list_mode_without_the_right_to_read_secrets_leaves_keyed_tenants_without_keys():
    """The chart's router.tenants.readKeySecrets off: Trusted declarations work, Keys ones answer 401."""
    kube = RefusingKube({"Secret"})
    kube.put(isvc("tiny"))
    kube.put(declaration(keyed({"name": "search"})))
    fleet = Fleet(RouterSettings(discovery=discovery.Discovery.LIST, namespaces=(NS,)), RouterMetrics())
    await fleet.list_once(kube)
    found = fleet.tenancies[NS]
    assert fleet.tenants_unread == frozenset() and isinstance(found, tenancy.Tenancy)
    assert found.identify(bearer(SEARCH)).reason == "unknown"   # type: ignore[union-attr]


async def test_the_watch_refuses_the_namespaces_until_it_has_listed_their_tenants():
    kube = RefusingKube({usage.TENANTS_KIND})
    kube.put(isvc("tiny"))
    kube.put(declaration(keyed({"name": "search"})))
    kube.put(key_secret("search-keys", SEARCH))
    fleet = Fleet(RouterSettings(prefix_blocks=0), RouterMetrics())
    watch = asyncio.create_task(discovery.Watcher(fleet, kube, backoff=Backoff(first=0.01, cap=0.05)).run())
    try:
        await asyncio.wait_for(fleet.listed.wait(), 5)
        assert fleet.tenants_unread == frozenset({None}), "served anonymously before the tenants were read"
        kube.refused = set()
        await wait_for(lambda: isinstance(fleet.tenancies.get(NS), tenancy.Tenancy), timeout=5, interval=0.01,
                       what="the tenants read once the listing was allowed")
        assert fleet.tenants_unread == frozenset()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
