"""The endpoint picker over gRPC with a client playing Envoy (tests/support/epp.py), in front of stand-in guards
whose /metrics the router reads: each case of GIE's endpoint-picker protocol (docs/proposals/004) and gpufleet's
policy behind it. The conformance test each stands for is named where there is one."""
from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpufleet_api.guard.guard_config import CLASS_HEADER
from gpufleet_api.tenants.usage import GUARD_TENANT_HEADER
from gpufleet_router.epp import protocol
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.adapters import Adapter, Catalog
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.server import Fleet, RouterSettings
from tests.support import epp as envoy
from tests.support.waiting import wait_for
from tests.unit.router.test_server import MODEL, FakeGuard, Harness

LORA = "support-lora"
CATALOG = Catalog({LORA: Adapter(LORA, "ml", MODEL, MODEL, "org/support-lora")})


def completion(prompt: str = "hello", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}


@pytest.fixture
async def picker():
    """Replicas a, b, c behind the picker (plaintext, naming up to 3 endpoints), read once; a and c hold LORA."""
    guards = [await FakeGuard(n).start() for n in ("a", "b", "c")]
    guards[0].adapters = {LORA: "Loaded"}
    guards[2].adapters = {LORA: "Loaded"}
    h = Harness(guards, RouterSettings(prefix_blocks=4, epp_secure=False, hold_timeout=0.0, epp_fallbacks=3))
    h.publish([h.route(*(Replica(g.name, g.address) for g in guards))], CATALOG)
    await h.fleet.read_once(h.http)
    h.fleet.listed.set()
    async with envoy.epp(h.fleet) as (server, address), envoy.channel(address) as stub:
        h.epp, h.stub = server, stub
        yield h
    await h.client.close()
    await h.http.close()
    for g in guards:
        await g.server.close()


def addr(h: Harness, name: str) -> str:
    return h.guards[name].address


async def reread(h: Harness) -> None:
    await h.fleet.read_once(h.http)


def immediate(answers) -> tuple[int, dict, dict[str, str]]:
    (answer,) = answers
    assert answer.WhichOneof("response") == "immediate_response"
    r = answer.immediate_response
    return r.status.code, json.loads(r.body), {h.header.key: h.header.raw_value.decode()
                                               for h in r.headers.set_headers}


async def test_the_destination_is_the_policys_pick_with_fallbacks_in_the_header_and_the_metadata(picker):
    """GatewayFollowingEPPRouting: the most free KV first; the fallbacks after it, in the header and envoy.lb."""
    picker.guards["a"].free, picker.guards["b"].free, picker.guards["c"].free = 10, 90, 50
    await reread(picker)
    stream, answers = await envoy.request(picker.stub, completion())
    header, meta = envoy.destination(answers[0])
    assert header == meta == ",".join([addr(picker, "b"), addr(picker, "c"), addr(picker, "a")])
    assert answers[0].request_headers.response.clear_route_cache
    await stream.close()


async def test_by_default_one_endpoint_is_named_as_an_original_dst_gateway_reads_it(picker):
    picker.fleet.settings.epp_fallbacks = RouterSettings().epp_fallbacks
    stream, answers = await envoy.request(picker.stub, completion())
    header, meta = envoy.destination(answers[0])
    assert header == meta and "," not in header
    await stream.close()


async def test_the_body_goes_back_whole_in_chunks_within_envoys_limit_with_its_length(picker):
    # 6 MiB in a field the policy does not size the request by (the stand-in guards' pools are 100 blocks).
    body = json.dumps(completion("hello", user="x" * (6 << 20))).encode()
    stream, answers = await envoy.request(picker.stub, body)
    assert answers[0].WhichOneof("response") == "request_headers", answers[0]
    chunks = [a for a in answers if a.WhichOneof("response") == "request_body"]
    assert len(chunks) == -(-len(body) // protocol.BODY_CHUNK_BYTES)
    assert all(len(c.request_body.response.body_mutation.streamed_response.body) <= protocol.BODY_CHUNK_BYTES
               for c in chunks)
    assert envoy.streamed_body(answers) == body
    assert [c.request_body.response.body_mutation.streamed_response.end_of_stream for c in chunks][-2:] == \
        [False, True]
    assert envoy.set_headers(answers[0])["content-length"] == str(len(body))
    await stream.close()


@pytest.mark.parametrize("body, status, field", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"prompt": "hi"}).encode(), 400, "`model`"),
    (json.dumps({"model": 7, "prompt": "hi"}).encode(), 400, "`model` must be a non-empty string"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "many"}).encode(), 400, "`max_tokens`"),
    (json.dumps({"model": "nobody-serves-this", "prompt": "hi"}).encode(), 404, "nobody-serves-this"),
])
async def test_a_malformed_request_gets_an_immediate_answer_naming_the_field(picker, body, status, field):
    _, answers = await envoy.request(picker.stub, body)
    code, error, headers = immediate(answers)
    assert code == status and field in error["error"]["message"]
    assert headers["content-type"] == "application/json"
    if status == 404:
        assert MODEL in error["error"]["message"] and error["error"]["param"] == "model"


