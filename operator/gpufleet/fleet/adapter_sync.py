"""Keep a service's replicas holding the adapters placed on them, and the InferenceAdapters' status.

Run from the service's loop (``ServiceLoop``) every ``SYNC_SECONDS``, and at once when
the service's adapters or ready replicas change. One pass:

1. ``GET /adapters`` from each ready replica (the ones in backoff skipped): what each holds;
2. ``adapters.desired.plan``: the whole set each replica should hold, from placement over
   the adapters' request rates (``adapters.rates``, from the samples the loop reads anyway);
3. ``PUT /adapters`` to each replica whose report differs from its set, or that has not been
   sent this set by this operator process. A replica that restarted or was just added reports
   nothing, so it is sent its set on the first pass that sees it ready; the router sends an
   adapter's requests only to replicas whose report says Loaded, so it takes them once loaded;
4. each InferenceAdapter's status (``adapters.status``), written only when it changed, with
   an Event when its failure reason changes; a change of its request rate alone at most every
   ``figures_interval`` seconds (``reconcile.figures``), a rate that moved also with any other change.

A replica that cannot be read or refuses a PUT is left alone for a growing while (backoff, up
to ``BACKOFF_MAX_S``), so one broken guard costs neither the others nor the API server.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from gpufleet_api import InferenceServiceSpec, redact
from gpufleet_api import v1alpha1 as t
from gpufleet_api.guard.adapters import AdapterReport, AdapterSet
from gpufleet_kit.backoff import KeyedBackoff
from gpufleet_kit.kube.errors import ApiError, NotFound

from ..adapters import desired
from ..adapters import status as adapter_status
from ..adapters.index import Adapter
from ..adapters.rates import AdapterRates
from ..autoscale.signals import ReplicaSample
from ..reconcile import conditions as cond
from ..reconcile import figures, name_conflicts
from .ports import ServicePorts

log = logging.getLogger(__name__)

SYNC_SECONDS = 5.0
BACKOFF_MIN_S = 2.0
BACKOFF_MAX_S = 60.0


class AdapterSync:
    def __init__(self, ports: ServicePorts, namespace: str, name: str,
                 figures_interval: float = figures.DEFAULT_INTERVAL_S):
        self.ports = ports
        self.ns, self.name = namespace, name
        self.rates = AdapterRates()
        self.backoff: KeyedBackoff[str] = KeyedBackoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
        self.last_sync: float | None = None
        self.seen: tuple = ()
        self.sent: dict[str, AdapterSet] = {}     # replica → the set this process last PUT there
        self.status = StatusWriter(ports, figures_interval)

    def observe(self, samples: Sequence[ReplicaSample], now: float) -> None:
        """The adapters' request counters of this tick's reads (for their rates)."""
        for s in samples:
            if s.ok:
                self.rates.observe(s.pod, s.adapter_requests, now)
        self.rates.forget_except(s.pod for s in samples)

    def due(self, adapters: Sequence[Adapter], ready: Sequence[dict], now: float) -> bool:
        seen = (tuple((a.name, a.generation) for a in adapters), tuple(sorted(p["name"] for p in ready)))
        changed, self.seen = seen != self.seen, seen
        return changed or self.last_sync is None or now - self.last_sync >= SYNC_SECONDS

    async def tick(self, spec: InferenceServiceSpec, ready: Sequence[dict], adapters: Sequence[Adapter],
                   now: float) -> None:
        lora = spec.engine.lora
        if lora is None:
            # Nothing to send (no replica of this service loads adapters); the adapters say why.
            for a in adapters:
                await self.status.write(a, adapter_status.lora_disabled(self.name, a.generation))
            return
        # Also with no adapter left: a replica may still hold one that was deleted.
        if not self.due(adapters, ready, now):
            return
        self.last_sync = now
        names = {p["name"] for p in ready}
        self.backoff.forget_except(names)
        self.sent = {r: s for r, s in self.sent.items() if r in names}
        readable = [p for p in ready if not self.backoff.waiting(p["name"], now)]
        answers = await asyncio.gather(*(self.ports.replicas.adapters(p["name"], p["ip"]) for p in readable))
        reports: dict[str, AdapterReport | None] = {}
        for p, (report, error) in zip(readable, answers):
            reports[p["name"]] = report
            if report is None:
                delay = self.backoff.failed(p["name"], now)
                log.warning("%s/%s: cannot read %s's adapters (retry in %.0fs): %s", self.ns, self.name,
                            p["name"], delay, error)
        rates = self.rates.rates()
        plan = desired.plan(adapters, [p["name"] for p in ready], lora, reports, rates)
        await asyncio.gather(*(self.send(p, plan.sets[p["name"]], reports.get(p["name"]), now)
                               for p in readable if reports.get(p["name"]) is not None))
        for a in adapters:
            seen = adapter_status.Observed(holders=plan.holders(a.name), reports=reports,
                                           rate=rates.get(a.name, 0.0), refusal=plan.refused.get(a.name))
            await self.status.write(a, adapter_status.adapter_status(a.name, self.name, a.generation, seen))

    async def send(self, pod: dict, wanted: AdapterSet, report: AdapterReport | None, now: float) -> None:
        name = pod["name"]
        if not desired.needs_put(report, wanted) and self.sent.get(name) == wanted:
            return
        error = await self.ports.replicas.put_adapters(name, pod["ip"], wanted)
        if error is not None:
            delay = self.backoff.failed(name, now)
            log.warning("%s/%s: %s refused its adapters %s (retry in %.0fs): %s", self.ns, self.name, name,
                        [a.name for a in wanted.adapters], delay, redact.text(str(error)))
            return
        self.backoff.succeeded(name)
        self.sent[name] = wanted
        log.info("%s/%s: %s holds adapters %s", self.ns, self.name, name, [a.name for a in wanted.adapters])

    def forget(self, adapter: str) -> None:
        self.status.forget(self.ns, adapter)


class StatusWriter:
    """InferenceAdapters' status as this process last wrote it: a write only when it changed, and
    when only the request rate moved, at most every ``figures_interval`` seconds (0: at once)."""

    def __init__(self, ports: ServicePorts, figures_interval: float = figures.DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.ports = ports
        self.figures_interval = figures_interval
        self.clock = clock
        self.written: dict[tuple[str, str], dict] = {}   # (namespace, adapter) → the status last written
        self.rate_written: dict[tuple[str, str], float] = {}  # (namespace, adapter) → when its rate was

    async def write(self, adapter: Adapter, new: dict) -> None:
        """Write an adapter's status when it changed; an Event when its failure reason did."""
        key = (adapter.namespace, adapter.name)
        old = self.written.get(key) or adapter.status
        conflict = self.ports.names.conflict(t.ADAPTER_KIND, adapter.namespace, adapter.name)
        named = name_conflicts.condition(conflict, old.get("conditions"), adapter.generation)
        new = {**new, "conditions": [*new["conditions"], *named]}
        now = self.clock()
        if not adapter_status.differs(old, new) and not (
                adapter_status.rate_moved(old, new)
                and figures.due(self.rate_written.get(key), now, self.figures_interval)):
            return
        rate = new.get(adapter_status.RATE)
        if rate is not None and rate != old.get(adapter_status.RATE):
            new = {**new, figures.TIME_FIELD: cond.now_iso()}
            self.rate_written[key] = now
        await write_status(self.ports, adapter, old, new)
        self.written[key] = new

    def forget(self, namespace: str, adapter: str) -> None:
        self.written.pop((namespace, adapter), None)
        self.rate_written.pop((namespace, adapter), None)

    def keep_only(self, adapters: Sequence[Adapter]) -> None:
        live = {(a.namespace, a.name) for a in adapters}
        self.written = {k: v for k, v in self.written.items() if k in live}
        self.rate_written = {k: v for k, v in self.rate_written.items() if k in live}


