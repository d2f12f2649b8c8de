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

While another replica leads, every ``follow_interval`` seconds (0: never) each
service's replicas are read into the same per-service state
(``ServiceLoop.follow``), writing nothing (no status, figures included). When
this replica takes the Lease over (``take_over``), its first pass runs at once,
the services under pressure first (``autoscale.takeover``), each carrying out a
scale-out its warm state asks for before reading again; audits wait for that
pass (at most ``AUDITS_WAIT_S``). docs/high-availability.md tells the whole
sequence.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Callable, Literal

from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.errors import ApiError, NotFound

from ..adapters.index import AdapterIndex
from ..autoscale.takeover import AUDITS_WAIT_S, WARM_READINGS, Warm, first_pass_order
from ..manifests import names
from ..reconcile import figures
from .adapter_sync import SYNC_SECONDS, OrphanAdapters
from .pod_views import readable_replicas
from .ports import Key, Leadership, ServicePorts
from .service_loop import ServiceLoop

log = logging.getLogger(__name__)

MIN_PASS_S = 0.05

TickKind = Literal["tick", "adapters", "follow", "take_over"]


def kept(body: dict) -> dict:
    """What the loop keeps of a watched InferenceService: a copy without ``metadata.managedFields``,
    the API server's record of who wrote which field (at 1000 services most of the bytes kept), which
    nothing here reads."""
    meta = {k: v for k, v in body["metadata"].items() if k != "managedFields"}
    return copy.deepcopy({**body, "metadata": meta})


