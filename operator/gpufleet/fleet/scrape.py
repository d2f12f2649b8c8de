"""Read a replica's vLLM and guard endpoints (the fast path: direct to the pod,
bounded concurrency, short timeouts)."""
from __future__ import annotations

import asyncio
import json

import httpx

from ..autoscale.signals import ReplicaSample, parse_replica
from ..manifests import names

AUDIT_TIMEOUT_S = 20.0


class ReplicaReader:
    """One pooled HTTP client for every replica. Pass ``transport`` to read
    from something other than sockets (tests)."""

    def __init__(self, *, timeout: float = 1.5, concurrency: int = 32,
                 guard_port: int = names.GUARD_PORT, engine_port: int = names.ENGINE_PORT,
                 transport: httpx.AsyncBaseTransport | None = None):
        self._timeout = timeout
        self._sem = asyncio.Semaphore(concurrency)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.guard_port = guard_port
        self.engine_port = engine_port

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            # Pods are reached directly: no proxies from the environment. Keep a connection
            # to every replica read each second (the default keeps only 20).
            self._client = httpx.AsyncClient(
                transport=self._transport, trust_env=False, timeout=self._timeout,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=30))
        return self._client

    async def close(self) -> None:
        if self._client:
            await self._client.aclose()

    async def _get(self, url: str, timeout: float | None = None) -> str:
        async with self._sem:
            # One deadline for the whole read (httpx's timeouts are per phase).
            async with asyncio.timeout(timeout or self._timeout):
                r = await self._http().get(url, timeout=timeout or self._timeout)
            if r.status_code != 200:
                raise RuntimeError(f"{url} answered {r.status_code}")
            return r.text

    async def sample(self, pod: str, ip: str) -> ReplicaSample:
        try:
            engine, guard = await asyncio.gather(
                self._get(f"http://{ip}:{self.engine_port}/metrics"),
                self._get(f"http://{ip}:{self.guard_port}/metrics"))
            return parse_replica(pod, engine, guard)
        except Exception as e:  # any failure: the replica is unreadable, never "idle"
            return ReplicaSample(pod=pod, ok=False, error=f"{type(e).__name__}: {e}"[:200])

    async def audit(self, pod: str, ip: str) -> tuple[dict | None, str | None]:
        try:
            # The guard probes device memory in a child process: allow it more time than a metrics read.
            return json.loads(await self._get(f"http://{ip}:{self.guard_port}/audit", AUDIT_TIMEOUT_S)), None
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"[:200]