async def write_status(ports: ServicePorts, adapter: Adapter, old: dict, new: dict) -> None:
    before, after = adapter_status.failure_reason(old), adapter_status.failure_reason(new)
    ready = cond.get(new["conditions"], cond.READY) or {}
    try:
        await ports.objects.merge_patch(t.API_VERSION, t.ADAPTER_KIND, adapter.name,
                                        {"status": adapter_status.merged(old, new, cond.now_iso())},
                                        adapter.namespace, subresource="status")
    except NotFound:
        return  # deleted meanwhile
    except ApiError as e:
        log.warning("%s/%s: could not write the adapter's status: %s", adapter.namespace, adapter.name, e)
        return
    involved = {"apiVersion": t.API_VERSION, "kind": t.ADAPTER_KIND, "metadata": adapter.body.get("metadata", {})}
    conflict = name_conflicts.started(old.get("conditions"), new["conditions"])
    if conflict is not None:
        await ports.events.event(involved, reason=cond.NAME_CONFLICT, type_="Warning", message=conflict)
    if after is not None and after != before:
        await ports.events.event(involved, reason=after, type_="Warning", message=ready.get("message", ""))
    elif before is not None and after is None and ready.get("status") == "True":
        await ports.events.event(involved, reason=adapter_status.LOADED, message=ready.get("message", ""))


class OrphanAdapters:
    """Adapters whose service does not exist: Ready=False, ServiceNotFound. Judged only after
    ``GRACE_S`` of watching, so an adapter listed before its service is not called an orphan."""
    GRACE_S = 10.0

    def __init__(self, ports: ServicePorts):
        self.status = StatusWriter(ports)

    async def tick(self, adapters: Sequence[Adapter], watching_for: float) -> None:
        if watching_for < self.GRACE_S:
            return
        self.status.keep_only(adapters)
        for a in adapters:
            await self.status.write(a, adapter_status.service_not_found(a.service, a.namespace, a.generation))
