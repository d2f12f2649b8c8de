"""Operator runtime state kept in kopf's memo: the one API client, metrics,
the controller and the trigger queue. Created before kopf starts, closed at cleanup."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, Coroutine

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .controller import Controller
from .fleet.fleet_loop import FleetLoop
from .fleet.scrape import ReplicaReader
from .kube.client import KubeClient
from .kube.config import KubeConfig
from .kube.errors import ApiError
from .metrics import OperatorMetrics

log = logging.getLogger(__name__)
DEBOUNCE_SECONDS = 0.2  # collect a burst of child events into one reconcile
TRIGGERED_CONCURRENCY = 16


class OperatorRuntime:
    def __init__(self, config: KubeConfig, *, metrics_port: int | None = 9090, metrics_host: str = "0.0.0.0"):
        self.kube = KubeClient(config)
        self.metrics = OperatorMetrics()
        self.controller = Controller(self.kube, self.metrics)
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self._pending: dict[tuple[str, str], bool] = {}  # key -> re-apply children?
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._web: web.AppRunner | None = None
        # Extra background loops (service loops, cluster audits) registered before start.
        self.loops: list[Callable[[OperatorRuntime], Coroutine[Any, Any, None]]] = []
        self.fleet: FleetLoop | None = None  # when the fleet loops run (fleet.register_loops)
        self.fleet_interval = 1.0  # seconds between replica reads (autoscaler fast path)
        self.resync_seconds = 300.0  # a service untouched this long is reconciled by the timer
        self.reader: ReplicaReader | None = None  # reads every replica's /metrics (fleet loops)

    def trigger(self, namespace: str, name: str, apply: bool = True) -> None:
        """Reconcile soon; ``apply=False`` when only status can have changed (a pod event)."""
        key = (namespace, name)
        self._pending[key] = self._pending.get(key, False) or apply
        self._wakeup.set()

    async def next_triggered(self) -> dict[tuple[str, str], bool]:
        await self._wakeup.wait()
        return self.drain_triggered()

    def drain_triggered(self) -> dict[tuple[str, str], bool]:
        self._wakeup.clear()
        keys, self._pending = self._pending, {}
        return keys

    def forget(self, namespace: str, name: str) -> None:
        self.metrics.forget_service(namespace, name)
        self.controller.forget(namespace, name)
        if self.fleet is not None:
            self.fleet.remove_service(namespace, name)

    def resync_due(self, namespace: str, name: str, now: float) -> bool:
        """The timer's backstop runs only for services nothing else reconciled recently.
        A service the timer meets first is being handled by its create/resume handler."""
        last = self.controller.last_reconciled.setdefault((namespace, name), now)
        return now - last >= self.resync_seconds

    async def run_triggered(self) -> None:
        """Reconcile owners of changed children, each at most once per burst,
        up to TRIGGERED_CONCURRENCY at a time (a burst after 1000 creations must
        not be worked through one API round trip after another)."""
        sem = asyncio.Semaphore(TRIGGERED_CONCURRENCY)

        async def one(ns: str, name: str, apply: bool) -> None:
            async with sem:
                try:
                    await self.controller.reconcile_key(ns, name, apply_children=apply)
                except ApiError as e:
                    if not e.namespace_terminating:
                        log.warning("reconcile of %s/%s after a child change failed: %s", ns, name, e)
                except Exception:
                    log.exception("reconcile of %s/%s after a child change crashed", ns, name)

        while True:
            keys = await self.next_triggered()
            await asyncio.sleep(DEBOUNCE_SECONDS)
            for key, apply in self.drain_triggered().items():
                keys[key] = keys.get(key, False) or apply
            await asyncio.gather(*(one(ns, name, apply) for (ns, name), apply in sorted(keys.items())))

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.run_triggered(), name="gpufleet-triggered"))
        for loop in self.loops:
            self._tasks.append(asyncio.create_task(loop(self), name=f"gpufleet-{loop.__name__}"))
        if self.metrics_port is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._serve_metrics)
            app.router.add_get("/healthz", self._serve_health)
            self._web = web.AppRunner(app, access_log=None)
            await self._web.setup()
            await web.TCPSite(self._web, self.metrics_host, self.metrics_port).start()
            log.info("metrics on http://%s:%s/metrics", self.metrics_host, self.metrics_port)

    async def _serve_health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stop(self) -> None:
        if self.fleet is not None:
            await self.fleet.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._web:
            await self._web.cleanup()
        if self.reader is not None:
            await self.reader.close()
        await self.kube.close()