async def test_the_subset_hint_limits_the_choice_to_its_endpoints(picker):
    picker.guards["b"].free = 99
    await reread(picker)
    for _ in range(3):
        stream, answers = await envoy.request(picker.stub, completion(), metadata=envoy.subset(addr(picker, "c")))
        assert envoy.destination(answers[0]) == (addr(picker, "c"), addr(picker, "c"))
        await stream.close()


@pytest.mark.parametrize("hint", [[], ["10.9.9.9:8080"]])
async def test_a_subset_hint_that_excludes_every_replica_gets_503(picker, hint):
    _, answers = await envoy.request(picker.stub, completion(), metadata=envoy.subset(*hint))
    code, error, _ = immediate(answers)
    assert code == 503 and "subset" in error["error"]["message"]


async def test_a_malformed_subset_hint_is_a_500_naming_it(picker):
    _, answers = await envoy.request(picker.stub, completion(),
                                     metadata={protocol.SUBSET_NAMESPACE: {protocol.SUBSET_KEY: "a,b"}})
    code, error, _ = immediate(answers)
    assert code == 500 and protocol.SUBSET_KEY in error["error"]["message"]


async def test_every_replica_refusing_by_its_reading_gets_429_with_retry_after(picker):
    for g in picker.guards.values():
        g.free = 0
    await reread(picker)
    _, answers = await envoy.request(picker.stub, completion())
    code, error, headers = immediate(answers)
    assert code == 429 and int(headers["retry-after"]) >= 1 and error["error"]["code"] == "no_room"


async def test_one_replica_with_room_is_picked_when_the_others_refuse(picker):
    picker.guards["a"].free, picker.guards["b"].free, picker.guards["c"].free = 0, 0, 40
    await reread(picker)
    stream, answers = await envoy.request(picker.stub, completion())
    assert envoy.destination(answers[0])[0].split(",")[0] == addr(picker, "c")
    await stream.close()


async def test_no_ready_replica_gets_503(picker):
    for g in picker.guards.values():
        g.ready = 0
    await reread(picker)
    _, answers = await envoy.request(picker.stub, completion())
    code, error, headers = immediate(answers)
    assert code == 503 and error["error"]["code"] == "no_ready_replica" and "retry-after" in headers


async def test_an_adapters_request_goes_only_to_replicas_holding_it(picker):
    picker.guards["b"].free = 99     # the base model's choice, never the adapter's
    await reread(picker)
    for i in range(6):
        stream, answers = await envoy.request(picker.stub, {"model": LORA, "prompt": f"q {i}", "max_tokens": 8})
        listed = envoy.destination(answers[0])[0].split(",")
        assert set(listed) == {addr(picker, "a"), addr(picker, "c")}
        await stream.close()


async def test_an_adapter_loaded_nowhere_gets_503_adapter_not_loaded(picker):
    for g in picker.guards.values():
        g.adapters = {}
    await reread(picker)
    _, answers = await envoy.request(picker.stub, {"model": LORA, "prompt": "q", "max_tokens": 8})
    code, error, _ = immediate(answers)
    assert code == 503 and error["error"]["code"] == "adapter_not_loaded" and LORA in error["error"]["message"]


async def test_the_served_endpoint_report_moves_the_pick_to_the_replica_that_served(picker):
    """GatewayDestinationEndpointServed: the gateway went down the list; the picker counts the one that served."""
    picker.guards["a"].free, picker.guards["b"].free, picker.guards["c"].free = 90, 50, 10
    await reread(picker)
    stream, answers = await envoy.request(picker.stub, completion())
    first, fallback = envoy.destination(answers[0])[0].split(",")[:2]
    p = picker.fleet.picker(MODEL)
    pod = {g.address: g.name for g in picker.guards.values()}
    assert p.in_flight == {pod[first]: 1}
    await stream.send(envoy.response_headers_message(200, served=fallback))
    (echo,) = await stream.expect()
    assert echo.WhichOneof("response") == "response_headers" and p.in_flight == {pod[fallback]: 1}
    await stream.send(envoy.response_body_message(b"data: [DONE]\n\n", True))
    (chunk,) = await stream.expect()
    assert chunk.response_body.response.body_mutation.streamed_response.body == b"data: [DONE]\n\n"
    assert p.in_flight == {}
    await stream.close()


async def test_a_stream_the_gateway_drops_ends_the_picks_accounting(picker):
    stream, _ = await envoy.request(picker.stub, completion())
    p = picker.fleet.picker(MODEL)
    assert sum(p.in_flight.values()) == 1
    stream.cancel()
    await wait_for(lambda: not p.in_flight, timeout=10, what="the dropped stream's pick finished")


