"""Stand-in engine pods for operator tests and benchmarks: the guard's port on
each pod IP serving the guard's /metrics and vLLM's (``/metrics/engine``, as
the real guard passes them on), with a KV usage the caller sets, so the
autoscaler can be driven without running engines."""
from __future__ import annotations

from aiohttp import web

from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH


class FakeReplicaMetrics:
    """The guard's and vLLM's metrics on each pod IP's guard port, with a settable KV usage."""

    def __init__(self, kv: float = 0.5):
        self.kv = kv
        # The KV usage of one pod IP where it is not ``kv`` (one service surging among calm ones).
        self.kv_by_ip: dict[str, float] = {}
        self.runners: dict[str, list[web.AppRunner]] = {}
        # More of the guard's /metrics text per pod IP (e.g. its SLI counters: ``sli_counters``).
        self.guard_extra: dict[str, str] = {}

    def _vllm(self, ip: str):
        async def metrics(_req: web.Request) -> web.Response:
            kv = self.kv_by_ip.get(ip, self.kv)
            return web.Response(text=f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {kv}\n"
                                     "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")
        return metrics

    def _guard(self, ip: str):
        async def metrics(_req: web.Request) -> web.Response:
            extra = self.guard_extra.get(ip, "")
            return web.Response(text="# TYPE gpufleet_guard_in_flight gauge\ngpufleet_guard_in_flight 1\n" + extra)
        return metrics

    async def serve(self, ip: str) -> None:
        if ip in self.runners:
            return
        app = web.Application()
        app.router.add_get(GUARD_METRICS_PATH, self._guard(ip))
        app.router.add_get(ENGINE_METRICS_PATH, self._vllm(ip))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, ip, 8080).start()
        self.runners[ip] = [runner]

    async def close(self) -> None:
        for runners in self.runners.values():
            for r in runners:
                await r.cleanup()
        self.runners.clear()


def sli_counters(counts: dict[str, tuple[int, int]], cls: str = "interactive") -> str:
    """The guard's SLI counters as its /metrics shows them: sli -> (events, good events)."""
    lines = ["# TYPE gpufleet_guard_sli_events counter"]
    lines += [f'gpufleet_guard_sli_events_total{{sli="{sli}",class="{cls}"}} {e}' for sli, (e, _) in counts.items()]
    lines.append("# TYPE gpufleet_guard_sli_good_events counter")
    lines += [f'gpufleet_guard_sli_good_events_total{{sli="{sli}",class="{cls}"}} {g}'
              for sli, (_, g) in counts.items()]
    return "\n".join(lines) + "\n"
