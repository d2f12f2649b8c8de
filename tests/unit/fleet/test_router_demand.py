"""Scale from zero, operator side: the requests routers hold are read from every
router's /metrics, summed per service, and a service at zero with requests held
is ticked (its policy then asks for one replica) without any replica to read."""
from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet.fleet.fleet_loop import FleetLoop
from gpufleet.fleet.router_demand import RouterDemand, parse_held, router_address
from gpufleet_router.metrics import RouterMetrics


def router_metrics(**held: int) -> str:
    m = RouterMetrics()
    for service, n in held.items():
        m.held.labels("ml", service).set(n)
    return m.render().decode()


def test_held_requests_are_summed_per_service_from_the_routers_own_metric():
    assert parse_held(router_metrics(chat=2, idle=0)) == {("ml", "chat"): 2}


def test_a_router_pod_is_read_on_its_named_port_once_it_has_an_ip():
    pod = {"metadata": {"name": "r"}, "status": {"podIP": "10.0.0.5"},
           "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8123}]}]}}
    assert router_address(pod) == "10.0.0.5:8123"
    assert router_address({**pod, "status": {}}) is None
    assert router_address({**pod, "metadata": {"name": "r", "deletionTimestamp": "x"}}) is None


@pytest.fixture
async def routers():
    servers = []
    for text in (router_metrics(chat=2), router_metrics(chat=1, other=3)):
        app = web.Application()

        async def metrics(_request, text=text):
            return web.Response(text=text)
        app.router.add_get("/metrics", metrics)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
    yield [f"127.0.0.1:{s.port}" for s in servers]
    for s in servers:
        await s.close()


async def test_every_router_is_read_and_one_that_does_not_answer_holds_nothing(routers):
    demand = RouterDemand(pods=None, publish=lambda held: None, addresses=[*routers, "127.0.0.1:1"])
    try:
        assert await demand.read_once() == {("ml", "chat"): 3, ("ml", "other"): 3}
    finally:
        await demand._session.close()


def test_a_service_without_replicas_is_ticked_while_a_router_holds_requests_for_it():
    fl = FleetLoop(ports=None, interval=1.0)
    fl.upsert_service({"metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 1}, "spec": {}})
    assert fl.due_now(10.0) == []
    fl.set_demand({("ml", "chat"): 1})
    assert fl.due_now(11.0) == [("ml", "chat")]


async def test_a_service_at_zero_with_a_held_request_gets_one_replica_and_an_event():
    from tests.support.fake_kube import FakeKube
    from tests.unit.fleet.test_service_loop import (
        deployment,
        deployment_replicas,
        isvc,
        make_loop,
        scale_events,
        status,
    )
    kube = FakeKube()
    kube.put(isvc(desired=0, ready=0, autoscaling={"minReplicas": 0, "maxReplicas": 2}))
    kube.put(deployment(0, 0))
    loop = make_loop(kube)
    body = kube.obj("InferenceService", "chat")
    await loop.tick(body, [], now=10.0)                 # nothing held: stays at zero
    assert scale_events(kube) == []
    await loop.tick(kube.obj("InferenceService", "chat"), [], now=11.0, demand=2)
    assert status(kube)["desiredReplicas"] == 1 and status(kube)["lastScaling"]["reason"] == "RouterDemand"
    assert deployment_replicas(kube)[-1] == 1 and scale_events(kube) == ["ScaledUp"]
