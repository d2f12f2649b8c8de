"""Requests for LoRA adapters through the router's HTTP server, against stand-in
guards: they reach only replicas holding the adapter loaded (retries too), an
adapter loaded nowhere gets 503 adapter_not_loaded, an unknown model vLLM's
404, /v1/models lists adapters under their base model, and the adapters are
listed from the API server's InferenceAdapters."""
from __future__ import annotations

import asyncio

import pytest

from gpufleet_api import API_VERSION, KIND
from gpufleet_api.guard.adapters import ADAPTER_KIND
from gpufleet_kit.kube.errors import Forbidden, NotFound
from gpufleet_router.policy.adapters import Adapter, Catalog
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.server import RouterSettings
from tests.support.waiting import wait_for
from tests.unit.router.test_server import MODEL, FakeGuard, Harness

LORA = "support-lora"
CATALOG = Catalog({LORA: Adapter(LORA, "ml", MODEL, MODEL, "org/support-lora")})


@pytest.fixture
async def fleet():
    """Replicas a, b, c of MODEL; a and c hold LORA loaded, b does not."""
    guards = [await FakeGuard(n).start() for n in ("a", "b", "c")]
    guards[0].adapters = {LORA: "Loaded"}
    guards[1].adapters = {LORA: "Loading"}
    guards[2].adapters = {LORA: "Loaded"}
    h = Harness(guards, RouterSettings(prefix_blocks=4))
    await h.server.start_server()
    h.publish([h.route(*(Replica(g.name, g.address) for g in guards))], CATALOG)
    await h.fleet.read_once(h.http)
    yield h
    await h.client.close()
    await h.http.close()
    await h.server.close()
    for g in guards:
        g.release.set()
        await g.server.close()


def lora(prompt: str = "hello", **extra) -> dict:
    return {"model": LORA, "prompt": prompt, "max_tokens": 8, **extra}


async def test_adapter_requests_reach_only_replicas_holding_it_and_the_body_is_unchanged(fleet):
    fleet.guards["b"].free = 99     # the most room: the base model's choice, never the adapter's
    await fleet.fleet.read_once(fleet.http)
    sent = [lora(f"question {i}") for i in range(8)]
    for payload in sent:
        async with fleet.post(payload) as r:
            assert r.status == 200 and r.headers["X-Replica"] in ("a", "c")
            await r.read()
    received = fleet.guards["a"].bodies + fleet.guards["c"].bodies
    assert sorted(received, key=lambda b: b["prompt"]) == sent and fleet.guards["b"].bodies == []
    async with fleet.post({"model": MODEL, "prompt": "base", "max_tokens": 8}) as r:
        assert r.headers["X-Replica"] == "b"
        await r.read()
    assert fleet.count("gpufleet_router_adapter_requests_total", model=LORA) == 8
    # Under the service's model in the per-model metrics: bounded by the services, not the adapters.
    assert fleet.count("gpufleet_router_requests_total", model=MODEL, outcome="ok") == 9


