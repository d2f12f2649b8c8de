"""A stand-in for Envoy in front of gpufleet's endpoint picker: the ext_proc messages Envoy sends for one HTTP
request (FULL_DUPLEX_STREAMED bodies, GIE's test/testdata/envoy.yaml), over a grpc.aio stream."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from gpufleet_kit.body_budget import BodyBudget
from gpufleet_kit.tracing import Tracing
from gpufleet_router.epp import protocol
from gpufleet_router.epp.server import EppServer
from gpufleet_router.server import Fleet

ENVOY_CHUNK = 64 << 10   # Envoy's streamed chunks are at most its 64 KiB buffer


def headers_message(path: str = "/v1/completions", headers: dict[str, str] | None = None,
                    end_of_stream: bool = False, metadata: dict | None = None) -> pb.ProcessingRequest:
    h = {":method": "POST" if not end_of_stream else "GET", ":path": path, ":authority": "gateway",
         ":scheme": "http", "content-type": "application/json", **(headers or {})}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in h.items()]), end_of_stream=end_of_stream),
        metadata_context=_metadata(metadata))


def _metadata(metadata: dict | None) -> base_pb2.Metadata:
    out = base_pb2.Metadata()
    for ns, values in (metadata or {}).items():
        s = struct_pb2.Struct()
        s.update(values)
        out.filter_metadata[ns].CopyFrom(s)
    return out


def body_messages(body: bytes, chunk: int = ENVOY_CHUNK) -> list[pb.ProcessingRequest]:
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(pieces) - 1))
            for i, p in enumerate(pieces)]


def subset(*endpoints: str) -> dict:
    return {protocol.SUBSET_NAMESPACE: {protocol.SUBSET_KEY: list(endpoints)}}


def response_headers_message(status: int = 200, served: str | None = None,
                             content_type: str = "text/event-stream") -> pb.ProcessingRequest:
    h = {":status": str(status), "content-type": content_type}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in h.items()])),
        metadata_context=_metadata({protocol.DESTINATION_NAMESPACE: {protocol.SERVED_KEY: served}} if served else None))


def response_body_message(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


class Stream:
    """One request's ext_proc stream: ``send`` messages, ``expect`` the answers as they come."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub):
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (message := await self.queue.get()) is not None:
            yield message

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for m in messages:
            await self.queue.put(m)

    async def expect(self, n: int = 1, timeout: float = 30) -> list[pb.ProcessingResponse]:
        return [await asyncio.wait_for(self.call.read(), timeout) for _ in range(n)]

    async def close(self) -> None:
        await self.queue.put(None)

    def cancel(self) -> None:
        self.call.cancel()


async def request(stub: pb_grpc.ExternalProcessorStub, payload: dict | bytes, path: str = "/v1/completions",
                  headers: dict[str, str] | None = None, metadata: dict | None = None,
                  ) -> tuple[Stream, list[pb.ProcessingResponse]]:
    """Send one request's headers and body; the picker's answers up to the body's end (or its immediate
    answer). The stream stays open for the answer's messages."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    stream = Stream(stub)
    await stream.send(headers_message(path, headers, metadata=metadata), *body_messages(body))
    first = (await stream.expect())[0]
    if first.WhichOneof("response") == "immediate_response":
        return stream, [first]
    out = [first]
    while True:
        (message,) = await stream.expect()
        out.append(message)
        if message.request_body.response.body_mutation.streamed_response.end_of_stream:
            return stream, out


def destination(answer: pb.ProcessingResponse) -> tuple[str, str]:
    """(the destination header's value, the envoy.lb metadata's)."""
    header = next(h.header.raw_value.decode() for h in answer.request_headers.response.header_mutation.set_headers
                  if h.header.key == protocol.DESTINATION_HEADER)
    meta = answer.dynamic_metadata.fields[protocol.DESTINATION_NAMESPACE].struct_value.fields[
        protocol.DESTINATION_HEADER].string_value
    return header, meta


def set_headers(answer: pb.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in answer.request_headers.response.header_mutation.set_headers}


def streamed_body(answers: Iterable[pb.ProcessingResponse]) -> bytes:
    return b"".join(a.request_body.response.body_mutation.streamed_response.body for a in answers
                    if a.WhichOneof("response") == "request_body")


@contextlib.asynccontextmanager
async def epp(fleet: Fleet, budget: BodyBudget | None = None,
              tracing: Tracing | None = None) -> AsyncIterator[tuple[EppServer, str]]:
    """The picker over ``fleet`` on a free local port (the settings' TLS or not), and its address."""
    server = EppServer(fleet, budget or BodyBudget(fleet.settings.body_budget_bytes), host="127.0.0.1",
                       tracing=tracing)
    port = await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def channel(address: str) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(address) as ch:
        yield pb_grpc.ExternalProcessorStub(ch)
