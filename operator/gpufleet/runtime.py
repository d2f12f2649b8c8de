"""Operator runtime state kept in kopf's memo: the one API client, metrics,
the controller and the trigger queue. Created before kopf starts, closed at cleanup."""
from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .controller import Controller
from .kube.client import KubeClient
from .kube.config import KubeConfig
from .metrics import OperatorMetrics

log = logging.getLogger(__name__)


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
        self.loops: list = []  # extra background loops (cluster audits) registered before start
        self.fleet = None  # FleetLoop when the fleet loops run (fleet.register_loops)
        self.fleet_interval = 1.0  # seconds between replica reads (autoscaler fast path)
        self.resync_seconds = 300.0  # a service untouched this long is reconciled by the timer
        self.reader = None

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

    async def start(self) -> None:
        from .handlers import run_triggered
        self._tasks.append(asyncio.create_task(run_triggered(self), name="gpufleet-triggered"))
        for loop in self.loops:
            self._tasks.append(asyncio.create_task(loop(self), name=f"gpufleet-{loop.__name__}"))
        if self.metrics_port is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._serve_metrics)
            app.router.add_get("/healthz", lambda _r: web.Response(text="ok"))
            self._web = web.AppRunner(app, access_log=None)
            await self._web.setup()
            await web.TCPSite(self._web, self.metrics_host, self.metrics_port).start()
            log.info("metrics on http://%s:%s/metrics", self.metrics_host, self.metrics_port)

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
