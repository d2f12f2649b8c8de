"""vLLM's prefill/decode hand-off, as the router speaks it to a disaggregated service (pure).

The protocol is vLLM's (its KV connectors) as vllm-router's P/D mode sends it
(docs/pd-disaggregation-findings.md): the prefill replica gets the client's
request cut to one token, not streamed, with ``kv_transfer_params`` asking it
to keep the prompt's KV for a remote decode; its answer carries, at the top
level, the ``kv_transfer_params`` the decode replica needs to fetch that KV
(NIXL: the prefill engine's id, host, port and block ids). The decode replica
gets the client's own request with those parameters and answers the client.
A connector that finds KV by the prompt itself (the shared-storage
connector) returns none, and the decode request carries ``null``. A decode
request computes whatever KV it does not find, which is also what makes a
failed prefill harmless (server.py falls back: the decode request then goes
without hand-off parameters).
"""
from __future__ import annotations

import json

from gpufleet_api import bounded_json

from ..errors import RouterError
from . import requests as rq

KV_TRANSFER_PARAMS = "kv_transfer_params"
# What the prefill request asks of vLLM: keep this prompt's KV for a decode elsewhere.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


class UnreadableAnswer(RouterError, ValueError):
    """The prefill's answer is not an OpenAI completion object."""


def prefill_body(body: bytes, route: str) -> bytes:
    """The client's request as the prefill replica gets it: one token, whole (not streamed)."""
    doc = bounded_json.loads(body)   # parsed before (requests.parse): never deeper than its bound
    doc["max_tokens"] = 1
    if route == rq.CHAT:
        # Chat takes max_completion_tokens over max_tokens: a client's own would outrank the 1.
        doc["max_completion_tokens"] = 1
    doc["min_tokens"] = 1
    doc["stream"] = False
    doc.pop("stream_options", None)   # vLLM refuses stream_options on a request that does not stream
    doc[KV_TRANSFER_PARAMS] = dict(PREFILL_PARAMS)
    return json.dumps(doc).encode()


class Handoff:
    """A prefill done: ``params`` is what its answer returned for decode (None: none, as the
    shared-storage connector, which finds the KV by the prompt)."""
    __slots__ = ("params",)

    def __init__(self, params: dict | None):
        self.params = params


def decode_body(body: bytes, handoff: Handoff | None) -> bytes:
    """The client's request as the decode replica gets it (stream as asked). After a prefill it
    carries ``kv_transfer_params``: what the prefill returned, or ``null`` when it returned none, as
    vllm-router sends it; the decode pod's guard reads their presence as a hand-off (only the
    prompt's tail left to compute). Without a prefill (skipped: decode computes the prompt) the
    client's bytes go unchanged. A client's own ``kv_transfer_params`` never pass: the router owns
    the hand-off of a disaggregated service."""
    if handoff is None and KV_TRANSFER_PARAMS.encode() not in body:
        return body
    doc = bounded_json.loads(body)
    doc.pop(KV_TRANSFER_PARAMS, None)
    if handoff is not None:
        doc[KV_TRANSFER_PARAMS] = handoff.params
    return json.dumps(doc).encode()


def returned_params(answer: bytes) -> dict | None:
    """The ``kv_transfer_params`` of a prefill's 2xx answer, None when it returned none."""
    try:
        doc = bounded_json.loads(answer)
    except ValueError as e:   # not JSON, not UTF-8, or nested past bounded_json's bound
        raise UnreadableAnswer(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise UnreadableAnswer(f"a JSON {type(doc).__name__}, not an object")
    params = doc.get(KV_TRANSFER_PARAMS)
    if params is not None and not isinstance(params, dict):
        raise UnreadableAnswer(f"{KV_TRANSFER_PARAMS} is a {type(params).__name__}, not an object")
    return params
