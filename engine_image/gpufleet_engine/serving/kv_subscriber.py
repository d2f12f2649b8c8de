"""The guard follows its vLLM's KV events (ZMQ) and serves what the prefix cache holds to the router.

``KVEventsFollower.run`` subscribes to vLLM's publisher (binding the loopback address vLLM connects to, or
connecting where vLLM binds: kv_blocks.publisher_binds) and applies each batch to ``CachedBlocks``. A gap in
vLLM's sequence numbers (its high-water mark dropped batches) makes the set unknowable: it starts again empty
under a new epoch and fills as vLLM stores blocks. ``blocks_route`` is the router's feed
(gpufleet_api.guard.kv_blocks), ``tokenizer_route`` the model's tokenizer for the router to hash requests by.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from gpufleet_api.guard import kv_blocks
from gpufleet_api.guard.guard_config import KVEventsConfig

from ..admission.tokens import HfTokenizer, Tokenizer
from ..vllm.kv_events import CachedBlocks, decode

log = logging.getLogger("gpufleet_engine.kv_events")


class KVEventsFollower:
    def __init__(self, config: KVEventsConfig, blocks: CachedBlocks | None = None):
        self.config = config
        self.blocks = blocks if blocks is not None else CachedBlocks()
        self.batches = 0
        self.undecodable = 0
        self.gaps = 0
        self._last_seq: int | None = None
        self.received = asyncio.Event()   # set at each batch applied (tests wait on it)

    def take(self, frames: list[bytes]) -> None:
        """One published message: topic, sequence number, payload."""
        if len(frames) != 3:
            self.undecodable += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.gaps += 1
            log.warning("vLLM's KV events skipped from %d to %d: the cached-block set starts again",
                        self._last_seq, seq)
            self.blocks.reset()
        self._last_seq = seq
        try:
            batch = decode(frames[2])
        except msgspec.DecodeError as e:
            self.undecodable += 1
            log.warning("undecodable KV event batch %d: %s", seq, e)
            return
        self.blocks.apply(batch)
        self.batches += 1
        self.received.set()

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        endpoint = self.config.endpoint
        try:
            try:
                if kv_blocks.publisher_binds(endpoint):
                    sock.connect(endpoint)
                else:
                    sock.bind(endpoint)
            except zmq.ZMQError as e:   # the router falls back to what it learned; the guard serves on
                log.error("cannot follow vLLM's KV events at %s: %s", endpoint, e)
                return
            log.info("following vLLM's KV events at %s", endpoint)
            while True:
                self.take(await sock.recv_multipart())
        finally:
            sock.close(linger=0)


def blocks_route(follower: KVEventsFollower):
    async def handler(request: web.Request) -> web.Response:
        since_text = request.query.get("since")
        try:
            since = int(since_text) if since_text is not None else None
        except ValueError:
            return web.json_response({"error": f"since: {since_text!r} is not an integer"}, status=400)
        if not follower.batches:
            # Nothing heard from vLLM yet: an idle engine, or events that go elsewhere (an extraArgs
            # --kv-events-config overriding kvEvents). An empty set would say "nothing cached" for sure.
            return web.json_response({"error": "no KV events received from vLLM yet"}, status=503)
        feed = follower.blocks.feed(request.query.get("epoch"), since)
        return web.Response(body=msgspec.json.encode(feed), content_type="application/json")
    return handler


def tokenizer_route(tokenizer: Callable[[], Tokenizer | None]):
    async def handler(request: web.Request) -> web.Response:
        tok = tokenizer()
        # Serializing a large vocabulary takes a while, once: off the event loop.
        files = await asyncio.to_thread(tok.portable) if isinstance(tok, HfTokenizer) else None
        if files is None:
            return web.json_response({"error": "the tokenizer is not loaded (yet), or has no tokenizer.json"},
                                     status=503)
        return web.Response(body=msgspec.json.encode(files), content_type="application/json")
    return handler
