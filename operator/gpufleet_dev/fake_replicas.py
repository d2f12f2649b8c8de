"""Stand-in engine pods for operator tests and benchmarks: vLLM's and the
guard's /metrics on each pod IP (ports 8000 and 8080), with a KV usage the
caller sets, so the autoscaler can be driven without running engines."""
from __future__ import annotations

from aiohttp import web


class FakeReplicaMetrics:
    """vLLM and guard /metrics on each pod IP, with a settable KV usage."""

    def __init__(self, kv: float = 0.5):
        self.kv = kv
        self.runners: dict[str, list[web.AppRunner]] = {}

    async def _vllm(self, _req: web.Request) -> web.Response:
        return web.Response(text=f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {self.kv}\n"
                                 "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")

    async def _guard(self, _req: web.Request) -> web.Response:
        return web.Response(text="# TYPE gpufleet_guard_in_flight gauge\ngpufleet_guard_in_flight 1\n")

    async def serve(self, ip: str) -> None:
        if ip in self.runners:
            return
        runners = []
        for port, handler in ((8000, self._vllm), (8080, self._guard)):
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, ip, port).start()
            runners.append(runner)
        self.runners[ip] = runners

    async def close(self) -> None:
        for runners in self.runners.values():
            for r in runners:
                await r.cleanup()
        self.runners.clear()
