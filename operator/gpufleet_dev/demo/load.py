"""A streaming-completions load generator of clients that behave as real ones, balancing over a
Service's ready pods itself (the local control plane runs no kube-proxy). Records one row per user
request: what that user saw.

The clients retry as the openai SDK does: at most ``max_retries`` (2) more attempts after a 408,
409, 429, 5xx or a failed connection, each after the answer's Retry-After when it gives one
(up to 60 s) or after an exponential backoff (0.5 s doubling, at most 8 s, with jitter). A share of
the users is impatient: with no first token ``patience`` seconds after they asked, they give up.
Every user stops waiting after ``timeout`` seconds in all (the client's timeout)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import secrets
import time
from typing import Callable

import httpx

from gpufleet.manifests import names
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.pods import is_serving

WORDS = ("fleet", "token", "cache", "block", "queue", "model", "batch", "graph", "shard", "layer")
RETRIED_STATUSES = frozenset({408, 409, 429})
MAX_RETRY_AFTER_SECONDS = 60.0  # the openai SDK honours a longer hint with its own backoff instead


@dataclasses.dataclass(frozen=True)
class ClientPolicy:
    max_retries: int = 2               # the openai SDK's default
    patience: float | None = None      # seconds to a first token before the user gives up; None: waits
    timeout: float = 90.0              # the whole request, retries included


# A client that takes a refusal as its answer (no retry) and waits as long as the old load did:
# what the end-to-end autoscale test drives (tests/e2e/test_autoscale_e2e.py); the demo's clients
# are ``SurgePlan.policy_of``'s.
ONE_TRY = ClientPolicy(max_retries=0, timeout=300.0)


@dataclasses.dataclass
class RequestResult:
    started: float          # seconds since the load began: when the user asked
    finished: float
    endpoint: str
    status: int             # the last answer's HTTP status; 0 = no answer (connection error, gave up waiting)
    ttft: float | None = None  # from when the user asked (retries and their waits included) to the first token
    tokens: int = 0
    retry_after: str | None = None  # the last refusal's Retry-After
    error: str = ""
    retried: int = 0        # refused before it started (draining replica) and sent elsewhere, as an ingress does
    refusals: int = 0       # answers 429 with Retry-After this user got (retried or not)
    bare_refusals: int = 0  # answers 429 without Retry-After
    attempts: int = 0       # requests sent, retries included
    gave_up: bool = False   # an impatient user left before a first token
    timed_out: bool = False  # the client's timeout ended it
    patient: bool = True


def retry_delay(retries_done: int, retry_after: str | None, rng: random.Random) -> float:
    """How long the openai SDK waits before its next try: the server's Retry-After (seconds) when
    it is between 0 and 60, else 0.5 s doubling per retry, at most 8 s, less up to a quarter of jitter."""
    try:
        hinted = float(retry_after) if retry_after is not None else None
    except ValueError:
        hinted = None
    if hinted is not None and 0 < hinted <= MAX_RETRY_AFTER_SECONDS:
        return hinted
    return min(0.5 * 2 ** retries_done, 8.0) * (1 - 0.25 * rng.random())


def prompt_of(tokens: int, rng: random.Random) -> str:
    # ~1 token per short word for Llama-style tokenizers; close enough for load.
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


class EndpointLoad:
    def __init__(self, kube: KubeClient | None, namespace: str, service: str, model: str, *, prompt_tokens: int = 200,
                 max_tokens: int = 64, request_class: str | None = None, seed: int = 7,
                 selector: str | None = None, port: int = names.GUARD_PORT, traced: bool = False):
        """``selector`` and ``port``: the pods to balance over and their port (default: the service's
        engine pods, on the guard's port). ``traced``: each request carries a sampled W3C ``traceparent`` of its
        own, the same on each retry, so the guards trace every request and its attempts are one trace."""
        self.kube, self.namespace, self.service, self.model = kube, namespace, service, model
        self.selector = selector or names.selector_string(service)
        self.port = port
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.request_class = request_class
        self.traced = traced
        self.rng = random.Random(seed)
        self.endpoints: list[str] = []
        self.results: list[RequestResult] = []
        self.in_flight = 0
        self.t0 = time.monotonic()
        self._next = 0

    async def refresh_endpoints(self) -> list[str]:
        """Ready, non-terminating pods behind the Service: what kube-proxy would route to.
        (The local pod IPs are loopback addresses, which EndpointSlices refuse.)"""
        assert self.kube is not None
        pods = await self.kube.list("v1", "Pod", self.namespace, label_selector=self.selector)
        self.endpoints = sorted(f"http://{p['status']['podIP']}:{self.port}" for p in pods if is_serving(p))
        return self.endpoints

    async def _watch_endpoints(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh_endpoints()
            except Exception:
                pass  # keep the last known endpoints
            await asyncio.sleep(0.5)

    def _pick(self) -> str | None:
        if not self.endpoints:
            return None
        self._next = (self._next + 1) % len(self.endpoints)
        return self.endpoints[self._next]

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def one(self, http: httpx.AsyncClient, policy: ClientPolicy = ONE_TRY) -> RequestResult:
        """One user's request, retried as the openai SDK retries, until it is served, refused for the
        last time, fails, or the user gives up."""
        start = self.now()
        body = {"model": self.model, "prompt": prompt_of(self.prompt_tokens, self.rng),
                "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        result = RequestResult(start, start, "", 0, patient=policy.patience is None)
        loop = asyncio.get_running_loop()
        began = loop.time()
        first_deadline = began + min(policy.patience or policy.timeout, policy.timeout)
        try:
            async with asyncio.timeout_at(first_deadline) as scope:
                def first_token() -> None:
                    scope.reschedule(began + policy.timeout)
                await self._attempts(http, body, result, policy, first_token, self._trace_headers())
        except TimeoutError:
            result.gave_up = result.ttft is None and policy.patience is not None and policy.patience < policy.timeout
            result.timed_out = not result.gave_up
            result.error = (f"gave up after {policy.patience:g}s without a first token" if result.gave_up
                            else f"client timeout after {policy.timeout:g}s")
        result.finished = self.now()
        return result

    def _trace_headers(self) -> dict[str, str]:
        """A new trace, sampled: the client decides for its request (docs/tracing.md); random ids, not the
        seeded prompts' generator, so two demo runs do not write the same traces."""
        return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"} if self.traced else {}

    async def _attempts(self, http: httpx.AsyncClient, body: dict, result: RequestResult, policy: ClientPolicy,
                        first_token: Callable[[], None], trace_headers: dict[str, str]) -> None:
        retries = reroutes = 0
        while True:
            ep = self._pick()
            if ep is None:
                result.status, result.error = 0, "no ready endpoint"
                verdict = "retry"
            else:
                result.endpoint = ep
                result.attempts += 1
                verdict = await self._send(http, ep, body, result, first_token, trace_headers)
            if result.status == 429:
                if result.retry_after is not None:
                    result.refusals += 1
                else:
                    result.bare_refusals += 1
            if verdict == "reroute" and reroutes < 2:
                reroutes += 1
                result.retried = reroutes
                if self.kube is not None:
                    await self.refresh_endpoints()
                continue
            if verdict == "done" or retries >= policy.max_retries:
                return
            await asyncio.sleep(retry_delay(retries, result.retry_after if result.status == 429 else None, self.rng))
            retries += 1

    async def _send(self, http: httpx.AsyncClient, ep: str, body: dict, result: RequestResult,
                    first_token: Callable[[], None], trace_headers: dict[str, str]) -> str:
        """"done", "retry" (the openai SDK would try again) or "reroute" (a draining replica refused
        it before any work: an ingress sends it to another)."""
        headers = {**trace_headers, **({"x-gpufleet-class": self.request_class} if self.request_class else {})}
        result.status, result.error, result.retry_after = 0, "", None
        try:
            async with http.stream("POST", f"{ep}/v1/completions", json=body, headers=headers) as resp:
                result.status = resp.status_code
                if resp.status_code != 200:
                    result.retry_after = resp.headers.get("Retry-After")
                    result.error = (await resp.aread()).decode(errors="replace")[:300]
                    if resp.status_code == 503 and "draining" in result.error:
                        return "reroute"
                    retried = resp.status_code in RETRIED_STATUSES or resp.status_code >= 500
                    return "retry" if retried else "done"
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("choices") and result.ttft is None:
                        result.ttft = self.now() - result.started
                        first_token()
                    if chunk.get("usage"):
                        result.tokens = chunk["usage"].get("completion_tokens", 0)
                return "done"
        except httpx.ConnectError as e:
            result.status, result.error = 0, f"{type(e).__name__}: {e}"[:200]
            return "reroute" if result.ttft is None and self.kube is not None else "retry"
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"[:200] or type(e).__name__
            return "done"

    async def run(self, concurrency_at, stop: asyncio.Event, *, max_clients: int,
                  policy_of: Callable[[int], ClientPolicy] = lambda _i: ONE_TRY,
                  on_result=None) -> list[RequestResult]:
        """Keep ``concurrency_at(t)`` (at most ``max_clients``) clients busy until ``stop`` is set;
        client ``i`` behaves as ``policy_of(i)``. A user whose last answer was a refusal comes back
        after its Retry-After."""
        await self.refresh_endpoints()
        watcher = asyncio.create_task(self._watch_endpoints(stop))
        # Pods are reached directly (no proxies); every client may hold a stream open at once.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_clients)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits,
                                     trust_env=False) as http:
            async def client(i: int) -> None:
                while not stop.is_set():
                    if i >= concurrency_at(self.now()):
                        await asyncio.sleep(0.2)
                        continue
                    self.in_flight += 1
                    try:
                        r = await self.one(http, policy_of(i))
                    finally:
                        self.in_flight -= 1
                    self.results.append(r)
                    if on_result:
                        on_result(r)
                    if r.status == 429:
                        await asyncio.sleep(retry_delay(0, r.retry_after, self.rng))
            await asyncio.gather(*(client(i) for i in range(max_clients)))
        watcher.cancel()
        return self.results
