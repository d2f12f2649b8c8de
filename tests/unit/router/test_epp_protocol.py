"""The endpoint picker's protocol translation (epp/protocol.py), message by message, without a server: GIE's
endpoint-picker protocol (docs/proposals/004) as Envoy's ext_proc messages carry it."""
from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gpufleet_api.guard.guard_config import CLASS_HEADER
from gpufleet_api.tenants.usage import GUARD_TENANT_HEADER
from gpufleet_router.epp import protocol
from tests.support import epp as envoy


def test_headers_are_read_from_raw_value_else_value_with_names_lower_case():
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="X-Gateway-Inference-Objective", raw_value=b"background"),
        base_pb2.HeaderValue(key=":path", value="/v1/completions")]))
    assert protocol.header_map(headers) == {"x-gateway-inference-objective": "background",
                                            ":path": "/v1/completions"}


def test_the_subset_hint_absent_present_empty_and_malformed():
    def hint(metadata):
        return protocol.subset_hint(protocol.metadata_of(envoy.headers_message(metadata=metadata)))
    assert hint(None) is None
    assert hint({protocol.SUBSET_NAMESPACE: {"other": 1}}) is None
    assert hint(envoy.subset("10.0.0.1:8080", "10.0.0.2:8080")) == {"10.0.0.1:8080", "10.0.0.2:8080"}
    assert hint(envoy.subset()) == frozenset()
    with pytest.raises(protocol.BadSubset, match=protocol.SUBSET_KEY):
        hint({protocol.SUBSET_NAMESPACE: {protocol.SUBSET_KEY: "10.0.0.1:8080"}})
    with pytest.raises(protocol.BadSubset):
        hint({protocol.SUBSET_NAMESPACE: {protocol.SUBSET_KEY: [1, 2]}})


def test_the_served_endpoint_is_read_from_envoy_lb_metadata():
    message = envoy.response_headers_message(served="10.0.0.2:8080")
    assert protocol.served_endpoint(protocol.metadata_of(message)) == "10.0.0.2:8080"
    assert protocol.served_endpoint(protocol.metadata_of(envoy.response_headers_message())) is None


def test_the_destination_header_and_metadata_carry_the_same_ordered_list():
    answer = protocol.route(["10.0.0.1:8080", "10.0.0.2:8080"], {CLASS_HEADER: "background"},
                            [GUARD_TENANT_HEADER], 42)
    header, meta = envoy.destination(answer)
    assert header == meta == "10.0.0.1:8080,10.0.0.2:8080"
    assert envoy.set_headers(answer) == {protocol.DESTINATION_HEADER: header, "content-length": "42",
                                         CLASS_HEADER: "background"}
    assert list(answer.request_headers.response.header_mutation.remove_headers) == [GUARD_TENANT_HEADER]
    assert answer.request_headers.response.clear_route_cache


def test_a_header_set_is_not_also_removed():
    answer = protocol.route(["10.0.0.1:8080"], {GUARD_TENANT_HEADER: "team"}, [GUARD_TENANT_HEADER], 0)
    assert list(answer.request_headers.response.header_mutation.remove_headers) == []
    assert "content-length" not in envoy.set_headers(answer)


@pytest.mark.parametrize("size", [0, 1, protocol.BODY_CHUNK_BYTES, protocol.BODY_CHUNK_BYTES + 1, 6 << 20])
def test_the_body_goes_back_in_chunks_within_envoys_limit_and_ends_once(size):
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    answers = protocol.request_body(body)
    streamed = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert b"".join(s.body for s in streamed) == body
    assert all(len(s.body) <= protocol.BODY_CHUNK_BYTES for s in streamed)
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    assert not protocol.request_body(body, end_of_stream=False)[-1].request_body.response.body_mutation \
        .streamed_response.end_of_stream


def test_an_immediate_answer_has_its_status_json_body_and_retry_after_in_whole_seconds():
    answer = protocol.immediate(429, {"error": {"code": "no_room"}}, 0.2).immediate_response
    assert answer.status.code == 429 and json.loads(answer.body) == {"error": {"code": "no_room"}}
    assert {h.header.key: h.header.raw_value for h in answer.headers.set_headers} == {
        "content-type": b"application/json", "retry-after": b"1"}
    assert "retry-after" not in {h.header.key for h in protocol.immediate(400, {}).immediate_response
                                 .headers.set_headers}


def test_the_gateways_objective_names_a_class_and_its_fairness_id_a_tenant():
    classes = ("interactive", "standard", "background")
    headers = {"x-gateway-inference-objective": "background", "x-gateway-inference-fairness-id": "flow-7"}
    assert protocol.gateway_headers(headers, classes, True) == {CLASS_HEADER: "background",
                                                                GUARD_TENANT_HEADER: "flow-7"}
    assert protocol.gateway_headers(headers, classes, False) == {CLASS_HEADER: "background"}
    assert protocol.gateway_headers({"x-gateway-inference-objective": "premium"}, classes, True) == {}
    assert protocol.gateway_headers({"x-llm-d-inference-fairness-id": "f"}, classes, True) == {
        GUARD_TENANT_HEADER: "f"}


def test_the_status_of_an_answer():
    assert protocol.status_of({":status": "429"}) == 429
    assert protocol.status_of({}) is None
