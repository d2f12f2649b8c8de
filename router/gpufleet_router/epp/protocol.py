"""Envoy's ext_proc messages as the Gateway API Inference Extension's endpoint-picker protocol uses them (pure:
messages in, messages out; GIE docs/proposals/004-endpoint-picker-protocol, v1.5.0's pkg/epp/handlers).

One gRPC stream per HTTP request. With Envoy's ``FULL_DUPLEX_STREAMED`` request and response bodies (the mode
GIE's test/testdata/envoy.yaml and the gateways configure), the gateway sends the request's headers and then
its body in chunks without waiting; the picker answers once the whole body is in: the request-headers response
naming the destination (the ``x-gateway-destination-endpoint`` header and the same value in the ``envoy.lb``
dynamic metadata: an ordered, comma-separated fallback list), then the body back in chunks of at most
``BODY_CHUNK_BYTES`` (Envoy's streamed-body limit with GIE's margin). Or, instead of all that, an immediate
response (an OpenAI-shaped error with its status: 400/404 for a bad request naming the field, 429 with
Retry-After when every candidate refuses, 503 when none is ready). The answer's headers and body pass through
unchanged; its headers' metadata says which endpoint served (``x-gateway-destination-endpoint-served``)."""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2

# GIE's protocol names, defined once in the API; the picker's modules and tests read them from here too.
from gpufleet_api.gateway_api import DESTINATION_HEADER as DESTINATION_HEADER
from gpufleet_api.gateway_api import DESTINATION_NAMESPACE as DESTINATION_NAMESPACE
from gpufleet_api.gateway_api import OBJECTIVE_HEADER as OBJECTIVE_HEADER
from gpufleet_api.gateway_api import SERVED_KEY as SERVED_KEY
from gpufleet_api.gateway_api import SUBSET_KEY as SUBSET_KEY
from gpufleet_api.gateway_api import SUBSET_NAMESPACE as SUBSET_NAMESPACE
from gpufleet_api.guard.guard_config import CLASS_HEADER
from gpufleet_api.tenants.declaration import FAIRNESS_ID_HEADERS
from gpufleet_api.tenants.usage import GUARD_TENANT_HEADER

from ..errors import RouterError

# GIE's pkg/common/envoy/chunking.go: Envoy takes at most 64 KiB per streamed chunk; 62000 leaves a margin.
BODY_CHUNK_BYTES = 62000
# The service the gateway's gRPC health check names (GIE's envoy.yaml), besides the server's "".
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """The headers, names lower case (HTTP/2's and Envoy's), each value from ``raw_value`` else ``value``; a
    repeated name keeps its last value (the picker reads single-valued headers only)."""
    out = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def metadata_of(request: pb.ProcessingRequest) -> dict[str, dict[str, Any]]:
    """The request's filter metadata by namespace, as plain values."""
    return {ns: json_format.MessageToDict(value) for ns, value in request.metadata_context.filter_metadata.items()}


class BadSubset(RouterError, ValueError):
    """The subset hint is present but not a list of "ip:port" strings."""


def subset_hint(metadata: Mapping[str, Mapping[str, Any]]) -> frozenset[str] | None:
    """The endpoints the gateway lets the picker choose from (``envoy.lb.subset_hint`` /
    ``x-gateway-destination-endpoint-subset``); None when it names no subset (every endpoint may be chosen).
    An empty list is a subset with nothing in it: the answer is 503."""
    found = metadata.get(SUBSET_NAMESPACE)
    if not isinstance(found, Mapping) or SUBSET_KEY not in found:
        return None
    value = found[SUBSET_KEY]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadSubset(f"the {SUBSET_NAMESPACE} metadata's {SUBSET_KEY} must be a list of \"ip:port\" strings, "
                        f"not {json.dumps(value)[:120]}")
    return frozenset(v.strip() for v in value)


def served_endpoint(metadata: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The endpoint that served the request, as the gateway reports it with the answer's headers."""
    found = metadata.get(DESTINATION_NAMESPACE)
    value = found.get(SERVED_KEY) if isinstance(found, Mapping) else None
    return value.strip() if isinstance(value, str) and value.strip() else None


def gateway_headers(headers: Mapping[str, str], queue_classes: Iterable[str],
                    fairness_as_tenant: bool) -> dict[str, str]:
    """The guard's headers the gateway's ones map to: the objective (``x-gateway-inference-objective``) naming
    one of the service's queue classes sets its class header (the guard's classHeaderPolicy still decides what
    a request may ask for); with ``fairness_as_tenant``, the fairness id keys the guard's fair lane as a tenant
    would (a namespace that declares tenants names its tenant through the tenants' gate instead)."""
    out = {}
    objective = headers.get(OBJECTIVE_HEADER, "").strip()
    if objective and objective in set(queue_classes):
        out[CLASS_HEADER] = objective
    if fairness_as_tenant:
        for name in FAIRNESS_ID_HEADERS:
            value = headers.get(name, "").strip()
            if value:
                out[GUARD_TENANT_HEADER] = value[:128]
                break
    return out


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


def destination_metadata(destinations: Iterable[str]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: ",".join(destinations)}})
    return out


def route(destinations: list[str], set_headers: Mapping[str, str], remove_headers: Iterable[str],
          body_length: int) -> pb.ProcessingResponse:
    """The request-headers response that sends the request to ``destinations`` (in order: the first, then the
    fallbacks a gateway retrying goes down), the header and the ``envoy.lb`` metadata carrying the same value."""
    value = ",".join(destinations)
    headers = [_header(DESTINATION_HEADER, value)]
    if body_length > 0:
        # The body goes back as it came, but Envoy wants the length restated once a body is streamed back.
        headers.append(_header("content-length", str(body_length)))
    headers += [_header(k, v) for k, v in set_headers.items()]
    mutation = pb.HeaderMutation(set_headers=headers, remove_headers=sorted(set(remove_headers) - set(set_headers)))
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation,
                                                                      clear_route_cache=True)),
        dynamic_metadata=destination_metadata(destinations))


def chunks(body: bytes, limit: int = BODY_CHUNK_BYTES) -> list[bytes]:
    """The body in pieces of at most ``limit`` bytes (one empty piece for an empty body)."""
    return [body[i:i + limit] for i in range(0, len(body), limit)] or [b""]


def request_body(body: bytes, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """The request's body streamed back to the gateway in chunks; the last one ends the stream (unless the
    request's trailers will)."""
    pieces = chunks(body)
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1)))))
        for i, piece in enumerate(pieces)]


def response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One chunk of the answer, passed on as it came (a stream's events are not held)."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk,
                                                                                end_of_stream=end_of_stream)))))


def response_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(status: int, body: Mapping[str, Any], retry_after: float | None = None) -> pb.ProcessingResponse:
    """The picker's own answer to the client instead of any endpoint's: a JSON body (OpenAI's error shape) with
    ``status``, and Retry-After in whole seconds (at least 1) where given."""
    headers = [_header("content-type", "application/json")]
    if retry_after is not None:
        headers.append(_header("retry-after", str(max(1, math.ceil(retry_after)))))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=headers),
        body=json.dumps(body).encode()))


def status_of(headers: Mapping[str, str]) -> int | None:
    """The answer's status from its ``:status`` pseudo-header."""
    try:
        return int(headers.get(":status", ""))
    except ValueError:
        return None


# Envoy refuses mutations of pseudo-headers and the host; none of the picker's removals names one.
NEVER_REMOVED = frozenset({":authority", ":method", ":path", ":scheme", "host"})
