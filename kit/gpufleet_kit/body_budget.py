"""One budget of request-body bytes held at once by a server (the router, a guard), and the bounded read
of a body against it.

A per-request cap alone (413 past it) still lets a crowd of clients each send a body just under the cap at
once: 100 bodies of 8 MiB are 800 MiB held before one of them is parsed. So every body is counted against
the process's ``BodyBudget`` before it is read: its whole Content-Length at once when the client declares
one (a declared body that does not fit is refused before a byte of it is read), else piece by piece as a
chunked body arrives. A body that does not fit is refused at once (``BudgetExhausted``: the server answers
503 with Retry-After), never queued: a waiting body is held memory too. Its ``Claim`` is released when the
request's handling no longer holds the body (the handler returns: answered, refused, failed, or the client
went away), so the budget always comes back to zero.

What the budget bounds is the bytes read; a body parsed is held again as its parsed form (about its size
once more for a prompt of text), the send to the next hop may queue a copy, and joining the pieces read
costs one body's copy for the instant of the join (one at a time: the event loop runs one join at once).
The router measured about 2.6x its budget (tests/unit/router/test_body_budget.py): size a budget to about
a third of the memory given to bodies.

``BodyBudget`` and ``Claim`` are pure bookkeeping; ``read_body`` is the one reader over aiohttp's request.
"""
from __future__ import annotations

from aiohttp import web

from .errors import KitError

PIECE = 64 << 10   # a chunked body is counted and read this much at a time: the most read past a refusal


class BodyTooLarge(KitError, ValueError):
    """One body over the per-request cap (413): ``declared``, its Content-Length when that said so unread."""

    def __init__(self, cap: int, declared: int | None):
        self.cap, self.declared = cap, declared
        said = f"declares {declared} bytes" if declared is not None else "is longer"
        super().__init__(f"the request body {said}, over the limit of {cap} bytes")


class BudgetExhausted(KitError):
    """The body does not fit in what is left of the budget now (503 with Retry-After)."""

    def __init__(self, limit: int, held: int, wanted: int):
        self.limit, self.held, self.wanted = limit, held, wanted
        super().__init__(f"{held} bytes of request bodies are held now and {wanted} more do not fit in "
                         f"the budget of {limit} bytes")


class BodyBudget:
    """Bytes of request bodies held at once across a server's requests, at most ``limit``."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"a body budget must be at least 1 byte, not {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0          # the most held at once since start: what tests and the gauge read
        self.refused = 0       # bodies refused for want of room

    def claim(self) -> Claim:
        """A request's share, empty until its body is read; release it when the body is no longer held."""
        return Claim(self)

    def _take(self, n: int) -> bool:
        if self.held + n > self.limit:
            self.refused += 1
            return False
        self.held += n
        self.peak = max(self.peak, self.held)
        return True

    def _give_back(self, n: int) -> None:
        self.held -= n
        assert self.held >= 0, "a body budget gave back more than it held"


class Claim:
    """One request's bytes in its server's ``BodyBudget``. A context manager: leaving it releases them."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0

    def grow(self, n: int) -> None:
        """Hold ``n`` more bytes, or BudgetExhausted (holding what it held: ``release`` gives it back)."""
        if not self.budget._take(n):
            raise BudgetExhausted(self.budget.limit, self.budget.held, n)
        self.bytes += n

    def release(self) -> None:
        """Give every byte held back; a second call gives back nothing."""
        self.budget._give_back(self.bytes)
        self.bytes = 0

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


async def read_body(request: web.Request, cap: int, claim: Claim) -> bytes:
    """The whole body of ``request``, counted in ``claim`` before it is held: BodyTooLarge past ``cap``
    (a declared length over it is refused unread), BudgetExhausted when the budget has no room for it.
    A chunked body stops being read at the first piece past either."""
    declared = request.content_length
    if declared is not None:
        if declared > cap:
            raise BodyTooLarge(cap, declared)
        claim.grow(declared)   # aiohttp ends a declared body at its length: nothing past it is read
    pieces: list[bytes] = []
    size = 0
    async for piece in request.content.iter_chunked(PIECE):
        size += len(piece)
        if size > cap:
            raise BodyTooLarge(cap, None)
        if declared is None:
            claim.grow(len(piece))
        pieces.append(piece)
    return b"".join(pieces)
