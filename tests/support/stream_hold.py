"""A TCP relay between a guard and its vLLM that can hold a streamed answer at a known event, so a fault
injected next lands while the answer is provably unfinished (tests/engine/test_stream_resumption.py).

The guard's ``engineUrl`` points at the relay, which passes every byte both ways unchanged. Armed with a
``Hold``, the first streamed ``POST`` to ``/v1/completions`` or ``/v1/chat/completions`` that any armed relay
sees claims it: that answer's first ``Hold.events`` SSE events go through, the rest is kept back, and
``Hold.held`` is set (``Hold(0, streamed=False)`` keeps a non-streaming answer's body back). What lies
above the relay (the guard, the router, the client) can then hold at most those events, whatever the
machine's speed; a kill of vLLM after that breaks the answer for certain. When vLLM's side
of the held connection closes (the kill), the relay closes the guard's side, as the dead process's socket
would have, and ``Hold.upstream_closed`` is set."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
from dataclasses import dataclass, field

_REQUEST_LINE = re.compile(rb"(GET|POST|PUT|DELETE|PATCH|HEAD) (/\S*) HTTP/1\.[01]\r\n")
_STREAMED_ROUTES = (b"/v1/completions", b"/v1/chat/completions")
_STREAMED = re.compile(rb'"stream"\s*:\s*true')
_EVENT_END = b"\n\n"      # JSON escapes newlines, so an SSE event's data never holds this
_HEADERS_END = b"\r\n\r\n"
_EVENT_DATA = re.compile(rb"data: (\{[^\n]*\})\n\n")


@dataclass
class Hold:
    """Let ``events`` SSE events of one streamed answer through, then keep the rest back.

    ``streamed=False`` claims the next completion ``POST`` whether streamed or not; with ``events=0`` a
    non-streaming answer's headers go through and its body is kept back, so the guard has the request in
    flight for as long as the test wants (tests/engine/test_memory_reports.py)."""
    events: int
    streamed: bool = True
    held: asyncio.Event = field(default_factory=asyncio.Event)
    upstream_closed: asyncio.Event = field(default_factory=asyncio.Event)
    relay: str | None = None          # the name of the relay whose connection claimed the answer
    path: str | None = None
    forwarded: bytearray = field(default_factory=bytearray)   # the answer's body bytes let through
    withheld_bytes: int = 0

    def forwarded_events(self) -> list[dict]:
        return [json.loads(m.group(1)) for m in _EVENT_DATA.finditer(bytes(self.forwarded))]

    def forwarded_text(self) -> str:
        """The answer's text in the events let through (completions' ``text``, chat's ``delta.content``)."""
        text = ""
        for event in self.forwarded_events():
            for choice in event.get("choices") or ():
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        return text

    def finished_within(self) -> bool:
        """Whether an event let through already ended the answer (then nothing was kept back to break)."""
        return any(choice.get("finish_reason") for event in self.forwarded_events()
                   for choice in event.get("choices") or ())

    def describe(self) -> str:
        return (f"relay={self.relay} path={self.path} held={self.held.is_set()} "
                f"events let through={len(self.forwarded_events())} of {self.events} "
                f"({len(self.forwarded)} bytes, text {self.forwarded_text()!r}), "
                f"kept back={self.withheld_bytes} bytes, vLLM's side closed={self.upstream_closed.is_set()}")


class _ClaimedAnswer:
    """The byte counting of one held answer on one connection (vLLM → guard direction)."""

    def __init__(self, hold: Hold):
        self.hold = hold
        self.in_body = False
        self.head = b""
        self.passed_events = 0
        self.last_newline = False  # the body passed so far ends in a "\n" that ends no event

    def split(self, data: bytes) -> tuple[bytes, bytes]:
        """(the bytes to pass on, the bytes to keep back) of ``data`` from vLLM."""
        hold = self.hold
        if hold.held.is_set():
            return b"", data
        out = bytearray()
        if not self.in_body:
            self.head += data
            end = self.head.find(_HEADERS_END)
            if end < 0:
                return data, b""
            self.in_body = True
            body = self.head[end + len(_HEADERS_END):]
            out += data[:len(data) - len(body)]
            data = body
        position = 0
        if self.last_newline and data.startswith(b"\n") and self.passed_events < hold.events:
            position = 1  # the event's end was split between two reads
            self.passed_events += 1
        while self.passed_events < hold.events:
            end = data.find(_EVENT_END, position)
            if end < 0:
                break
            position = end + len(_EVENT_END)
            self.passed_events += 1
        if self.passed_events < hold.events:
            position = len(data)
        hold.forwarded += data[:position]
        out += data[:position]
        self.last_newline = data[:position].endswith(b"\n") and not data[:position].endswith(_EVENT_END)
        if self.passed_events >= hold.events:
            hold.held.set()
        return bytes(out), data[position:]


class HoldingRelay:
    """Relays ``host:port`` connections to ``upstream``; ``arm(hold)`` makes it hold one streamed answer."""

    def __init__(self, name: str, upstream_host: str, upstream_port: int):
        self.name = name
        self.upstream = (upstream_host, upstream_port)
        self.hold: Hold | None = None
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1") -> "HoldingRelay":
        self._server = await asyncio.start_server(self._connection, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, hold: Hold) -> None:
        self.hold = hold

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                down_writer.transport.abort()  # as a refused connection to a dead vLLM would look
                return
            claimed: list[_ClaimedAnswer] = []
            requests = asyncio.create_task(self._requests(down_reader, up_writer, claimed))
            try:
                await self._answers(up_reader, down_writer, claimed)
            finally:
                requests.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await requests
                up_writer.transport.abort()
                down_writer.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        claimed: list[_ClaimedAnswer]) -> None:
        """guard → vLLM: passed on as they are; a streamed completion claims an armed hold."""
        request = b""  # since the last request line of a POST to a streamed route, until it is decided
        while data := await reader.read(65536):
            match = _REQUEST_LINE.search(data)
            if match:
                request = data[match.start():] if match.group(1) == b"POST" and match.group(2) in _STREAMED_ROUTES \
                    else b""
            elif request:
                request += data
            hold = self.hold
            if request and hold is not None and hold.relay is None and \
                    (not hold.streamed or _STREAMED.search(request)):
                hold.relay, hold.path = self.name, _REQUEST_LINE.match(request).group(2).decode()
                claimed.append(_ClaimedAnswer(hold))
                request = b""
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       claimed: list[_ClaimedAnswer]) -> None:
        """vLLM → guard: passed on, but for what a held answer keeps back; closed when vLLM's side closes."""
        try:
            while data := await reader.read(65536):
                if claimed:
                    data, kept = claimed[0].split(data)
                    claimed[0].hold.withheld_bytes += len(kept)
                if data:
                    writer.write(data)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            for answer in claimed:
                answer.hold.upstream_closed.set()