class FleetLoop:
    """``ports``: what each service's loop talks to. ``leadership``: only the leader ticks (None:
    always, a single operator). ``follow_interval``: seconds between a follower's reads of each
    service (0: a follower reads nothing). ``on_gone``: forget a service the API says is gone (the
    runtime's ``forget``, which calls ``remove_service`` here too; None: only this loop's copy is
    dropped). ``figures_interval``: seconds between status writes of a service's figures (0: every
    change)."""

    def __init__(self, ports: ServicePorts, *, interval: float = 1.0, concurrency: int = 64,
                 clock: Callable[[], float] = time.monotonic, leadership: Leadership | None = None,
                 follow_interval: float = 0.0, on_gone: Callable[[str, str], None] | None = None,
                 figures_interval: float = figures.DEFAULT_INTERVAL_S):
        self.ports = ports
        self.leadership = leadership
        self.on_gone = on_gone
        self.interval = interval
        self.follow_interval = follow_interval
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
        # A new leader's first pass: set once every service's first tick of the term is done (set
        # outside a takeover); the audits wait for it (``first_pass_done``).
        self.first_pass = asyncio.Event()
        self.first_pass.set()
        self._taking_over = False
        self._term_started = 0.0
        self._first_pass_task: asyncio.Task[None] | None = None

    # --- fed by the watch handlers ------------------------------------------------

    def upsert_service(self, body: dict) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        old = self.services.get(key)
        if old is not None and old["metadata"].get("uid") != meta.get("uid"):
            self._loops.pop(key, None)  # deleted and re-created under the same name
        self.services[key] = kept(body)
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

    def readable(self, key: Key) -> bool:
        return bool(readable_replicas(list(self.pods.get(key, {}).values())))

    def wants_tick(self, key: Key) -> bool:
        body = self.services[key]
        if names.ANNOTATION_AUDIT_REQUEST in (body["metadata"].get("annotations") or {}):
            return True
        if self.demand.get(key):  # requests held for it: it may be at zero replicas
            return True
        return self.readable(key)

    def due_now(self, now: float, *, following: bool = False) -> list[Key]:
        """Services whose turn it is and that are not mid-tick; advances their clocks. A follower
        (``following``) reads those with a ready replica every ``follow_interval``."""
        out = []
        for key in self.services:
            if key in self._running or self._due.get(key, 0.0) > now:
                continue
            self._due[key] = now + (self.follow_interval if following else self.interval)
            if self.readable(key) if following else self.wants_tick(key):
                out.append(key)
        return out

    def warm(self, key: Key) -> Warm | None:
        """The last reading of ``key`` as a follower (None: none, or it was acted on since)."""
        loop = self._loops.get(key)
        return loop.warm if loop is not None else None

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

    def take_over(self) -> None:
        """This replica now leads (the runtime calls this before the fleet loop can run): the next
        pass is the term's first, every service due at once."""
        self._taking_over = True
        self._term_started = self._clock()
        self._due.clear()
        self._adapters_due.clear()
        self.first_pass.clear()
        self._wake.set()

    async def first_pass_done(self) -> None:
        """Wait for a new leader's first pass (at once outside a takeover)."""
        await self.first_pass.wait()

    def audits_allowed(self) -> bool:
        return self.first_pass.is_set() or self._clock() - self._term_started >= AUDITS_WAIT_S

    async def run_forever(self) -> None:
        while True:
            if self.leadership is not None and not self.leadership.acting():
                await self._follow_pass()
                continue
            now = self._clock()
            if self._started is None:
                self._started = now
            kind: TickKind = "tick"
            if self._taking_over:
                self._taking_over = False
                await self._end_follows()
                ticking = first_pass_order(self.due_now(now), self.warm)
                kind = "take_over"
                log.info("fleet loop: leading; first pass over %d service(s), %d with a scale-out waiting",
                         len(ticking), sum(1 for k in ticking if (w := self.warm(k)) is not None
                                           and w.judgement.decision is not None
                                           and w.judgement.decision.target > w.current))
            else:
                ticking = self.due_now(now)
            for key in ticking:
                self._running[key] = asyncio.create_task(self._tick(key, kind), name=f"fleet-{key[0]}/{key[1]}")
            if kind == "take_over":
                self._first_pass_task = asyncio.create_task(
                    self._close_first_pass([self._running[k] for k in ticking]), name="fleet-first-pass")
            for key in self.adapters_only_now(now, ticking):
                self._running[key] = asyncio.create_task(self._tick(key, "adapters"),
                                                         name=f"fleet-adapters-{key[0]}/{key[1]}")
            self._check_orphans(now)
            nxt = min((d for k, d in self._due.items() if k in self.services and k not in self._running),
                      default=now + self.interval)
            self._wake.clear()
            try:  # a pass costs O(services): at most one every MIN_PASS_S
                await asyncio.wait_for(self._wake.wait(), max(MIN_PASS_S, min(self.interval, nxt - now)))
            except asyncio.TimeoutError:
                pass

    async def _follow_pass(self) -> None:
        """One pass as a follower: each service with a ready replica due its read is read
        (``ServiceLoop.follow``); returns when the next is due, when woken (a replica became
        ready: read at once), or at once when this replica leads. With ``follow_interval`` 0 it
        only waits to lead (a cold follower)."""
        assert self.leadership is not None
        if self.follow_interval <= 0:
            await self.leadership.wait_leading()
            return
        now = self._clock()
        for key in self.due_now(now, following=True):
            self._running[key] = asyncio.create_task(self._tick(key, "follow"), name=f"follow-{key[0]}/{key[1]}")
        nxt = min((d for k, d in self._due.items() if k in self.services and k not in self._running),
                  default=now + self.follow_interval)
        self._wake.clear()
        waits = [asyncio.ensure_future(self.leadership.wait_leading()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=max(MIN_PASS_S, min(self.follow_interval, nxt - now)),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _end_follows(self) -> None:
        """A follower's reads still in flight as this replica takes over are dropped (they would
        land after the leader's first decisions); the readings before them stay."""
        follows = dict(self._running)
        for task in follows.values():
            task.cancel()
        await asyncio.gather(*follows.values(), return_exceptions=True)
        for key, task in follows.items():  # one cancelled before it started never reached its ``finally``
            if self._running.get(key) is task:
                del self._running[key]

    async def _close_first_pass(self, ticks: list[asyncio.Task[None]]) -> None:
        if ticks:
            await asyncio.wait(ticks)
        log.info("fleet loop: first pass as leader done in %.2fs", self._clock() - self._term_started)
        self.first_pass.set()

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

    async def _tick(self, key: Key, kind: TickKind = "tick") -> None:
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
                now = self._clock()
                if kind == "adapters":
                    await loop.sync_adapters(body, pods, adapters, now)
                elif kind == "follow":
                    await loop.follow(body, pods, now)
                elif kind == "take_over":
                    await loop.take_over(body, pods, now, max_age=WARM_READINGS * self.follow_interval,
                                         demand=self.demand.get(key, 0), adapters=adapters,
                                         audits=self.audits_allowed())
                else:
                    await loop.tick(body, pods, now, demand=self.demand.get(key, 0), adapters=adapters,
                                    audits=self.audits_allowed())
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
        self._taking_over = False
        self.first_pass.set()

    async def stop(self) -> None:
        tasks = [*self._running.values(), *(t for t in (self._orphans_task, self._first_pass_task) if t)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()  # a tick cancelled before it started never reached its ``finally``
        self._orphans_task = self._first_pass_task = None
