"""The router's view of the fleet, kept current by two loops: the route table, adapters and tenants from the
API server (discovery.py watches, or ``discover`` lists), each replica's reading from its guard (``read``);
and the requests held through a cold start until a replica can answer them."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable, Sequence

import aiohttp

from gpufleet_api import API_VERSION, KIND
from gpufleet_api import engine_pods as names
from gpufleet_api import tracing as trace_names
from gpufleet_api.engine_pods import DECODE, ROLES, UNIFIED
from gpufleet_api.guard.adapters import ADAPTER_KIND
from gpufleet_api.guard.endpoints import GUARD_METRICS_PATH
from gpufleet_api.tenants import usage
from gpufleet_kit.http_limits import METRICS_REPLY_CAP, ReplyTooLarge, text_capped
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.errors import NotFound
from gpufleet_kit.kube.pods import is_serving
from gpufleet_kit.tracing import current

from . import cache_feed
from .loop_lag import LoopLag
from .metrics import RouterMetrics
from .policy import adapters, tenancy
from .policy import requests as rq
from .policy.choice import Picker
from .policy.cold_start import ColdStarts
from .policy.replicas import Reading
from .policy.signals import parse_guard
from .policy.table import Route, Table, build_table
from .prompt_tokens import PromptTokens
from .settings import RouterSettings

log = logging.getLogger("gpufleet_router")


@dataclasses.dataclass(frozen=True)
class Unserved:
    """Why a held request gets 503: its body (OpenAI's error shape) and Retry-After."""
    body: dict
    retry_after: float


class Fleet:
    """The route table and a picker per service and pool, kept current by two loops."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.lag = LoopLag(metrics, clock=clock)   # watched by serve(): retry windows leave out its stalls
        self.table = Table({})
        self.catalog = adapters.EMPTY       # the LoRA adapters in scope
        self.pickers: dict[tuple[str, str], Picker] = {}   # (model, role) -> that pool's picker
        self.listed = asyncio.Event()       # the first listing succeeded: the router can route
        self.draining = False
        self._problems: tuple[str, ...] = ()
        self._adapter_items: list[dict] = []   # the last InferenceAdapters listed
        self.tenancies: dict[str, tenancy.Tenancy | tenancy.Closed] = {}   # namespace -> its tenants
        self._tenant_problems: tuple[str, ...] = ()
        # Namespaces (None: all) whose InferenceTenants were never read: refused rather than served anonymously.
        self.tenants_unread: frozenset[str | None] = frozenset()
        self._tenant_items: tuple[list[dict], list[dict]] = ([], [])   # the last declarations and Secrets listed
        self._tenants_listed: set[str | None] = set()     # namespaces whose InferenceTenants were listed once
        metrics.limits_in_use = self._limits_in_use
        self.held: dict[str, collections.deque[asyncio.Future]] = {}
        self.cold_since: dict[str, float] = {}   # model -> when its first request found no replica
        self.cold_starts: dict[str, ColdStarts] = {}
        # model -> its tokenizer, from one of its guards (cache_feed.py): the prompts' token blocks, which
        # the guards' feeds of their prefix caches are looked up by.
        self.tokenizers: dict[str, PromptTokens] = {}
        self._tokenizer_asked: set[str] = set()   # models whose tokenizer is being fetched now

    def update(self, table: Table, catalog: adapters.Catalog = adapters.EMPTY) -> None:
        problems = table.problems + catalog.problems
        for problem in set(problems) - set(self._problems):
            log.warning("%s", problem)
        self._problems = problems
        self.table = table
        self.catalog = catalog
        for model, route in table.routes.items():
            for role in ROLES:
                factor = self.settings.tier_load_factor if route.kv_tier else self.settings.load_factor
                picker = self.pickers.setdefault((model, role), Picker(factor, self.settings.policy))
                picker.load_factor = factor
                picker.canary_revision, picker.canary_percent = route.canary_revision, route.canary_weight
                picker.set_replicas(route.pool(role))
        for model, role in [key for key in self.pickers if key[0] not in table.routes]:
            del self.pickers[(model, role)]
        self._prune(table, catalog)
        self._count_replicas()
        self.release_held()

    def update_tenants(self, declarations: list[dict], secrets: list[dict],
                       unread: frozenset[str | None] = frozenset()) -> None:
        """The tenants of each namespace from its InferenceTenants and the labelled Secrets (tenancy.py);
        a limiter and the last good declaration are kept across updates. ``unread``: the namespaces (None:
        every one) whose InferenceTenants could not be read yet; their requests are refused (503)."""
        self.tenants_unread = unread
        built = tenancy.build(declarations, secrets, self.tenancies, self.clock())
        for problem in sorted(set(built.problems) - set(self._tenant_problems)):
            log.warning("%s", problem)
        self._tenant_problems = built.problems
        self.tenancies = built.namespaces
        self.metrics.prune_tenants({ns: t.declared for ns, t in built.namespaces.items()
                                    if isinstance(t, tenancy.Tenancy)})

    def _limits_in_use(self) -> list[tuple[str, str, str, float]]:
        now = self.clock()
        return [(ns, tenant, limit, used) for ns, t in self.tenancies.items() if isinstance(t, tenancy.Tenancy)
                for tenant, limit, used in t.limiter.used(now)]

    def _prune(self, table: Table, catalog: adapters.Catalog) -> None:
        """Forget what the router keeps per model, service or adapter once it leaves the table or the catalog:
        requests held for it (they time out where they wait), its cold-start clock and history, and its
        metrics' label sets (the series of a service that is gone end, as a pod's do)."""
        models = set(table.routes)
        for state in (self.held, self.cold_since, self.cold_starts, self.tokenizers):
            for model in [m for m in state if m not in models]:
                del state[model]
        self.metrics.prune(models=models, adapters=set(catalog.adapters),
                           services={(r.namespace, r.service) for r in table.routes.values()})

    def picker(self, model: str, role: str = UNIFIED) -> Picker | None:
        return self.pickers.get((model, role))

    def serving_pool(self, model: str) -> str | None:
        """The pool that answers the service's requests now: decode (after a prefill) when a decode
        replica can take them, else unified, else None (held). Decode first: while a rollout turns a
        unified service into pools, the new pools take over as soon as a decode replica is ready."""
        for role in (DECODE, UNIFIED):
            picker = self.picker(model, role)
            if picker is not None and picker.eligible():
                return role
        return None

    def _count_replicas(self) -> None:
        for (model, role), picker in self.pickers.items():
            self.metrics.replicas.labels(model, role).set(len(picker.eligible()))

    async def list_once(self, kube: KubeClient) -> None:
        services: list[dict] = []
        pods: list[dict] = []
        selector = names.engine_pods_selector()
        for ns in self.settings.namespaces or (None,):
            services += await kube.list(API_VERSION, KIND, ns)
            pods += await kube.list("v1", "Pod", ns, label_selector=selector)
        items = await self._list_adapters(kube)
        # The adapters claim names too: the table leaves out a service whose name another namespace's adapter
        # claimed first, and the catalog serves the adapters that own theirs.
        table = build_table(services, pods, is_serving, self.settings.guard_port, adapters=items)
        self.update(table, adapters.build_catalog(items, table))
        self.update_tenants(*await self._list_tenants(kube))
        self.listed.set()

    async def _list_tenants(self, kube: KubeClient) -> tuple[list[dict], list[dict], frozenset[str | None]]:
        """The InferenceTenants and the tenants' key Secrets in scope, as the watch reads them, and the
        namespaces whose InferenceTenants were never listed. Without the CRD there are none. A namespace
        whose listing fails keeps what was last listed there; one never listed is refused (a namespace
        that declared tenants is never served anonymously because a listing failed). Secrets that cannot be
        listed (the chart's router.tenants.readKeySecrets off) leave those tenants without keys."""
        last_declarations, last_secrets = self._tenant_items
        declarations: list[dict] = []
        secrets: list[dict] = []
        unread: set[str | None] = set()
        for ns in self.settings.namespaces or (None,):
            def here(items: list[dict], ns: str | None = ns) -> list[dict]:
                return [o for o in items if ns is None or o["metadata"].get("namespace") == ns]
            try:
                declarations += await kube.list(API_VERSION, usage.TENANTS_KIND, ns)
                self._tenants_listed.add(ns)
            except NotFound:
                self._tenants_listed.add(ns)
            except Exception as e:
                log.warning("cannot list the InferenceTenants of %s (as last listed): %s", ns or "the cluster", e)
                declarations += here(last_declarations)
                if ns not in self._tenants_listed:
                    unread.add(ns)
            try:
                secrets += await kube.list("v1", "Secret", ns, label_selector=tenancy.KEYS_SELECTOR)
            except Exception as e:
                log.warning("cannot list the tenants' key Secrets of %s (as last listed): %s", ns or "the cluster", e)
                secrets += here(last_secrets)
        self._tenant_items = (declarations, secrets)
        return declarations, secrets, frozenset(unread)

    async def _list_adapters(self, kube: KubeClient) -> list[dict]:
        """The InferenceAdapters in scope. Without their CRD (a chart older than adapters) there are none;
        when they cannot be listed, the last ones listed are kept so that base models are still routed."""
        items: list[dict] = []
        try:
            for ns in self.settings.namespaces or (None,):
                items += await kube.list(API_VERSION, ADAPTER_KIND, ns)
        except NotFound:
            return []
        except Exception as e:
            log.warning("cannot list InferenceAdapters (adapters served as last listed): %s", e)
            return self._adapter_items
        self._adapter_items = items
        return items

    async def discover(self, kube: KubeClient) -> None:
        while True:
            try:
                await self.list_once(kube)
            except Exception as e:  # keep routing on the last table; say why it is not refreshed
                log.warning("cannot list InferenceServices and engine pods: %s", e)
            await asyncio.sleep(self.settings.discovery_interval)

    async def read_once(self, http: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.reading_timeout)

        async def read(model: str, picker: Picker, pod: str, address: str) -> None:
            taken_at = self.clock()
            reading: Reading | None
            try:
                async with http.get(f"http://{address}{GUARD_METRICS_PATH}", timeout=timeout) as r:
                    if r.status != 200:
                        raise RuntimeError(f"answered {r.status}")
                    reading = parse_guard(await text_capped(r, METRICS_REPLY_CAP, f"{pod} ({address})"), taken_at)
            except ReplyTooLarge as e:  # unreadable, and said: a guard's /metrics is never this large
                log.warning("cannot read %s", e)
                self.metrics.readings_failed.labels(model).inc()
                reading = None
            except Exception as e:  # unreadable: its room is unknown until the next read
                log.debug("cannot read %s (%s): %s", pod, address, e)
                self.metrics.readings_failed.labels(model).inc()
                reading = None
            picker.observe(pod, reading)
            if reading is not None and reading.ready:
                follows = await cache_feed.read_feed(http, picker, pod, address, timeout, taken_at)
                if follows and model not in self.tokenizers and model not in self._tokenizer_asked:
                    self._tokenizer_asked.add(model)
                    try:
                        tokenizer = await cache_feed.read_tokenizer(http, address, timeout)
                    finally:
                        self._tokenizer_asked.discard(model)
                    if tokenizer is not None:
                        self.tokenizers[model] = tokenizer

        await asyncio.gather(*(read(model, picker, r.pod, r.address)
                               for (model, _role), picker in list(self.pickers.items())
                               for r in picker.replicas.values() if r.serving))
        self._count_replicas()
        self.release_held()

    def tokenize(self, doc: dict, route: str, target: Route) -> Sequence[int] | None:
        """The prompt's token ids as the service's vLLM tokenizes them (placement.Tokenize); None without a
        tokenizer from its guards."""
        tokenizer = self.tokenizers.get(target.model)
        return tokenizer.ids(doc, route) if tokenizer is not None else None

    # --- requests held through a cold start ------------------------------------------

    def cold(self, model: str) -> ColdStarts:
        return self.cold_starts.setdefault(model, ColdStarts())

    async def hold(self, model: str, deadline: float) -> bool:
        """Wait, in arrival order, until the service has a replica to answer (serving_pool); False
        at the deadline."""
        queue = self.held.setdefault(model, collections.deque())
        self.cold_since.setdefault(model, self.clock())
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        self.metrics.held_total.labels(*self._service(model)).inc()
        self.metrics.held.labels(*self._service(model)).set(len(queue))
        try:
            await asyncio.wait_for(asyncio.shield(waiter), max(0.0, deadline - self.clock()))
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if waiter in queue:
                queue.remove(waiter)
            self.metrics.held.labels(*self._service(model)).set(len(queue))

    async def wait_for_pool(self, model: str, target: Route, arrived: float, deadline: float) -> Unserved | None:
        """Hold a request for a service no pool can answer now (no replica yet, all starting, scaled to zero)
        until one can (None), or say why not (503): too many held already, or none ready by ``deadline``.
        Both front doors hold this way: the router's requests and the endpoint picker's."""
        if self.held_count(model) >= self.settings.hold_max_requests:
            return Unserved(rq.error_body(
                f"{self.settings.hold_max_requests} requests already wait for a replica of "
                f"{target.namespace}/{target.service} (model {model!r}); retry later.",
                "service_unavailable", code="hold_queue_full"), self.cold(model).retry_after(self.clock() - arrived))
        trace = current()
        held_at = self.clock()
        span = trace.step(trace_names.ROUTER_HOLD_SPAN, {trace_names.SERVICE: target.service} if trace.on else None)
        ready = await self.hold(model, deadline)
        if trace.on:
            trace.end_step(span, {trace_names.HOLD_SECONDS: self.clock() - held_at},
                           error="" if ready else "no replica became ready")
        if not ready:
            waited = self.clock() - arrived
            return Unserved(rq.error_body(
                f"No replica of {target.namespace}/{target.service} (model {model!r}) became ready "
                f"within {waited:.0f}s.", "service_unavailable", code="no_ready_replica"),
                self.cold(model).retry_after(waited))
        return None

    def _service(self, model: str) -> tuple[str, str]:
        route = self.table.routes.get(model)
        return (route.namespace, route.service) if route else ("", model)

    def held_count(self, model: str) -> int:
        return len(self.held.get(model, ()))

    def release_held(self) -> None:
        """Wake the requests held for each service that now has a replica to answer, first come first."""
        for model in self.table.routes:
            if self.serving_pool(model) is None:
                continue
            started = self.cold_since.pop(model, None)
            if started is not None:
                seconds = self.clock() - started
                self.cold(model).record(seconds)
                self.metrics.cold_start_seconds.labels(*self._service(model)).observe(seconds)
                log.info("%s: a replica is ready %.1fs after the first request found none", model, seconds)
            queue = self.held.get(model)
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)
            if queue is not None:
                self.metrics.held.labels(*self._service(model)).set(0)

    async def read(self, http: aiohttp.ClientSession) -> None:
        while True:
            started = self.clock()
            await self.read_once(http)
            await asyncio.sleep(max(0.0, self.settings.reading_interval - (self.clock() - started)))
