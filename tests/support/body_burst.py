"""Many large request bodies sent at once, as a crowd of clients sends them: each body streamed from one
shared buffer (so the clients' side holds one copy, not one per request), its Content-Length declared or
chunked, and the answers (status, Retry-After, error code) collected as they come back."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator

import aiohttp

MIB = 1 << 20
PIECE = 256 << 10


def completion_body(size: int, model: str) -> bytes:
    """A completion request of exactly ``size`` bytes: its prompt fills the rest."""
    head = json.dumps({"model": model, "max_tokens": 1, "prompt": ""})[:-2].encode()
    tail = b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


async def pieces(body: bytes, stop_after: int | None = None) -> AsyncIterator[memoryview]:
    """``body`` in PIECE-sized views; with ``stop_after``, the client goes away after that many bytes."""
    view = memoryview(body)
    for at in range(0, len(body), PIECE):
        if stop_after is not None and at >= stop_after:
            raise ConnectionAbortedError("the client went away mid-body")
        yield view[at:at + PIECE]


@dataclasses.dataclass
class Answer:
    status: int
    retry_after: str | None
    error: dict | None


class Burst:
    """``n`` requests posting ``body`` to ``url`` at once; ``answers`` fill in as they come back."""

    def __init__(self, url: str, body: bytes, n: int, declare: bool = True):
        self.url, self.body, self.n, self.declare = url, body, n, declare
        self.answers: list[Answer] = []
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Burst:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._tasks = [asyncio.create_task(self._one()) for _ in range(self.n)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        assert self._http is not None
        await self._http.close()

    async def done(self) -> list[Answer]:
        await asyncio.gather(*self._tasks)
        return self.answers

    async def _one(self) -> None:
        assert self._http is not None
        headers = {"Content-Type": "application/json"}
        if self.declare:
            headers["Content-Length"] = str(len(self.body))
        async with self._http.post(self.url, data=pieces(self.body), headers=headers) as r:
            raw = await r.read()
            try:
                error = json.loads(raw).get("error")
            except (ValueError, AttributeError):
                error = None
            self.answers.append(Answer(r.status, r.headers.get("Retry-After"), error))

    def statuses(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for a in self.answers:
            counts[a.status] = counts.get(a.status, 0) + 1
        return counts