async def test_a_refusal_is_retried_on_another_holder_never_on_a_replica_without_the_adapter(fleet):
    a, b, c = fleet.guards["a"], fleet.guards["b"], fleet.guards["c"]
    a.free, c.free = 90, 10
    a.refuse_with = (429, 3)
    await fleet.fleet.read_once(fleet.http)
    async with fleet.post(lora()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "c"
        await r.read()
    c.refuse_with = (429, 2)
    async with fleet.post(lora()) as r:   # both holders refuse: the 429 passes on, b never tried
        assert r.status == 429 and r.headers["Retry-After"] == "2"
        await r.read()
    assert b.bodies == [] and len(a.bodies) == 2
    assert fleet.count("gpufleet_router_retries_total", model=MODEL, role="unified", reason="rejected") == 2


async def test_an_adapter_loaded_nowhere_gets_503_with_retry_after(fleet):
    for g in fleet.guards.values():
        g.adapters = {LORA: "Loading"}
    await fleet.fleet.read_once(fleet.http)
    async with fleet.post(lora()) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "5"
        err = (await r.json())["error"]
    assert err["type"] == "adapter_not_loaded" and LORA in err["message"]
    assert not any(g.bodies for g in fleet.guards.values())
    assert fleet.count("gpufleet_router_adapter_not_loaded_total", model=LORA) == 1
    assert fleet.count("gpufleet_router_requests_total", model=MODEL, outcome="unavailable") == 1
    fleet.guards["b"].adapters = {LORA: "Loaded"}   # loaded now: served at the next reading
    await fleet.fleet.read_once(fleet.http)
    async with fleet.post(lora()) as r:
        assert r.status == 200 and r.headers["X-Replica"] == "b"
        await r.read()


async def test_a_request_held_through_a_cold_start_waits_for_its_adapter_to_be_loaded(fleet):
    fleet.settings.reading_interval = 0.05
    a = fleet.guards["a"]
    a.adapters = {}                       # a new replica: nothing loaded yet
    await fleet.fleet.read_once(fleet.http)
    fleet.publish([fleet.route(Replica("a", a.address, serving=False))], CATALOG)
    sent = asyncio.create_task(fleet.post(lora()).__aenter__())
    await wait_for(lambda: fleet.fleet.held_count(MODEL) == 1, timeout=30, interval=0.01, what="held")
    fleet.publish([fleet.route(Replica("a", a.address))], CATALOG)     # ready, the adapter not loaded yet
    await fleet.fleet.read_once(fleet.http)
    await asyncio.sleep(0.2)
    assert not sent.done()
    a.adapters = {LORA: "Loaded"}
    await fleet.fleet.read_once(fleet.http)
    r = await asyncio.wait_for(sent, 10)
    assert r.status == 200 and r.headers["X-Replica"] == "a"
    await r.read()
    r.release()


async def test_an_unknown_model_gets_vllms_404_listing_base_models_and_adapters(fleet):
    async with fleet.post({"model": "gpt-9", "prompt": "x"}) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err == {"message": f"The model `gpt-9` does not exist. Served here: {LORA}, {MODEL}.",
                   "type": "NotFoundError", "param": "model", "code": 404}
    assert fleet.count("gpufleet_router_unknown_model_requests_total") == 1
    assert fleet.count("gpufleet_router_adapter_requests_total", model="gpt-9") == 0


async def test_models_lists_adapters_with_their_base_model_as_parent(fleet):
    async with fleet.client.get(fleet.url + "/v1/models") as r:
        doc = await r.json()
    cards = {m["id"]: m for m in doc["data"]}
    assert list(cards) == [LORA, MODEL]
    assert cards[LORA] == {"id": LORA, "object": "model", "created": 0, "owned_by": "gpufleet",
                           "root": "org/support-lora", "parent": MODEL, "namespace": "ml", "service": MODEL}
    assert cards[MODEL]["parent"] is None and cards[MODEL]["root"] == MODEL


class FakeKube:
    """The router's listings from memory; ``adapters`` may be an exception to raise."""

    def __init__(self, adapters):
        self.isvc = {"metadata": {"name": "tiny", "namespace": "ml"},
                     "spec": {"model": {"name": "org/tiny", "servedName": MODEL},
                              "engine": {"kvCache": {"blockSize": 16}}}}
        self.adapters = adapters

    async def list(self, api_version, kind, namespace=None, *, label_selector=None):
        if (api_version, kind) == (API_VERSION, KIND):
            return [self.isvc]
        if (api_version, kind) == (API_VERSION, ADAPTER_KIND):
            if isinstance(self.adapters, Exception):
                raise self.adapters
            return self.adapters
        return []


async def test_the_adapters_are_listed_with_the_services_and_a_missing_crd_or_an_error_never_stops_routing():
    from gpufleet_router.metrics import RouterMetrics
    from gpufleet_router.server import Fleet
    fleet = Fleet(RouterSettings(), RouterMetrics())
    item = {"metadata": {"name": LORA, "namespace": "ml"},
            "spec": {"service": "tiny", "source": {"pvc": {"claimName": "loras", "path": "support"}}}}
    await fleet.list_once(FakeKube([item]))
    assert fleet.listed.is_set() and list(fleet.catalog.adapters) == [LORA]
    assert fleet.catalog.adapters[LORA].root == "pvc://loras/support"
    assert fleet.table.routes[MODEL].root == "org/tiny"
    await fleet.list_once(FakeKube(Forbidden(403, "Forbidden", "no")))   # RBAC: the last adapters stay
    assert list(fleet.catalog.adapters) == [LORA] and MODEL in fleet.table.routes
    await fleet.list_once(FakeKube(NotFound(404, "NotFound", "kind InferenceAdapter is not served")))
    assert fleet.catalog.adapters == {} and MODEL in fleet.table.routes
