"""Latency measured at the wire: a streaming HTTP/1.1 client on a plain socket that reads the
kernel's receive timestamp of every segment (SO_TIMESTAMPNS), not the time its own process
got round to reading it.

Why: on this 2-core machine vLLM has one core and everything else (the load, the relays)
shares the other. A client timing with its own clock is charged for its own scheduling: when
a relay, having written a chunk, goes on with its bookkeeping, the client waits for the core
until the relay sleeps, and that wait counts as the relay's latency. A real client is not on
the guard's core (another pod, another machine); the bytes reaching its socket is what it
sees. On loopback the kernel stamps a segment when the sender writes it, so the timestamp is
the moment the relay put the chunk on the wire, whatever the reader does. The send time is
the client's clock just before it writes the request, the same for every path.

Blocking sockets in threads: one connection per path per client, kept alive between
requests as aiohttp keeps its own.
"""
from __future__ import annotations

import socket
import struct
import time
from urllib.parse import urlsplit

from guard_common import Attempt

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)   # Linux
_TIMESPEC = struct.Struct("qq")


class WireClient:
    """One keep-alive connection to ``url``; requests one at a time."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=600)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, body: bytes, path: str = "/v1/completions") -> Attempt:
        """One streaming POST; TTFT: to the first segment carrying an SSE event, end to end: to
        the segment that ends the chunked body, both by the kernel's receive stamp."""
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.address[0]}:{self.address[1]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        for fresh in (self.sock is None, True):
            if self.sock is None:
                self.sock = self._connect()
            sent_wall, sent = time.time(), time.perf_counter()
            try:
                self.sock.sendall(head + body)
                attempt = self._answer(sent_wall, sent)
            except OSError:
                self.close()
                attempt = Attempt(0, sent=sent)
            if attempt.status or fresh:
                return attempt
            # A kept-alive connection the server had closed while idle (uvicorn after 5 s): no
            # answer began, nothing was served; sent once more on a new connection, as aiohttp does.
        return attempt

    def _answer(self, sent_wall: float, sent: float) -> Attempt:
        assert self.sock is not None
        buf = b""
        header_end = -1
        status = 0
        first: float | None = None
        while True:
            data, ancillary, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(_TIMESPEC.size))
            if not data:
                self.close()
                return Attempt(status, sent=sent)
            stamp = time.time()
            for level, kind, value in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    seconds, nanos = _TIMESPEC.unpack(value[:_TIMESPEC.size])
                    stamp = seconds + nanos / 1e9
            buf += data
            if header_end < 0:
                header_end = buf.find(b"\r\n\r\n")
                if header_end < 0:
                    continue
                header_end += 4
                status = int(buf.split(b" ", 2)[1])
                if b"transfer-encoding: chunked" not in buf[:header_end].lower():
                    # Not a stream (an error): a Content-Length body, read whole.
                    length = _content_length(buf[:header_end])
                    while len(buf) < header_end + length:
                        more = self.sock.recv(1 << 16)
                        if not more:
                            break
                        buf += more
                    return Attempt(status, sent=sent)
            if first is None and b"data: " in buf[header_end:]:
                first = stamp
            if buf.endswith(b"\r\n0\r\n\r\n"):
                events = buf.count(b"data: ")
                tokens = max(0, events - 2)   # less the usage event and [DONE]
                return Attempt(status, ttft=(first or stamp) - sent_wall, e2e=stamp - sent_wall,
                               tokens=tokens, sent=sent)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0
