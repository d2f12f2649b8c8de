"""How the router learns the InferenceServices, their engine pods, LoRA adapters and tenants (docs/router.md,
Discovery; docs/tenants.md).

``watch`` (the default): an informer (kube/informer.py) per kind and namespace
keeps the objects current from the API server's watch streams, and after a
change the route table is rebuilt from them: at once after a quiet spell, and
at most once per ``COALESCE_SECONDS`` while changes keep coming (a rollout
changing many pods costs a few rebuilds, not one per event). A pod turning
Ready is routable the moment its event arrives, plus at most that delay.

``list``: the listing every ``--discovery-interval-seconds`` that came first
(``Fleet.discover``), for clusters where the router may not watch.

Tenants are read either way: each namespace's InferenceTenants and the Secrets labelled
``gpufleet.dev/tenant-keys=true`` (the ones holding tenants' key records; no other Secret is read).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from gpufleet_api import API_VERSION, KIND
from gpufleet_api import engine_pods as names
from gpufleet_api.guard.adapters import ADAPTER_KIND
from gpufleet_api.tenants import usage
from gpufleet_kit.kube.informer import Informer, Watchable
from gpufleet_kit.kube.pods import is_serving

from .policy import adapters, tenancy
from .policy.table import Table, build_table

log = logging.getLogger("gpufleet_router")


class Discovery:
    WATCH = "watch"
    LIST = "list"


MODES = (Discovery.WATCH, Discovery.LIST)
# After a change, the routes are rebuilt at once, then at most this often while changes keep coming.
COALESCE_SECONDS = 0.1
ENGINE_PODS = names.engine_pods_selector()
# What the log says when the API server refuses the router a verb.
REFUSED_HINT = ("the router needs get, list and watch on InferenceServices, InferenceAdapters, InferenceTenants, pods "
                "and Secrets (only those labelled gpufleet.dev/tenant-keys=true are asked for; the chart's "
                "gpufleet-router ClusterRole grants them); where watch cannot be granted, run it with "
                "--discovery list (chart: router.discovery=list)")


class Scope(Protocol):
    namespaces: tuple[str, ...]
    guard_port: int
    discovery: str


class Routed(Protocol):
    """What of the router's Fleet discovery keeps current."""
    listed: asyncio.Event

    @property
    def settings(self) -> Scope: ...

    def update(self, table: Table, catalog: adapters.Catalog = adapters.EMPTY) -> None: ...

    def update_tenants(self, declarations: list[dict], secrets: list[dict],
                       unread: frozenset[str | None] = frozenset()) -> None: ...

    async def discover(self, kube) -> None: ...


def connections_needed(namespaces: tuple[str, ...]) -> int:
    """API connections a watching router holds open (a watch per kind and namespace), and room for more."""
    return 5 * max(1, len(namespaces)) + 8


async def run(fleet: Routed, kube: Watchable) -> None:
    """Keep ``fleet``'s routes current by the chosen way, until cancelled."""
    if fleet.settings.discovery == Discovery.LIST:
        await fleet.discover(kube)
    else:
        await Watcher(fleet, kube).run()


class Watcher:
    """The informers of the router's scope, and the loop that rebuilds the routes after they change."""

    def __init__(self, fleet: Routed, kube: Watchable, coalesce: float = COALESCE_SECONDS,
                 clock: Callable[[], float] = time.monotonic, **informer_options):
        self.fleet = fleet
        self.coalesce = coalesce
        self.clock = clock
        self.changed = asyncio.Event()
        self.builds = 0

        def informers(api_version: str, kind: str, label_selector: str | None = None) -> list[Informer]:
            return [Informer(kube, api_version, kind, ns, label_selector=label_selector, on_change=self.changed.set,
                             refused_hint=REFUSED_HINT, **informer_options)
                    for ns in fleet.settings.namespaces or (None,)]

        self.services = informers(API_VERSION, KIND)
        self.pods = informers("v1", "Pod", ENGINE_PODS)
        self.adapters = informers(API_VERSION, ADAPTER_KIND)
        self.tenants = informers(API_VERSION, usage.TENANTS_KIND)
        self.key_secrets = informers("v1", "Secret", tenancy.KEYS_SELECTOR)

    @property
    def informers(self) -> list[Informer]:
        return self.services + self.pods + self.adapters + self.tenants + self.key_secrets

    async def run(self) -> None:
        tasks = [asyncio.create_task(i.run(), name=f"router-watch {i}") for i in self.informers]
        try:
            # Routable once the services and pods are known; adapters and tenants once their first LIST
            # answered, either way (without their CRD, or without the right to list them, base models are
            # routed; a namespace whose declaration names Secrets the router cannot read refuses its callers).
            await asyncio.gather(*(i.synced.wait() for i in self.services + self.pods),
                                 *(i.tried.wait() for i in self.adapters + self.tenants + self.key_secrets))
            log.info("watching InferenceServices, engine pods, InferenceAdapters and InferenceTenants (%s); routes "
                     "rebuilt within %g s of a change", ", ".join(self.fleet.settings.namespaces) or "every namespace",
                     self.coalesce)
            while True:
                self.changed.clear()
                self.rebuild()
                built = self.clock()
                await self.changed.wait()
                await asyncio.sleep(max(0.0, built + self.coalesce - self.clock()))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def rebuild(self) -> None:
        services = [o for i in self.services for o in i.items()]
        pods = [o for i in self.pods for o in i.items()]
        items = [o for i in self.adapters for o in i.items()]
        table = build_table(services, pods, is_serving, self.fleet.settings.guard_port, adapters=items)
        self.fleet.update(table, adapters.build_catalog(items, table))
        # A namespace whose InferenceTenants were never listed (refused, or the API server failing; a kind not
        # served counts as listed: none can exist) is refused, never served anonymously.
        self.fleet.update_tenants([o for i in self.tenants for o in i.items()],
                                  [o for i in self.key_secrets for o in i.items()],
                                  frozenset(i.namespace for i in self.tenants if not i.synced.is_set()))
        self.fleet.listed.set()
        self.builds += 1