async def test_the_answer_streams_through_chunk_by_chunk(picker):
    stream, answers = await envoy.request(picker.stub, completion(stream=True))
    await stream.send(envoy.response_headers_message(200))
    await stream.expect()
    for i, event in enumerate([b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n"]):
        await stream.send(envoy.response_body_message(event, i == 1))
        (out,) = await stream.expect()
        assert out.response_body.response.body_mutation.streamed_response.body == event
    await stream.close()


async def test_gateway_fairness_and_objective_become_the_guards_tenant_and_class(picker):
    headers = {"x-gateway-inference-fairness-id": "team-blue", "x-gateway-inference-objective": "background",
               GUARD_TENANT_HEADER: "forged"}
    picker.publish([picker.route(*(Replica(g.name, g.address) for g in picker.guards.values()))
                    .__class__(**{**picker.route().__dict__, "replicas": tuple(
                        Replica(g.name, g.address) for g in picker.guards.values()),
                        "queue_classes": ("interactive", "standard", "background")})], CATALOG)
    await reread(picker)
    stream, answers = await envoy.request(picker.stub, completion(), headers=headers)
    mutation = answers[0].request_headers.response.header_mutation
    set_ = envoy.set_headers(answers[0])
    assert set_[GUARD_TENANT_HEADER] == "team-blue" and set_[CLASS_HEADER] == "background"
    assert GUARD_TENANT_HEADER not in mutation.remove_headers   # replaced by the set, not left to the client
    await stream.close()
    stream, answers = await envoy.request(picker.stub, completion(), headers={
        "x-gateway-inference-objective": "not-a-class", GUARD_TENANT_HEADER: "forged"})
    assert CLASS_HEADER not in envoy.set_headers(answers[0])
    assert list(answers[0].request_headers.response.header_mutation.remove_headers) == [GUARD_TENANT_HEADER]
    await stream.close()


async def test_a_request_without_a_body_goes_to_a_ready_replica(picker):
    stream = envoy.Stream(picker.stub)
    await stream.send(envoy.headers_message("/v1/models", end_of_stream=True))
    (answer,) = await stream.expect()
    assert envoy.destination(answer)[0] in {g.address for g in picker.guards.values()}
    await stream.close()


async def test_a_body_over_the_limit_gets_413(picker):
    picker.fleet.settings.max_body_bytes = 1000
    _, answers = await envoy.request(picker.stub, completion("x" * 5000))
    code, error, _ = immediate(answers)
    assert code == 413 and "1000 bytes" in error["error"]["message"]


async def test_a_service_served_through_the_router_goes_to_the_router_pods_in_turn(picker):
    """The chosen design for P/D and resumption behind a gateway: the pool's endpoints are the router's pods."""
    routers = ("10.1.0.1:8000", "10.1.0.2:8000")
    picker.fleet.settings.router_endpoints = routers
    route = picker.route(*(Replica(g.name, g.address) for g in picker.guards.values()))
    picker.publish([route.__class__(**{**route.__dict__, "via_router": True})], CATALOG)
    seen, open_ = [], []
    for _ in range(2):
        stream, answers = await envoy.request(picker.stub, completion())
        seen.append(envoy.destination(answers[0])[0].split(",")[0])
        open_.append(stream)
    assert sorted(seen) == sorted(routers)        # the one with fewer in flight, the other while one is open
    assert picker.fleet.picker(MODEL).in_flight == {}
    for s in open_:
        await s.close()


async def test_the_health_service_says_serving_once_listed():
    fleet = Fleet(RouterSettings(epp_secure=False), RouterMetrics())
    async with envoy.epp(fleet) as (server, address), grpc.aio.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", protocol.SERVICE_NAME):
            got = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
        fleet.listed.set()
        async def serving() -> bool:
            got = await health.Check(health_pb2.HealthCheckRequest(service=protocol.SERVICE_NAME))
            return got.status == health_pb2.HealthCheckResponse.SERVING
        await wait_for(serving, timeout=10, what="SERVING")


def _tenants(spec: dict) -> dict:
    return {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceTenants",
            "metadata": {"name": "tenants", "namespace": "ml"}, "spec": spec}


async def test_a_namespace_with_tenants_is_gated_as_at_the_router(picker):
    """Trusted identity with the fairness id as tenant: the gate names the tenant and its weight to the guard,
    removes the header the gateway named it in, and refuses (401) a caller it cannot identify, as the router's
    own front door does."""
    picker.fleet.update_tenants([_tenants({"identity": "Trusted", "trusted": {"tenantHeader": "x-team",
                                                                              "fairnessId": "AsTenant"},
                                           "tenants": [{"name": "search", "weight": 2}, {"name": "batch"}]})], [])
    stream, answers = await envoy.request(picker.stub, completion(), headers={
        "x-gateway-inference-fairness-id": "search", "x-team": "search", GUARD_TENANT_HEADER: "batch"})
    set_ = envoy.set_headers(answers[0])
    assert set_[GUARD_TENANT_HEADER] == "search" and set_["x-gpufleet-tenant-weight"] == "2"
    assert "x-team" in answers[0].request_headers.response.header_mutation.remove_headers
    await stream.send(envoy.response_headers_message(200), envoy.response_body_message(b"{}", True))
    await stream.expect(2)
    await stream.close()
    _, answers = await envoy.request(picker.stub, completion(), headers={"x-team": "nobody-declared"})
    code, error, _ = immediate(answers)
    assert code == 401 and error["error"]["code"] == "key_unknown"
    assert picker.fleet.picker(MODEL).in_flight == {}
