"""A name one namespace serves is never answered by another (docs/security.md, "Model and adapter names across
namespaces"): the route table and the adapter catalog follow gpufleet_api.name_claims, and a request for the
name, with its Authorization header, reaches only the owner's replicas."""
from __future__ import annotations

import socket

import pytest

from gpufleet_api import API_VERSION, KIND
from gpufleet_api.guard.adapters import ADAPTER_KIND
from gpufleet_router.policy.adapters import build_catalog, resolve
from gpufleet_router.policy.table import build_table
from gpufleet_router.server import RouterSettings
from tests.unit.router.test_requests_and_table import isvc, pod, serving
from tests.unit.router.test_server import FakeGuard, Harness

T1, T2, T3 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"


def adapter(name: str, service: str, ns: str, created: str, **meta) -> dict:
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": created, **meta},
            "spec": {"service": service, "source": {"huggingFace": {"name": f"org/{name}"}}}}


def routed(services: list[dict], items: list[dict], pods: list[dict] = ()):  # type: ignore[assignment]
    table = build_table(services, pods, serving, adapters=items)
    return table, build_catalog(items, table)


def test_a_second_namespaces_served_name_is_not_routed_and_its_problem_names_the_owner():
    table, catalog = routed([isvc("b", ns="team-b", created=T2, servedName="m"),
                             isvc("a", ns="team-a", created=T1, servedName="m")], [])
    target = resolve("m", table, catalog)
    assert target is not None and (target.route.namespace, target.route.service) == ("team-a", "a")
    assert table.problems == ("team-b/b: team-a/a already serves model 'm'; give this InferenceService another "
                              "spec.model.servedName; not routed",)


def test_an_adapters_name_stays_with_its_namespace_when_a_newer_base_model_elsewhere_claims_it():
    table, catalog = routed([isvc("base", ns="team-a", created=T1), isvc("b", ns="team-b", created=T3,
                                                                         servedName="customer-a")],
                            [adapter("customer-a", "base", "team-a", T2)])
    target = resolve("customer-a", table, catalog)
    assert target is not None and target.adapter is not None
    assert (target.route.namespace, target.route.service) == ("team-a", "base")
    assert "customer-a" not in table.routes
    assert any(p.startswith("team-b/b: team-a/customer-a already serves the adapter") for p in table.problems)


def test_a_newer_adapter_in_another_namespace_is_not_served_under_a_base_models_name():
    table, catalog = routed([isvc("a", ns="team-a", created=T1, servedName="customer-a"),
                             isvc("base", ns="team-b", created=T1)],
                            [adapter("customer-a", "base", "team-b", T2)])
    assert catalog.adapters == {}
    assert catalog.problems == ("team-b/customer-a: team-a/a already serves model 'customer-a'; rename this "
                                "InferenceAdapter (its metadata.name is the model name clients send: create it "
                                "again under another name); not served",)
    target = resolve("customer-a", table, catalog)
    assert target is not None and target.adapter is None and target.route.namespace == "team-a"


def test_deleting_the_owner_hands_the_name_to_the_other_namespace():
    going = adapter("customer-a", "base", "team-a", T1, deletionTimestamp=T3)
    table, catalog = routed([isvc("base", ns="team-a", created=T1),
                             isvc("b", ns="team-b", created=T2, servedName="customer-a")], [going])
    target = resolve("customer-a", table, catalog)
    assert target is not None and target.route.namespace == "team-b" and target.adapter is None


def test_an_adapter_missing_from_the_tables_claims_is_not_served():
    table = build_table([isvc("base", ns="team-a", created=T1)], [], serving)
    catalog = build_catalog([adapter("lora", "base", "team-a", T2)], table)
    assert catalog.adapters == {} and "built without this adapter's claim" in catalog.problems[0]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class FakeKube:
    def __init__(self, services: list[dict], pods: list[dict], adapters: list[dict]):
        self.services, self.pods, self.adapters = services, pods, adapters

    async def list(self, api_version, kind, namespace=None, *, label_selector=None):
        return {(API_VERSION, KIND): self.services, ("v1", "Pod"): self.pods,
                (API_VERSION, ADAPTER_KIND): self.adapters}.get((api_version, kind), [])   # no tenants


def ready_pod(name: str, service: str, ip: str, ns: str) -> dict:
    p = pod(name, service, ip, ns=ns)
    p["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return p


@pytest.mark.parametrize("claimed_by", ["service", "adapter"])
async def test_a_second_namespaces_served_name_never_gets_the_firsts_traffic_or_its_authorization(claimed_by):
    """team-a serves ``customer-a`` (a base model, or an adapter on its base model), team-b creates a service
    later with ``servedName: customer-a``: team-a's requests, Authorization header and all, reach team-a's
    replica only, through the router's app, and team-b's guard sees none."""
    port = free_port("127.0.0.2")
    guard_a = await FakeGuard("a").start(port, host="127.0.0.2")
    guard_b = await FakeGuard("b").start(port, host="127.0.0.3")
    if claimed_by == "service":
        services = [isvc("a", ns="team-a", created=T1, servedName="customer-a")]
        adapters: list[dict] = []
    else:
        services = [isvc("a", ns="team-a", created=T1)]
        adapters = [adapter("customer-a", "a", "team-a", T1)]
        guard_a.adapters = {"customer-a": "Loaded"}
    services.append(isvc("b", ns="team-b", created=T2, servedName="customer-a"))
    h = Harness([guard_a, guard_b], RouterSettings(prefix_blocks=4, guard_port=port))
    await h.server.start_server()
    try:
        kube = FakeKube(services, [ready_pod("a-1", "a", "127.0.0.2", "team-a"),
                                   ready_pod("b-1", "b", "127.0.0.3", "team-b")], adapters)
        await h.fleet.list_once(kube)
        await h.fleet.read_once(h.http)
        for _ in range(4):
            async with h.post({"model": "customer-a", "prompt": "hi", "max_tokens": 4},
                              headers={"Authorization": "Bearer team-a-secret"}) as r:
                assert r.status == 200 and r.headers["X-Replica"] == "a"
                await r.read()
        assert guard_b.headers == [] and len(guard_a.headers) == 4
        assert all(h_["Authorization"] == "Bearer team-a-secret" for h_ in guard_a.headers)
        async with h.client.get(h.url + "/v1/models") as r:
            listed = [m["id"] for m in (await r.json())["data"]]
        assert listed.count("customer-a") == 1
    finally:
        await h.client.close()
        await h.http.close()
        await h.server.close()
        for g in (guard_a, guard_b):
            await g.server.close()   # type: ignore[union-attr]
