"""A streaming-completions load generator that balances over a Service's ready
pods itself, since the local control plane runs no kube-proxy. Records one
row per request: what a client saw."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import httpx

from gpufleet.manifests import names
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.pods import is_serving

WORDS = ("fleet", "token", "cache", "block", "queue", "model", "batch", "graph", "shard", "layer")


@dataclasses.dataclass
class RequestResult:
    started: float          # seconds since the load began
    finished: float
    endpoint: str
    status: int             # HTTP status; 0 = connection error
    ttft: float | None = None
    tokens: int = 0
    retry_after: str | None = None
    error: str = ""
    retried: int = 0        # refused before it started (draining replica) and sent elsewhere


def prompt_of(tokens: int, rng: random.Random) -> str:
    # ~1 token per short word for Llama-style tokenizers; close enough for load.
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


class EndpointLoad:
    def __init__(self, kube: KubeClient, namespace: str, service: str, model: str, *, prompt_tokens: int = 200,
                 max_tokens: int = 64, request_class: str | None = None, seed: int = 7):
        self.kube, self.namespace, self.service, self.model = kube, namespace, service, model
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.request_class = request_class
        self.rng = random.Random(seed)
        self.endpoints: list[str] = []
        self.results: list[RequestResult] = []
        self.t0 = time.monotonic()
        self._next = 0

    async def refresh_endpoints(self) -> list[str]:
        """Ready, non-terminating pods behind the Service: what kube-proxy would route to.
        (The local pod IPs are loopback addresses, which EndpointSlices refuse.)"""
        pods = await self.kube.list("v1", "Pod", self.namespace,
                                    label_selector=names.selector_string(self.service))
        self.endpoints = sorted(f"http://{p['status']['podIP']}:{names.GUARD_PORT}" for p in pods if is_serving(p))
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

    async def one(self, http: httpx.AsyncClient) -> RequestResult:
        """One request; like an ingress, retry elsewhere when a replica refuses it
        before any work started (draining, or its socket already closed)."""
        start = time.monotonic() - self.t0
        body = {"model": self.model, "prompt": prompt_of(self.prompt_tokens, self.rng),
                "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        result = RequestResult(start, start, "", 0)
        for attempt in range(3):
            ep = self._pick()
            if ep is None:
                result.error = "no ready endpoint"
                await asyncio.sleep(0.2)
                continue
            result.endpoint, result.retried = ep, attempt
            if await self._send(http, ep, body, result, start):
                break
            await self.refresh_endpoints()
        result.finished = time.monotonic() - self.t0
        if result.status == 429:
            await asyncio.sleep(min(2.0, float(result.retry_after or 1)))  # a polite client backs off
        return result

    async def _send(self, http: httpx.AsyncClient, ep: str, body: dict, result: RequestResult,
                    start: float) -> bool:
        """False when the replica refused before starting (worth a retry elsewhere)."""
        headers = {"x-gpufleet-class": self.request_class} if self.request_class else {}
        result.status, result.error = 0, ""
        try:
            async with http.stream("POST", f"{ep}/v1/completions", json=body, headers=headers) as resp:
                result.status = resp.status_code
                if resp.status_code != 200:
                    result.retry_after = resp.headers.get("Retry-After")
                    result.error = (await resp.aread()).decode(errors="replace")[:300]
                    return not (resp.status_code == 503 and "draining" in result.error)
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("choices") and result.ttft is None:
                        result.ttft = time.monotonic() - self.t0 - start
                    if chunk.get("usage"):
                        result.tokens = chunk["usage"].get("completion_tokens", 0)
                return True
        except httpx.ConnectError as e:
            result.error = f"{type(e).__name__}: {e}"[:200]
            return False
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"[:200]
            return True

    async def run(self, concurrency_at, stop: asyncio.Event, *, max_clients: int,
                  on_result=None) -> list[RequestResult]:
        """Keep ``concurrency_at(t)`` (at most ``max_clients``) clients busy until ``stop`` is set."""
        await self.refresh_endpoints()
        watcher = asyncio.create_task(self._watch_endpoints(stop))
        # Pods are reached directly (no proxies); every client may hold a stream open at once.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_clients)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits,
                                     trust_env=False) as http:
            async def client(i: int) -> None:
                while not stop.is_set():
                    if i >= concurrency_at(time.monotonic() - self.t0):
                        await asyncio.sleep(0.2)
                        continue
                    r = await self.one(http)
                    self.results.append(r)
                    if on_result:
                        on_result(r)
            await asyncio.gather(*(client(i) for i in range(max_clients)))
        watcher.cancel()
        return self.results
