"""A replica that answers a huge body (100 MiB by default), made as it is sent: the test never holds it
(``serve`` is the handler).
``written`` counts what the server got into its connection before the reader hung up."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from aiohttp import web
from aiohttp.test_utils import TestServer

MIB = 1 << 20
PIECE = b"x" * (64 << 10)


class HugeReply:
    def __init__(self, size: int = 100 * MIB, content_type: str = "text/plain", declare: bool = False):
        self.size, self.content_type, self.declare = size, content_type, declare
        self.written = 0
        self.finished = asyncio.Event()   # the handler returned: the whole body went out or the reader left

    async def serve(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": self.content_type})
        if self.declare:
            resp.content_length = self.size
        try:
            await resp.prepare(request)
            while self.written < self.size:
                piece = PIECE[:self.size - self.written]
                await resp.write(piece)
                self.written += len(piece)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.finished.set()
        return resp


@contextlib.asynccontextmanager
async def serving(replies: dict[str, HugeReply]) -> AsyncIterator[TestServer]:
    """A server on 127.0.0.1 answering each path with its reply; ``server.replies`` is ``replies``."""
    app = web.Application()
    for path, reply in replies.items():
        app.router.add_get(path, reply.serve)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    server.replies = replies  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        await server.close()
