"""Operator runtime state kept in kopf's memo: the one API client, metrics,
the controller, the trigger queue and, with leader election, the elector.
Created before kopf starts, closed at cleanup.

kopf only watches (its handlers feed memory and the trigger queue; it writes
nothing to the objects), so a follower's watches are as warm as the
leader's. Everything that acts goes through here and waits for leadership:
the triggered reconciles, the resync, the fleet loops and the audits; the
API client refuses writes once the leader's lease is no longer certain. A
follower's fleet loop reads the replicas (``--follower-interval-seconds``)
and writes nothing. On taking the Lease over, the fleet loop's first pass
runs at once while every service is reconciled again beside it, a few at a
time, the most recently changed first (docs/high-availability.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Coroutine, Iterable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpufleet_api import name_claims
from gpufleet_api.guard.control_auth import ControlAuthConfig
from gpufleet_kit.backoff import delay
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import ApiError, NotLeading, Unreachable

from ..fleet.cluster_audit import ClusterAuditor
from ..fleet.fleet_loop import FleetLoop
from ..fleet.guard_identity import GuardIdentity
from ..fleet.ports import ServicePorts
from ..fleet.router_demand import RouterDemand
from ..fleet.scrape import ReplicaReader
from ..leader_election.elector import LeaderElector
from ..metrics import OperatorMetrics
from ..settings import OperatorSettings
from .controller import Controller

log = logging.getLogger(__name__)
DEBOUNCE_SECONDS = 0.2  # collect a burst of child events into one reconcile
TRIGGERED_CONCURRENCY = 16
# A new leader's reconcile of every service runs beside its fleet loop's first pass: a few at a
# time, so the scale-outs of that pass do not queue behind 1000 re-applies for the API server and
# the CPU. Re-applying what the previous leader applied is a backstop, not urgent.
TAKEOVER_RECONCILE_CONCURRENCY = 4
RESYNC_CHECK_SECONDS = 30.0  # how often the resync looks for services due one
TRANSIENT_RETRY_SECONDS = 5.0  # 409, 429, 5xx
ERROR_BACKOFF_FIRST_S = 30.0  # other API errors: doubling up to ERROR_BACKOFF_MAX_S
ERROR_BACKOFF_MAX_S = 600.0

Key = tuple[str, str]


def retry_delay(error: Exception, failures: int) -> float | None:
    """When to reconcile again after a failure (``failures`` so far, this one included); None: not at all."""
    if isinstance(error, NotLeading):
        return None  # the next leader reconciles every service when it takes over
    if isinstance(error, ApiError) and error.namespace_terminating:
        return None  # nothing can be created there any more and the object goes with its namespace
    if isinstance(error, Unreachable) or isinstance(error, ApiError) and error.transient:
        return TRANSIENT_RETRY_SECONDS  # the API server did not answer, or asked to be asked again
    # Refused children are reported in status by the controller; what is left (a kind that is
    # not served, credentials) is not fixed by asking again soon.
    return delay(failures, ERROR_BACKOFF_FIRST_S, ERROR_BACKOFF_MAX_S)


def reconcile_order(keys: Iterable[Key], changed_at: Mapping[Key, float]) -> list[Key]:
    """A new leader's reconcile of every service: the most recently changed first (where drift is
    likeliest), those the watches never showed changing last, by name."""
    return sorted(keys, key=lambda k: (-changed_at.get(k, float("-inf")), k))


class OperatorRuntime:
    """Built from the one ``OperatorSettings``; wires the client, the controller and the fleet
    loops' ports, and runs them while this replica leads."""

    def __init__(self, config: KubeConfig, settings: OperatorSettings):
        self.config = config
        self.settings = settings
        namespace = config.current.namespace  # of the credentials: the default for the settings that name one
        self.metrics = OperatorMetrics()
        self.elector: LeaderElector | None = None
        election = settings.leader_election
        if election is not None:
            self.elector = LeaderElector(config, election.namespace or namespace, election.name, election.identity,
                                         election.timing, self.metrics)
            self.elector.on_change = self._leadership_changed
        self.kube = KubeClient(config, write_fence=None if self.elector is None else self.elector.acting_for,
                               on_request=self.metrics.api_request)
        policies = settings.network_policies
        self.controller = Controller(self.kube, self.metrics, podmonitor_labels=settings.podmonitor_labels,
                                     engine_ingress=None if policies is None else policies.ingress(namespace),
                                     adapter_private_sources=settings.adapter_private_sources)
        self.controller.children.otlp_endpoint = settings.otlp_endpoint
        self._pending: dict[Key, bool] = {}  # key -> re-apply children?
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._web: web.AppRunner | None = None
        self.known: set[Key] = set()  # every InferenceService the watch has shown, deleted ones aside
        self._failures: dict[Key, int] = {}
        self._retries: dict[Key, asyncio.TimerHandle] = {}
        self.changed_at: dict[Key, float] = {}  # when the watches last showed a service or its children change
        self._resync_met: dict[Key, float] = {}  # when the resync first met a service not reconciled yet
        self._takeover: asyncio.Task[None] | None = None  # a new leader's reconcile of every service
        # Who the guards accept on their control routes, and the token this operator sends them.
        self.identity: GuardIdentity | None = None
        if settings.guard_token_file:
            self.identity = GuardIdentity(settings.guard_token_file, self.kube, self._identity_changed)
        self.fleet: FleetLoop | None = None  # with the fleet loops (settings.fleet_loops)
        self.reader: ReplicaReader | None = None  # reads every replica's /metrics (fleet loops)
        self._loops: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {}  # started with the runtime
        if settings.fleet_loops:
            self._wire_fleet()

    def _wire_fleet(self) -> None:
        """The autoscaler and fragmentation audits (one paced loop over every service), the
        cluster-wide audits, and the requests the routers hold (scale from zero)."""
        s = self.settings
        self.reader = ReplicaReader(authorization=self.identity.authorization if self.identity else dict)
        ports = ServicePorts(events=self.kube, status=self.controller, locks=self.controller, objects=self.kube,
                             replicas=self.reader, metrics=self.metrics, names=self.controller.names)
        self.fleet = FleetLoop(ports, interval=s.fleet_interval, leadership=self, on_gone=self.forget,
                               follow_interval=s.follower_interval,
                               figures_interval=s.status_figures_interval)
        auditor = ClusterAuditor(objects=self.kube, events=self.kube, status=self.controller, metrics=self.metrics,
                                 watched=self.known, leadership=self, interval=s.audit_interval,
                                 first_pass=self.fleet.first_pass_done, namespaces=s.listed_namespaces)
        demand = RouterDemand(pods=self.kube, publish=self.fleet.set_demand, leadership=self,
                              interval=s.fleet_interval, addresses=s.router_addresses or None)
        self._loops = {"service_loops": self.fleet.run_forever, "cluster_audits": auditor.run_forever,
                       "router_demand": demand.run_forever}

    def _identity_changed(self, control_auth: ControlAuthConfig) -> None:
        """New keys or another token: every service's guard.json says so (a live field, no restart)."""
        self.controller.children.control_auth = control_auth
        for key in sorted(self.known):
            self.trigger(*key, apply=True)

    # --- leadership ---------------------------------------------------------------

    def acting(self) -> bool:
        """May this replica act now: it leads with time left on its lease (always, without election)."""
        return self.elector is None or self.elector.may_act()

    async def wait_leading(self) -> None:
        if self.elector is not None:
            await self.elector.wait_leading()

    async def _leadership_changed(self, leading: bool) -> None:
        # Runs before any other task sees this replica lead (the elector awaits it at once): the
        # fleet loop's first pass and the takeover's reconciles are set up before anything acts.
        if leading:
            if self.fleet is not None:
                self.fleet.take_over()
            # Level-based: whatever changed while another replica led (or none did) is put right
            # by one reconcile of every service, as after a restart. The reconciles the watches
            # asked for meanwhile are among them.
            keys = self.known | set(self.drain_triggered())
            self._takeover = asyncio.create_task(self.reconcile_all(keys), name="gpufleet-takeover-reconcile")
        else:
            if self._takeover is not None:
                self._takeover.cancel()
                self._takeover = None
            for handle in self._retries.values():
                handle.cancel()
            self._retries.clear()
            self._failures.clear()
            if self.fleet is not None:
                await self.fleet.pause()
            # A follower exports no per-service or fleet gauges: its last values would go stale
            # beside the new leader's, and a dashboard summing over replicas would count twice.
            for key in self.known:
                self.metrics.forget_service(*key)
            self.metrics.stranded.clear()

    def trigger(self, namespace: str, name: str, apply: bool = True) -> None:
        """Reconcile soon; ``apply=False`` when only status can have changed (a pod event)."""
        key = (namespace, name)
        self._pending[key] = self._pending.get(key, False) or apply
        self.changed_at[key] = time.monotonic()
        self._wakeup.set()

    async def next_triggered(self) -> dict[Key, bool]:
        await self._wakeup.wait()
        return self.drain_triggered()

    def drain_triggered(self) -> dict[Key, bool]:
        self._wakeup.clear()
        keys, self._pending = self._pending, {}
        return keys

    def service_seen(self, body: dict) -> None:
        meta = body["metadata"]
        self.known.add((meta["namespace"], meta["name"]))
        self._names_changed(self.controller.names.upsert_service(body))
        if self.fleet is not None:
            self.fleet.upsert_service(body)

    def _names_changed(self, keys: Iterable[name_claims.Key]) -> None:
        """Refresh the status of the services whose NameConflict a watch event changed. An adapter's is
        written by its service's adapters pass (every adapter_sync.SYNC_SECONDS)."""
        for kind, namespace, name in keys:
            if kind == name_claims.SERVICE and (namespace, name) in self.known:
                self.trigger(namespace, name, apply=False)

    def pod_changed(self, namespace: str, service: str, pod: str, view: dict | None) -> None:
        """An engine pod of ``service`` changed (``view``: ip, ready, deleting, marked; None: gone):
        its status is refreshed, and the fleet loop's view of its replicas kept current."""
        self.trigger(namespace, service, apply=False)
        if self.fleet is not None:
            self.fleet.upsert_pod(namespace, service, pod, view)

    def pod_placed(self, namespace: str, service: str, pod: str, node: str | None) -> None:
        """Where an engine pod runs (None: gone or not scheduled): a cordon of that node reconciles its service."""
        self.controller.cordons.pod_seen(namespace, service, pod, node)

    def node_changed(self, node: str, unschedulable: bool | None) -> None:
        """A node's spec.unschedulable (None: the node is gone). A cordon or an uncordon reconciles every
        service with engine pods on it: their replacements start before kubectl drain evicts them."""
        if self.controller.cordons.node_seen(node, unschedulable):
            for namespace, service in self.controller.cordons.services_on(node):
                self.trigger(namespace, service, apply=True)

    def adapter_changed(self, namespace: str, name: str, body: dict | None) -> None:
        """An InferenceAdapter was created or changed (``body``), or deleted (None): its service's
        adapters pass runs at once (the fleet loops place, load and unload adapters)."""
        names = self.controller.names
        self._names_changed(names.remove(name_claims.ADAPTER, namespace, name) if body is None
                            else names.upsert_adapter(body))
        if self.fleet is None:
            return
        if body is None:
            self.fleet.remove_adapter(namespace, name)
        else:
            self.fleet.upsert_adapter(body)

    def forget(self, namespace: str, name: str) -> None:
        self.known.discard((namespace, name))
        self._names_changed(self.controller.names.remove(name_claims.SERVICE, namespace, name))
        self._resync_met.pop((namespace, name), None)
        self.changed_at.pop((namespace, name), None)
        self._failures.pop((namespace, name), None)
        handle = self._retries.pop((namespace, name), None)
        if handle is not None:
            handle.cancel()
        self.metrics.forget_service(namespace, name)
        self.controller.forget(namespace, name)
        if self.fleet is not None:
            self.fleet.remove_service(namespace, name)

    def resync_due(self, namespace: str, name: str, now: float) -> bool:
        """The resync runs only for services nothing else reconciled recently. A service
        the resync meets first is being handled by the reconcile its watch event asked for
        (or the takeover's): it is due ``resync_seconds`` after that first meeting. The meeting
        is kept apart from ``last_reconciled``, which the takeover reads to skip the services
        reconciled meanwhile: a resync pass during a long takeover skipped every service the
        takeover had not reached yet (at 1000 services, most of them)."""
        key = (namespace, name)
        last = self.controller.last_reconciled.get(key)
        if last is None:
            last = self._resync_met.setdefault(key, now)
        return now - last >= self.settings.resync_seconds

    async def _reconcile(self, ns: str, name: str, apply: bool) -> None:
        try:
            await self.controller.reconcile_key(ns, name, apply_children=apply)
            self._failures.pop((ns, name), None)
        except Exception as e:
            self._failed(ns, name, apply, e)
            return
        conflict_in = self.controller.conflict_retry_in(ns, name)
        if conflict_in is not None:
            # A child's name is held by an object the watches do not show (ChildConflict): look again
            # then; the reconcile applies once the backoff is due, nothing before.
            self._retry_later((ns, name), False, conflict_in)

    async def reconcile_all(self, keys: Iterable[Key]) -> None:
        """A new leader's reconcile of ``keys``, TAKEOVER_RECONCILE_CONCURRENCY at a time, the most
        recently changed first; one reconciled meanwhile for a watch event is not done again."""
        started = time.monotonic()
        order = reconcile_order(keys, self.changed_at)
        log.info("leading: reconciling all %d known InferenceService(s), %d at a time, the most recently "
                 "changed first", len(order), TAKEOVER_RECONCILE_CONCURRENCY)
        sem = asyncio.Semaphore(TAKEOVER_RECONCILE_CONCURRENCY)

        async def one(key: Key) -> None:
            async with sem:
                if key in self.known and self.controller.last_reconciled.get(key, float("-inf")) < started:
                    await self._reconcile(*key, apply=True)
        await asyncio.gather(*(one(key) for key in order))
        log.info("leading: reconciled all %d InferenceService(s) in %.1fs", len(order), time.monotonic() - started)

    async def run_triggered(self) -> None:
        """Reconcile owners of changed children, each at most once per burst,
        up to TRIGGERED_CONCURRENCY at a time (a burst after 1000 creations must
        not be worked through one API round trip after another)."""
        sem = asyncio.Semaphore(TRIGGERED_CONCURRENCY)

        async def one(ns: str, name: str, apply: bool) -> None:
            async with sem:
                await self._reconcile(ns, name, apply)

        while True:
            await self.wait_leading()
            keys = await self.next_triggered()
            await asyncio.sleep(DEBOUNCE_SECONDS)
            for key, apply in self.drain_triggered().items():
                keys[key] = keys.get(key, False) or apply
            if not self.acting():  # lost the lease meanwhile: keep them for when it comes back
                for (ns, name), apply in keys.items():
                    self.trigger(ns, name, apply)
                continue
            await asyncio.gather(*(one(ns, name, apply) for (ns, name), apply in sorted(keys.items())))

    def _failed(self, ns: str, name: str, apply: bool, error: Exception) -> None:
        key = (ns, name)
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = retry_delay(error, failures)
        if isinstance(error, ApiError):
            if delay is not None:
                log.warning("reconcile of %s/%s failed (try %d; again in %.0fs): %s", ns, name, failures, delay,
                            error)
        else:
            log.error("reconcile of %s/%s crashed (try %d; again in %.0fs)", ns, name, failures, delay,
                      exc_info=error)
        if delay is None:
            self._failures.pop(key, None)
            return
        self._retry_later(key, apply, delay)

    def _retry_later(self, key: Key, apply: bool, delay: float) -> None:
        """Reconcile ``key`` again in ``delay`` seconds (replacing a retry already set)."""
        old = self._retries.pop(key, None)
        if old is not None:
            old.cancel()

        def retry() -> None:
            self._retries.pop(key, None)
            if key in self.known:
                self.trigger(*key, apply)
        self._retries[key] = asyncio.get_running_loop().call_later(delay, retry)

    async def run_resync(self) -> None:
        """Level-based backstop: whatever the watches missed, the next resync puts right.
        Child and pod events reconcile within a second, so only services that nothing
        reconciled for ``settings.resync_seconds`` are due (at 1000 services a resync of every one
        each 30 s would be 33 reconciles a second of pure re-application)."""
        while True:
            await asyncio.sleep(RESYNC_CHECK_SECONDS)
            if not self.acting():
                continue
            now = time.monotonic()
            for key in sorted(self.known):
                if self.resync_due(*key, now):
                    self.trigger(*key, apply=True)

    async def start(self) -> None:
        if self.elector is not None:
            await self.elector.start()
        if self.identity is not None:
            # Before the first reconcile: a guard.json written without controlAuth refuses this operator.
            await self.identity.refresh()
            self._tasks.append(asyncio.create_task(self.identity.run_forever(), name="gpufleet-guard-identity"))
        else:
            log.warning("no --guard-token-file: the guards refuse this operator's control calls (adapters, "
                        "audits, demand); docs/security.md")
        self._tasks.append(asyncio.create_task(self.run_triggered(), name="gpufleet-triggered"))
        self._tasks.append(asyncio.create_task(self.run_resync(), name="gpufleet-resync"))
        for name, loop in self._loops.items():
            self._tasks.append(asyncio.create_task(loop(), name=f"gpufleet-{name}"))
        if self.settings.metrics_port is not None:
            app = web.Application()
            app.router.add_get("/metrics", self._serve_metrics)
            app.router.add_get("/healthz", self._serve_health)
            app.router.add_get("/readyz", self._serve_ready)
            self._web = web.AppRunner(app, access_log=None)
            await self._web.setup()
            host, port = self.settings.metrics_host, self.settings.metrics_port
            await web.TCPSite(self._web, host, port).start()
            log.info("metrics on http://%s:%s/metrics", host, port)

    async def _serve_health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _serve_ready(self, _request: web.Request) -> web.Response:
        """Ready means able to lead: this replica reaches the API server and its Lease
        (a follower that cannot would not take over, so it is not counted as available)."""
        if self.elector is None:
            return web.Response(text="ok: no leader election")
        role = "leader" if self.elector.may_act() else "follower"
        if not self.elector.able_to_lead():
            return web.Response(status=503, text=f"{role}: cannot reach Lease {self.elector.lease} "
                                                 f"({self.elector.last_error or 'not read yet'})")
        return web.Response(text=f"ok: {role} ({self.elector.identity})")

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stop(self) -> None:
        if self.elector is not None:  # stop acting and hand the Lease over before anything else
            await self.elector.stop()
        for handle in self._retries.values():
            handle.cancel()
        if self._takeover is not None:
            self._takeover.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._takeover
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
