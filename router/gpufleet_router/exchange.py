"""One client request's trip through the router: what travels with it (``Call``, the stream's ``Relay``),
how one replica's answer is classified (refused, unreachable, broken off), and the error answers."""
from __future__ import annotations

import dataclasses
import math

import aiohttp
from aiohttp import web

from gpufleet_api import bounded_json
from gpufleet_kit.http_limits import JSON_REPLY_CAP, ReplyTooLarge, read_capped

from .errors import RouterError
from .metrics import RouterMetrics
from .policy import metering, resume
from .policy import requests as rq
from .policy.choice import Pick
from .policy.prefixes import Prefix
from .policy.table import Route
from .settings import REPLICA_DOWN_CODES, RouterSettings


@dataclasses.dataclass(frozen=True)
class Call:
    """One client request on its way through the router."""
    request: web.Request
    route: str                      # the OpenAI path
    body: bytes                     # as the client sent it
    headers: dict[str, str]         # the client's, less hop-by-hop ones
    parsed: rq.Parsed
    target: Route
    arrived: float
    prefix: Prefix | None           # the prompt's leading blocks, for prefix affinity
    adapter: str | None = None      # the LoRA adapter the request names; None: the base model
    relay: Relay | None = None     # a streamed completion relayed event by event, to resume it on a break
    meter: Meter = dataclasses.field(default_factory=lambda: Meter())   # what the answer used, for its tenant

    @property
    def model(self) -> str:
        """The service's served model name: its pickers and metrics (an adapter's request counts there)."""
        return self.target.model


@dataclasses.dataclass
class Relay:
    """A streamed completion's answer to the client, across the replicas that produce it."""
    stream: resume.Stream
    response: web.StreamResponse | None = None   # the client's, once prepared
    broke_at: float | None = None                 # the last break, until the next replica's first event
    first_sent: bool = False                      # the answer's first event went to the client (its TTFT counted)


@dataclasses.dataclass
class Meter:
    """What forwarding learns of the answer for its tenant's usage (server.py reads it once the answer ended):
    a JSON answer's usage, and the guards' refusal passed on to the client. A stream's is its relay's."""
    counted: metering.Counted | None = None
    guard_refusal: str | None = None    # the refusal's reason code (metering.refusal_reason)


class Refused(RouterError):
    """The replica answered 429 or 503 about its capacity: not admitted, nothing went to the client."""

    def __init__(self, status: int, body: bytes, content_type: str, retry_after: float | None):
        self.status, self.body, self.content_type, self.retry_after = status, body, content_type, retry_after


class Unreachable(RouterError):
    """Nothing answered (connection failed, timed out, the replica is down): nothing was admitted.
    ``connected``: the replica did answer, with a failure (its engine down or failed): a replica to avoid,
    where a connection that failed may only have been slow (SYN, CNI, a busy node) and is worth another try."""

    def __init__(self, message: str, connected: bool = False):
        self.message, self.connected = message, connected


class Broken(RouterError):
    """A relayed stream's replica broke off after the client's stream began."""

    def __init__(self, pod: str, revision: str):
        self.pod, self.revision = pod, revision


def is_sse(resp: aiohttp.ClientResponse) -> bool:
    """An event stream the relay can read (not compressed: bytes pass through undecoded otherwise)."""
    return resp.headers.get("Content-Type", "").startswith("text/event-stream") and \
        resp.headers.get("Content-Encoding", "identity") == "identity"


def replica_down(status: int, body: bytes) -> bool:
    """A guard's 503 that says the replica itself cannot serve now (its engine is down, or it is shutting
    down): not an answer about capacity. The request goes to another replica as after a failed connection,
    and the client never gets this 503 while another replica can take it or answers with a 429 it honours."""
    if status != 503:
        return False
    try:
        code = (bounded_json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return False
    return code in REPLICA_DOWN_CODES


async def read_reply(resp: aiohttp.ClientResponse, pick: Pick) -> bytes:
    """A replica's refusal or error answer, read whole to decide what to do next, at most JSON_REPLY_CAP
    bytes (http_limits): a replica answering more is Unreachable (connected: one to avoid), not read on."""
    try:
        return await read_capped(resp, JSON_REPLY_CAP, f"{pick.replica.pod} ({pick.replica.address})")
    except ReplyTooLarge as e:
        raise Unreachable(str(e), connected=True) from None


def retry_after_of(resp: aiohttp.ClientResponse) -> float | None:
    try:
        return float(resp.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def error_response(status: int, body: dict, retry_after: float | None = None) -> web.Response:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return web.json_response(body, status=status, headers=headers)


def refuse(metrics: RouterMetrics, model: str, outcome: str, status: int, body: dict,
           retry_after: float | None = None) -> web.Response:
    """The router's own answer (not a replica's), counted."""
    metrics.requests.labels(model, outcome).inc()
    return error_response(status, body, retry_after)


def client_session(settings: RouterSettings) -> aiohttp.ClientSession:
    # No total timeout: an answer streams as long as the guard lets it (it times requests out itself).
    # Bytes pass as they come (no decompression), so Content-Encoding and Content-Length stay true.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout),
        auto_decompress=False)
