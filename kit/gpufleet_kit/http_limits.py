"""Reads of a replica's reply, capped: what the operator and the router read whole from a guard (or a
router) is bounded, so one replica that answers 100 MiB is reported unreadable, never held in memory.

A reply is read in pieces of at most ``PIECE`` bytes and given up as soon as it passes its cap (so at
most ``cap + PIECE`` bytes are ever read), or at once when its Content-Length already says it is over.
The connection is then closed, not returned to the pool. Streams relayed to a client (SSE, answers
passed through) are not read here: they go out as they arrive, and the guard times them out.

The caps, one per kind of reply, generous but finite:

- ``METRICS_REPLY_CAP`` (8 MiB): Prometheus text, a guard's own /metrics, vLLM's behind it
  (/metrics/engine) or a router's. vLLM's histograms run to a few hundred KiB for one engine; a router's
  grow with the services in scope (some 100 series a model). 8 MiB is over ten times the largest seen
  and still small beside a pod's memory.
- ``JSON_REPLY_CAP`` (1 MiB): the guards' small JSON documents (/audit, /demand, /adapters) and their
  refusals (a 429/503/502 body, an error answer). A few KiB in practice, tens with hundreds of adapters.
- ``HANDOFF_REPLY_CAP`` (4 MiB): a prefill replica's whole answer to a disaggregated request: one token,
  with the KV block ids of the prompt (some 8,000 numbers for a 128k-token prompt) and whatever
  prompt logprobs the client asked for. Over it the request goes to decode without the hand-off, as
  after any failed prefill: slower, never wrong.
"""
from __future__ import annotations

import aiohttp

from .errors import KitError

MIB = 1 << 20
METRICS_REPLY_CAP = 8 * MIB
JSON_REPLY_CAP = 1 * MIB
HANDOFF_REPLY_CAP = 4 * MIB
PIECE = 64 << 10   # read at a time: the most a reply is read past its cap


class ReplyTooLarge(KitError, ValueError):
    """A replica's reply over its cap: the replica is unreadable this time."""

    def __init__(self, who: str, cap: int, seen: int, declared: bool = False):
        self.who, self.cap, self.seen = who, cap, seen
        said = f"declared {seen} bytes" if declared else f"sent more than {seen} bytes"
        super().__init__(f"{who}: unreadable: the reply {said}, over the cap of {cap} bytes "
                         f"({cap / MIB:g} MiB) for this kind of reply")


async def read_capped(resp: aiohttp.ClientResponse, cap: int, who: str) -> bytes:
    """The whole body of ``resp``, at most ``cap`` bytes; ReplyTooLarge (naming ``who``, the replica and
    what was asked of it) past that, having read at most ``cap + PIECE`` bytes and closed the connection."""
    declared = resp.content_length
    if declared is not None and declared > cap:
        resp.close()
        raise ReplyTooLarge(who, cap, declared, declared=True)
    pieces: list[bytes] = []
    size = 0
    while True:
        piece = await resp.content.read(min(PIECE, cap - size + 1))
        if not piece:
            break
        size += len(piece)
        if size > cap:
            resp.close()
            raise ReplyTooLarge(who, cap, size)
        pieces.append(piece)
    return b"".join(pieces)


async def text_capped(resp: aiohttp.ClientResponse, cap: int, who: str) -> str:
    """``read_capped`` decoded as the reply's charset says (UTF-8 when it says none), bad bytes replaced."""
    raw = await read_capped(resp, cap, who)
    return raw.decode(resp.charset or "utf-8", errors="replace")
