"""The vLLM server behind the guard: one HTTP session, and its health as last seen."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from gpufleet_engine.errors import GuardError
from gpufleet_engine.vllm import stats as vllm_metrics
from gpufleet_engine.vllm.stats import MetricsFormatError, VllmStats

log = logging.getLogger("gpufleet_engine.serving.upstream")

# Request headers worth passing to vLLM; hop-by-hop ones, Host and
# Content-Length are the guard's own business.
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "traceparent",
                             "tracestate")
FORWARDED_RESPONSE_HEADERS = ("content-type", "x-request-id", "cache-control")
UPSTREAM_KEEPALIVE_SECONDS = 3.0


class EngineDown(GuardError):
    """vLLM did not answer (connection refused or reset before a response)."""


class EngineSlow(EngineDown):
    """vLLM's /metrics did not answer within the read's timeout: a hung engine, or a working one on a host
    too loaded to answer in time."""


# Reads in a row that time out before the engine is marked down (a readiness probe's failureThreshold): one
# slow read on a loaded host must not turn every request away with 503 engine_down while vLLM serves; a
# refused or reset connection (a dead vLLM) still marks it down at once.
SLOW_READS_BEFORE_DOWN = 3


class Upstream:
    def __init__(self, base_url: str, max_connections: int):
        self.base_url = base_url.rstrip("/")
        self._max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No total timeout here: streams last as long as generation does; the
        # guard's own request timeout bounds them.
        # vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE);
        # reusing one it is closing fails the request before vLLM reads it. Let
        # idle connections go first.
        connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                             auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    async def read_stats(self, timeout: float) -> VllmStats:
        assert self.session is not None
        try:
            async with self.session.get(self.url("/metrics"),
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    raise EngineDown(f"vLLM /metrics answered {resp.status}")
                text = await resp.text()
        except asyncio.TimeoutError as e:
            raise EngineSlow(f"vLLM at {self.base_url} is not answering within {timeout:g}s") from e
        except aiohttp.ClientError as e:
            raise EngineDown(f"vLLM at {self.base_url} is not answering: {e!r}") from e
        return vllm_metrics.parse(text)


class EngineMonitor:
    """Polls vLLM's /metrics; each read refreshes the KV view or marks the engine down."""

    def __init__(self, upstream: Upstream, interval: float,
                 on_stats: Callable[[VllmStats], None], on_down: Callable[[str], None]):
        self._upstream = upstream
        self.interval = interval  # a config reload may change it
        self._on_stats = on_stats
        self._on_down = on_down
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Read again now (a request just failed to reach vLLM)."""
        self._wake.set()

    async def run(self) -> None:
        last_problem = None
        slow_reads = 0
        while True:
            try:
                stats = await self._upstream.read_stats(timeout=max(1.0, 4 * self.interval))
            except EngineSlow as e:
                slow_reads += 1
                if slow_reads < SLOW_READS_BEFORE_DOWN:
                    log.info("vLLM slow to answer (%d of %d reads before it counts as down): %s",
                             slow_reads, SLOW_READS_BEFORE_DOWN, e)
                else:
                    last_problem = self._down(str(e), last_problem)
            except (EngineDown, MetricsFormatError) as e:
                slow_reads = 0
                last_problem = self._down(str(e), last_problem)
            else:
                slow_reads = 0
                if last_problem is not None:
                    log.info("engine up: %d KV blocks", stats.num_gpu_blocks)
                last_problem = None
                self._on_stats(stats)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def _down(self, problem: str, last_problem: str | None) -> str:
        if problem != last_problem:
            log.warning("engine not usable: %s", problem)
        self._on_down(problem)
        return problem
