"""One paced loop over every InferenceService: replica reads, autoscaling, audits.

Replaces one kopf daemon per service. A daemon per object costs a task, a
deep copy of the body and a spec parse every second even for a service with
nothing to read; at 1000 services on 2 cores that starved reconciliation
(docs/benchmarks.md). Here:

- the watch handlers keep ``services`` (plain bodies) and ``pods`` (engine
  pods by service) current, so a tick reads memory, not the API;
- each service is due every ``interval`` seconds on its own clock, and a
  slow one (a replica timing out) delays only itself: ticks run as separate
  tasks, at most ``concurrency`` at once, one per service at a time;
- a service with no ready replica is skipped (there is nothing to read, and
  the autoscaler holds without samples), unless an audit was requested;
- a service's fast-moving status figures (KV usage, TTFT p99) reach its status
  at most every ``figures_interval`` seconds; conditions, replica counts and
  decisions at once (``reconcile.figures``).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Callable

from ..adapters.index import AdapterIndex
from ..api import v1alpha1 as t
from ..kube.errors import ApiError, NotFound
from ..manifests import names
from ..reconcile import figures
from .adapter_sync import SYNC_SECONDS, OrphanAdapters
from .ports import Key, Leadership, ServicePorts
from .service_loop import ServiceLoop, readable_replicas

log = logging.getLogger(__name__)

MIN_PASS_S = 0.05


class FleetLoop:
    """``ports``: what each service's loop talks to. ``leadership``: only the leader ticks (None:
    always, a single operator). ``on_gone``: forget a service the API says is gone (the runtime's
    ``forget``, which calls ``remove_service`` here too; None: only this loop's copy is dropped).
    ``figures_interval``: seconds between status writes of a service's figures (0: every change)."""

    def __init__(self, ports: ServicePorts, *, interval: float = 1.0, concurrency: int = 64,
                 clock: Callable[[], float] = time.monotonic, leadership: Leadership | None = None,
                 on_gone: Callable[[str, str], None] | None = None,
                 figures_interval: float = figures.DEFAULT_INTERVAL_S):
        self.ports = ports
        self.leadership = leadership
        self.on_gone = on_gone
        self.interval = interval
        self.figures_interval = figures_interval
        self._clock = clock
        self._sem = asyncio.Semaphore(concurrency)
        self.services: dict[Key, dict] = {}
        self.pods: dict[Key, dict[str, dict]] = {}
        self._loops: dict[Key, ServiceLoop] = {}
        self._due: dict[Key, float] = {}
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        # Requests the routers hold per service (router_demand.py): wakes a service at zero replicas.
        self.demand: dict[Key, int] = {}
        # InferenceAdapters by service (the adapters' watch); their passes run in the service's tick,
        # or alone for a service with no ready replica (``_adapters_only``), and those of services
        # that do not exist in ``orphans``.
        self.adapters = AdapterIndex()
        self.orphans = OrphanAdapters(ports)
        self._adapters_due: dict[Key, float] = {}
        self._started: float | None = None
        self._orphans_task: asyncio.Task[None] | None = None
        self._orphans_at = 0.0

    # --- fed by the watch handlers ------------------------------------------------

    def upsert_service(self, body: dict) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        old = self.services.get(key)
        if old is not None and old["metadata"].get("uid") != meta.get("uid"):
            self._loops.pop(key, None)  # deleted and re-created under the same name
        self.services[key] = copy.deepcopy(body)
        if names.ANNOTATION_AUDIT_REQUEST in (meta.get("annotations") or {}):
            self._due[key] = 0.0  # an explicit audit request is answered at once
            self._wake.set()

    def remove_service(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.services.pop(key, None)
        self._loops.pop(key, None)
        self._due.pop(key, None)
        self._adapters_due.pop(key, None)

    def upsert_pod(self, namespace: str, service: str, pod: str, view: dict | None) -> None:
        """``view``: {ip, ready, deleting, marked (for scale-in), role (unified, prefill or decode)}; None
        when the pod is gone."""
        key = (namespace, service)
        if view is None:
            self.pods.get(key, {}).pop(pod, None)
            if not self.pods.get(key):
                self.pods.pop(key, None)
            return
        became_ready = view["ready"] and not self.pods.get(key, {}).get(pod, {}).get("ready")
        self.pods.setdefault(key, {})[pod] = {"name": pod, **view}
        if became_ready:  # read a new replica at once rather than on the next round
            self._due[key] = 0.0
            self._wake.set()

    def upsert_adapter(self, body: dict) -> None:
        """An InferenceAdapter was created or changed: its service's adapters pass runs at once."""
        meta = body["metadata"]
        old = self.adapters.get(meta["namespace"], meta["name"])
        adapter = self.adapters.upsert(body)
        if old is None or old.generation != adapter.generation or old.service != adapter.service:
            for service in {adapter.service, *([old.service] if old else [])}:
                self._wake_adapters((adapter.namespace, service))

    def remove_adapter(self, namespace: str, name: str) -> None:
        """An InferenceAdapter was deleted: its replicas are told to unload it at once."""
        old = self.adapters.remove(namespace, name)
        if old is not None:
            loop = self._loops.get((namespace, old.service))
            if loop is not None:
                loop.adapters.forget(name)
            self._wake_adapters((namespace, old.service))

    def _wake_adapters(self, key: Key) -> None:
        self._due[key] = 0.0
        self._adapters_due[key] = 0.0
        self._wake.set()

    # --- the loop -----------------------------------------------------------------------

    def wake(self) -> None:
        """Run a pass now (a router holds requests for a service that may be at zero)."""
        self._wake.set()

    def set_demand(self, held: dict[Key, int]) -> None:
        """The requests the routers hold now, per service (``router_demand``); a pass runs at once
        when any are held."""
        self.demand = held
        if held:
            self.wake()

    def wants_tick(self, key: Key) -> bool:
        body = self.services[key]
        if names.ANNOTATION_AUDIT_REQUEST in (body["metadata"].get("annotations") or {}):
            return True
        if self.demand.get(key):  # requests held for it: it may be at zero replicas
            return True
        return bool(readable_replicas(list(self.pods.get(key, {}).values())))

    def due_now(self, now: float) -> list[Key]:
        """Services whose turn it is and that are not mid-tick; advances their clocks."""
        out = []
        for key in self.services:
            if key in self._running or self._due.get(key, 0.0) > now:
                continue
            self._due[key] = now + self.interval
            if self.wants_tick(key):
                out.append(key)
        return out

    def adapters_only_now(self, now: float, ticking: list[Key]) -> list[Key]:
        """Services with adapters that no tick serves now (no ready replica), every
        ``adapter_sync.SYNC_SECONDS`` or when their adapters changed."""
        out = []
        for key in self.adapters.services():
            if key not in self.services or key in ticking or key in self._running:
                continue
            if self._adapters_due.get(key, 0.0) > now:
                continue
            self._adapters_due[key] = now + SYNC_SECONDS
            out.append(key)
        return out

    async def run_forever(self) -> None:
        while True:
            if self.leadership is not None and not self.leadership.acting():
                await self.leadership.wait_leading()  # a follower reads no replicas and decides nothing
            now = self._clock()
            if self._started is None:
                self._started = now
            ticking = self.due_now(now)
            for key in ticking:
                self._running[key] = asyncio.create_task(self._tick(key), name=f"fleet-{key[0]}/{key[1]}")
            for key in self.adapters_only_now(now, ticking):
                self._running[key] = asyncio.create_task(self._tick(key, adapters_only=True),
                                                         name=f"fleet-adapters-{key[0]}/{key[1]}")
            self._check_orphans(now)
            nxt = min((d for k, d in self._due.items() if k in self.services and k not in self._running),
                      default=now + self.interval)
            self._wake.clear()
            try:  # a pass costs O(services): at most one every MIN_PASS_S
                await asyncio.wait_for(self._wake.wait(), max(MIN_PASS_S, min(self.interval, nxt - now)))
            except asyncio.TimeoutError:
                pass

    def _check_orphans(self, now: float) -> None:
        """Adapters naming a service that does not exist, every SYNC_SECONDS (one task at a time)."""
        if self._orphans_task is not None and not self._orphans_task.done() or now < self._orphans_at:
            return
        self._orphans_at = now + SYNC_SECONDS
        orphans = [a for key in self.adapters.services() if key not in self.services for a in self.adapters.of(*key)]
        if not orphans:
            return

        async def run() -> None:
            try:
                await self.orphans.tick(orphans, now - (self._started or now))
            except Exception:
                log.exception("fleet loop: writing the status of adapters without a service failed; continuing")
        self._orphans_task = asyncio.create_task(run(), name="fleet-adapter-orphans")

    async def _tick(self, key: Key, adapters_only: bool = False) -> None:
        body = None
        try:
            async with self._sem:
                body = self.services.get(key)
                if body is None:
                    return
                loop = self._loops.get(key)
                if loop is None:
                    loop = self._loops[key] = ServiceLoop(self.ports, *key, figures_interval=self.figures_interval)
                pods = list(self.pods.get(key, {}).values())
                adapters = self.adapters.of(*key)
                if adapters_only:
                    await loop.sync_adapters(body, pods, adapters)
                else:
                    await loop.tick(body, pods, demand=self.demand.get(key, 0), adapters=adapters)
        except ApiError as e:
            if not (isinstance(e, NotFound) and body is not None and self._gone(key, body, e)):
                log.warning("fleet loop for %s/%s: %s", key[0], key[1], e)
        except Exception:
            log.exception("fleet loop for %s/%s crashed; continuing", key[0], key[1])
        finally:
            self._running.pop(key, None)

    def _gone(self, key: Key, body: dict, error: NotFound) -> bool:
        """The API says the service itself is gone, and no newer one took its name meanwhile:
        its DELETED event never reached this replica (a watch stream broke as it was deleted, and
        a re-listing says nothing of what vanished). Forget it, or it is read every interval forever."""
        details = error.body.get("details") or {}
        if details.get("kind") != t.PLURAL or details.get("name") != key[1]:
            return False
        current = self.services.get(key)
        if current is None or current["metadata"].get("uid") != body["metadata"].get("uid"):
            return False
        log.info("fleet loop: %s/%s is gone (its deletion was not seen on the watch); forgetting it", *key)
        if self.on_gone is None:
            self.remove_service(*key)
        else:
            self.on_gone(*key)  # which drops this loop's copy too
        return True

    async def pause(self) -> None:
        """Leadership lost: stop the ticks in flight and forget the autoscaler's state, so that
        this replica, should it lead again, decides from fresh samples as a new leader would."""
        await self.stop()
        self._loops.clear()
        self._due.clear()
        self._adapters_due.clear()
        self._started = None

    async def stop(self) -> None:
        tasks = [*self._running.values(), *([self._orphans_task] if self._orphans_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._orphans_task = None
