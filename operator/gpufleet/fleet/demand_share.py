"""Hand the output lengths a service's replicas learned to the replicas it adds.

A guard that has not seen 16 answers of a (route, class) reserves each
request's whole budget: a service's first replica must, but a replica added
by a scale-out would refuse much of the load it was added for, at the moment
it is needed most (issue 28). So every ``SHARE_SECONDS`` (and at once when a
replica is starting, if the last look is older than ``STARTING_SECONDS``)
this reads ``GET /demand`` from up to ``READ_REPLICAS`` ready replicas,
pools them and, when the pooled distribution moved (a new key, or a mean by
10% or more), applies it as ``demand.json`` in the service's guard
ConfigMap. A new pod's guard reads it at start (and a starting guard picks
up a later version while it has not learned a key itself):
``gpufleet_api/guard/demand_prior.py``.

Cost: one small GET per replica read per service every 30 s, and a
ConfigMap write only when the answers' lengths really change.
"""
from __future__ import annotations

import asyncio
import logging
import zlib

from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.demand_prior import DemandPrior
from gpufleet_kit.kube.errors import ApiError

from ..manifests.children import DEMAND_FIELD_MANAGER, build_demand_prior
from .ports import DemandSource, ObjectApplier

log = logging.getLogger(__name__)

SHARE_SECONDS = 30.0
STARTING_SECONDS = 5.0
READ_REPLICAS = 3


def due(now: float, last_look: float | None, starting: bool, first_look: float) -> bool:
    """Whether to read the replicas' lengths now: every SHARE_SECONDS from ``first_look`` on, and
    sooner while a replica is starting (it reads demand.json as it starts)."""
    if last_look is None:
        return now >= first_look or starting
    gap = now - last_look
    return gap >= SHARE_SECONDS or (starting and gap >= STARTING_SECONDS)


def first_look(service: str, namespace: str, started: float) -> float:
    """Services spread over the first SHARE_SECONDS (a new leader with 1000 services does not read
    them all in its first second), at the same offset for the same service."""
    return started + (zlib.crc32(f"{namespace}/{service}".encode()) % 1000) / 1000 * SHARE_SECONDS


class DemandShare:
    """One service's sharing state: when it last looked, and what it last wrote."""

    def __init__(self, objects: ObjectApplier, replicas: DemandSource, namespace: str, name: str):
        self.objects = objects
        self.replicas = replicas
        self.ns, self.name = namespace, name
        self.last_look: float | None = None
        self.first_look: float | None = None
        # What this operator process last wrote; None: nothing yet (a new leader writes once).
        self.written: DemandPrior | None = None

    async def tick(self, body: dict, ready: list[dict], pods: list[dict], now: float) -> None:
        if self.first_look is None:
            self.first_look = first_look(self.name, self.ns, now)
        starting = any(not p["ready"] and not p["deleting"] for p in pods)
        if not ready or not due(now, self.last_look, starting, self.first_look):
            return
        self.last_look = now
        read = await asyncio.gather(*(self.replicas.demand(p["name"], p["ip"]) for p in ready[:READ_REPLICAS]))
        pooled = demand_prior.merge(p for p in read if p is not None)
        if not demand_prior.differs(pooled, self.written):
            return
        try:
            await self.objects.apply(build_demand_prior(body, pooled), field_manager=DEMAND_FIELD_MANAGER)
        except ApiError as e:
            log.warning("%s/%s: could not write the learned output lengths: %s", self.ns, self.name, e)
            return
        self.written = pooled
        learned = [f"{k.route} {k.queue_class}: mean {k.mean:.0f} tokens of {k.samples}" for k in pooled.keys]
        if pooled.held is not None:
            learned.append(f"{pooled.held.blocks:.1f} blocks held per request")
        log.info("%s/%s: what the replicas learned is shared with new ones: %s", self.ns, self.name,
                 "; ".join(learned))
