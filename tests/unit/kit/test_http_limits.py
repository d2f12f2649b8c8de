"""The capped read of a replica's reply (gpufleet_kit.http_limits): a reply within its cap is read whole; a
100 MiB one, streamed by a real local server, is given up just past the cap (read: under twice the cap),
its connection closed, and the error names who answered and the cap."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gpufleet_kit.http_limits import (
    JSON_REPLY_CAP,
    METRICS_REPLY_CAP,
    PIECE,
    ReplyTooLarge,
    read_capped,
    text_capped,
)
from tests.support.huge_reply import MIB, HugeReply, serving


@pytest.fixture
async def server():
    replies = {"/huge": HugeReply(), "/declared": HugeReply(declare=True), "/small": HugeReply(size=1000)}
    async with serving(replies) as srv:
        yield srv


def test_the_caps_are_finite_and_metrics_get_more_room_than_json():
    assert 0 < JSON_REPLY_CAP < METRICS_REPLY_CAP <= 64 * MIB


async def test_a_reply_within_its_cap_is_read_whole(server):
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/small") as r:
        assert await text_capped(r, JSON_REPLY_CAP, "chat-0") == "x" * 1000


@pytest.mark.parametrize("cap", [JSON_REPLY_CAP, METRICS_REPLY_CAP])
async def test_a_100_mib_reply_is_given_up_just_past_the_cap(server, cap):
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/huge") as r:
        with pytest.raises(ReplyTooLarge) as e:
            await read_capped(r, cap, "chat-0 (10.0.0.7:8080) /metrics")
    assert cap < e.value.seen <= cap + PIECE < 2 * cap
    message = str(e.value)
    assert "chat-0 (10.0.0.7:8080) /metrics" in message and "unreadable" in message and str(cap) in message
    reply = server.replies["/huge"]
    await asyncio.wait_for(reply.finished.wait(), 10)   # the reader hung up: the server stopped long before its 100 MiB
    assert reply.written < 100 * MIB


async def test_a_reply_that_declares_more_than_the_cap_is_not_read_at_all(server):
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{server.port}/declared") as r:
        with pytest.raises(ReplyTooLarge, match="declared 104857600 bytes"):
            await read_capped(r, JSON_REPLY_CAP, "chat-0")
