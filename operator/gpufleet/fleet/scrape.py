"""Read a replica's vLLM and guard metrics (the fast path: direct to the pod's
guard port, bounded concurrency, short timeouts). vLLM listens on the pod's
loopback; its own metrics come through the guard (``/metrics/engine``).

On aiohttp, unlike the operator's other outbound clients (httpx): this runs
for every replica every second, and httpx spends 6-27 times the CPU per read
(bench/http_clients.py, docs/benchmarks.md "HTTP clients")."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping

import aiohttp

from gpufleet_api import bounded_json, typed
from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.adapters import ADAPTERS_PATH, AdapterReport, AdapterSet
from gpufleet_api.guard.demand_prior import DemandPrior, PriorError
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH
from gpufleet_kit.http_limits import JSON_REPLY_CAP, METRICS_REPLY_CAP, read_capped, text_capped

from ..autoscale.signals import ReplicaSample, parse_replica
from ..manifests import names

log = logging.getLogger(__name__)

AUDIT_TIMEOUT_S = 5.0


class ReplicaReader:
    def __init__(self, *, timeout: float = 1.5, concurrency: int = 32,
                 guard_port: int = names.GUARD_PORT,
                 authorization: Callable[[], Mapping[str, str]] = dict):
        """``authorization``: the header of the guards' control routes (/audit, /demand, /adapters),
        the operator's token (``guard_identity.GuardIdentity.authorization``)."""
        self.authorization = authorization
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._sem = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None
        self.guard_port = guard_port

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session:
            await self._session.close()

    async def _get(self, url: str, cap: int, timeout: aiohttp.ClientTimeout | None = None,
                   headers: Mapping[str, str] | None = None) -> str:
        """The reply's text, at most ``cap`` bytes (http_limits): past that, ReplyTooLarge naming the URL."""
        async with self._sem:
            async with self._http().get(url, timeout=timeout or self._timeout, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url} answered {r.status}")
                return await text_capped(r, cap, url)

    async def _control_json(self, url: str, timeout: aiohttp.ClientTimeout | None = None):
        """A guard's control route: with the operator's token."""
        return bounded_json.loads(await self._get(url, JSON_REPLY_CAP, timeout, self.authorization()))

    async def sample(self, pod: str, ip: str) -> ReplicaSample:
        try:
            engine, guard = await asyncio.gather(
                self._get(f"http://{ip}:{self.guard_port}{ENGINE_METRICS_PATH}", METRICS_REPLY_CAP),
                self._get(f"http://{ip}:{self.guard_port}{GUARD_METRICS_PATH}", METRICS_REPLY_CAP))
            return parse_replica(pod, engine, guard)
        except Exception as e:  # any failure: the replica is unreadable, never "idle"
            return ReplicaSample(pod=pod, ok=False, error=f"{type(e).__name__}: {e}"[:200])

    async def audit(self, pod: str, ip: str) -> tuple[dict | None, str | None]:
        try:
            # /audit reads the vLLM plugin's small report files; it runs rarely, so a busy guard gets
            # more time than the per-second metrics reads.
            return await self._control_json(f"http://{ip}:{self.guard_port}/audit",
                                        aiohttp.ClientTimeout(total=AUDIT_TIMEOUT_S)), None
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"[:200]

    async def demand(self, pod: str, ip: str) -> DemandPrior | None:
        """The output lengths the replica learned (``demand_prior``); None when it cannot say (a
        guard from before /demand answers 404: nothing to share, not an error)."""
        try:
            return demand_prior.parse(await self._control_json(f"http://{ip}:{self.guard_port}"
                                                           f"{demand_prior.DEMAND_PATH}"))
        except PriorError as e:
            log.warning("%s answered %s with an invalid document: %s", pod, demand_prior.DEMAND_PATH, e)
            return None
        except Exception:  # unreachable or older: the next look asks again
            return None

    async def adapters(self, pod: str, ip: str) -> tuple[AdapterReport | None, str | None]:
        """The replica's ``GET /adapters`` (what it holds, in which state); (None, why) when it
        cannot say."""
        try:
            raw = await self._control_json(f"http://{ip}:{self.guard_port}{ADAPTERS_PATH}")
            return typed.convert(AdapterReport, raw), None
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"[:200]

    async def put_adapters(self, pod: str, ip: str, wanted: AdapterSet) -> str | None:
        """Tell the replica its whole adapter set (``PUT /adapters``); None when it took it, else why not."""
        try:
            async with self._sem:
                async with self._http().put(f"http://{ip}:{self.guard_port}{ADAPTERS_PATH}",
                                            json=typed.to_builtins(wanted, omit_none=True),
                                            headers=self.authorization()) as r:
                    if r.status >= 300:
                        answer = await read_capped(r, JSON_REPLY_CAP, f"{pod} PUT {ADAPTERS_PATH}")
                        return f"{ADAPTERS_PATH} answered {r.status}: {answer[:200].decode(errors='replace')}"
                    return None
        except Exception as e:
            return f"{type(e).__name__}: {e}"[:200]
