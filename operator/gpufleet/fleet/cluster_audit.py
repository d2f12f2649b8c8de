"""Cluster-wide audits on a timer: stranded GPUs and isolation verification."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable, Container, Sequence

from gpufleet_api import InferenceServiceSpec, SpecError, parse_spec
from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.errors import ApiError

from ..audit.stranded import StrandedNode, find_stranded, node_inventory
from ..autoscale.takeover import AUDITS_WAIT_S
from ..isolation.verify import PodsByNode, Violation, violations_for
from ..manifests import names
from ..manifests.pools import pools
from ..metrics import OperatorMetrics
from ..reconcile import conditions as cond
from .ports import EventRecorder, Key, Leadership, ObjectLister, StatusWriter

log = logging.getLogger(__name__)


# The pods the audits look at: those on a node and not finished (an unscheduled or completed pod holds
# no GPU and shares no node). At 1000 services with most replicas Pending, the listing shrinks to the
# running ones.
PLACED_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


async def collect(objects: ObjectLister, namespaces: Sequence[str] = ()) -> tuple[list[dict], list[dict], list[dict]]:
    """Every node, every placed pod of the cluster (whatever its namespace: a foreign pod on a GPU node
    is what the audits look for), and the InferenceServices: of ``namespaces`` one by one, or of the
    cluster (``()``)."""
    nodes, pods, *by_namespace = await asyncio.gather(
        objects.list("v1", "Node"), objects.list("v1", "Pod", field_selector=PLACED_PODS),
        *(objects.list(t.API_VERSION, t.KIND, ns) for ns in namespaces or (None,)))
    return nodes, pods, [s for services in by_namespace for s in services]


def parsed_specs(services: list[dict]) -> list[tuple[dict, InferenceServiceSpec]]:
    out: list[tuple[dict, InferenceServiceSpec]] = []
    for s in services:
        try:
            out.append((s, parse_spec(s.get("spec"))))
        except SpecError:
            continue
    return out


def audit_report(nodes: list[dict], pods: list[dict], services: list[dict]) -> dict:
    """Everything `gpufleet audit` prints; pure."""
    specs = parsed_specs(services)
    # A disaggregated service places replicas of two shapes (each pool its own resources).
    shapes = [pool.spec for _, s in specs for pool in pools(s)]
    stranded = find_stranded(node_inventory(nodes, pods), shapes)
    isolation = {}
    by_node = PodsByNode(pods)
    for obj, spec in specs:
        meta = obj["metadata"]
        v = violations_for(meta["name"], meta["namespace"], spec.isolation.mode,
                           names.model_label(spec.model.name), by_node.near(meta["namespace"], meta["name"]))
        isolation[(meta["namespace"], meta["name"])] = v
    return {"stranded": stranded, "isolation": isolation, "specs": specs}


class ClusterAuditor:
    """``watched``: the services this operator watches (its --namespace); only theirs get
    isolation status. ``namespaces``: where to list the services (``collect``; () the cluster).
    ``leadership``: only the leader audits (None: always, one operator).
    ``first_pass``: what a new leader's first audit waits for, at most ``AUDITS_WAIT_S`` (the fleet
    loop's first pass: listing every node, pod and service must not delay its scale-outs)."""

    def __init__(self, *, objects: ObjectLister, events: EventRecorder, status: StatusWriter,
                 metrics: OperatorMetrics, watched: Container[Key], leadership: Leadership | None = None,
                 interval: float = 15.0, first_pass: Callable[[], Awaitable[None]] | None = None,
                 namespaces: Sequence[str] = ()):
        self.objects = objects
        self.namespaces = tuple(namespaces)
        self.events = events
        self.status = status
        self.metrics = metrics
        self.watched = watched
        self.leadership = leadership
        self.interval = interval
        self.first_pass = first_pass
        # node -> (free, why) last reported: an Event is recorded when a node becomes
        # stranded or the reason/amount changes, not on every audit pass.
        self._stranded_seen: dict[str, tuple[int, str]] = {}

    async def run_forever(self) -> None:
        while True:
            if self.leadership is not None and not self.leadership.acting():
                await self.leadership.wait_leading()  # only the leader audits (and writes status and Events)
                await self.after_first_pass()
            try:
                await self.run_once()
            except ApiError as e:
                log.warning("cluster audit failed: %s", e)
            except Exception:
                log.exception("cluster audit crashed")
            await asyncio.sleep(self.interval)

    async def after_first_pass(self) -> None:
        """A new leader's first audit waits for its fleet loop's first pass, at most AUDITS_WAIT_S."""
        if self.first_pass is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.first_pass(), AUDITS_WAIT_S)

    async def run_once(self) -> dict:
        nodes, pods, services = await collect(self.objects, self.namespaces)
        report = audit_report(nodes, pods, services)
        await self._publish_stranded(report["stranded"], nodes)
        for obj, spec in report["specs"]:
            meta = obj["metadata"]
            key = (meta["namespace"], meta["name"])
            if key in self.watched:  # only the services this operator watches (its --namespace)
                await self._publish_isolation(obj, spec, report["isolation"][key])
        return report

    async def _publish_stranded(self, stranded: list[StrandedNode], nodes: list[dict]) -> None:
        totals: dict[tuple[str, str], int] = {}
        for n in nodes:  # zero every known pool/product so a cleared condition shows as 0
            labels = n["metadata"].get("labels", {})
            if "nvidia.com/gpu.product" in labels:
                totals[(labels.get(names.LABEL_POOL, ""), labels["nvidia.com/gpu.product"])] = 0
        for s in stranded:
            totals[(s.pool, s.product)] = totals.get((s.pool, s.product), 0) + s.free
        for (pool, product), free in totals.items():
            self.metrics.stranded.labels(pool, product).set(free)
        now = {s.node: (s.free, s.why) for s in stranded}
        by_name = {n["metadata"]["name"]: n for n in nodes}
        for s in stranded:
            if self._stranded_seen.get(s.node) != now[s.node] and s.node in by_name:
                await self.events.event(by_name[s.node], reason="StrandedGPUs", type_="Warning",
                                         message=f"{s.free} free GPU(s) no InferenceService can use: {s.why}")
        self._stranded_seen = now

    async def _publish_isolation(self, obj: dict, spec: InferenceServiceSpec, violations: list[Violation]) -> None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        self.metrics.isolation_violations.labels(ns, name).set(len(violations))
        status = obj.get("status") or {}
        if spec.isolation.mode == "Shared":
            return
        listed = [f"{v.pod} on {v.node}: {v.why}" for v in violations]
        gen = meta.get("generation")
        if violations:
            new = cond.condition(cond.ISOLATED, False, "ViolationFound", "; ".join(listed)[:1000], generation=gen)
        else:
            new = cond.condition(cond.ISOLATED, True, "Verified",
                                 f"{spec.isolation.mode}: no foreign pods on this service's nodes", generation=gen)
        old = cond.get(status.get("conditions"), cond.ISOLATED) or {}
        if old.get("reason") == new["reason"] and old.get("message") == new["message"] and \
                old.get("observedGeneration") == gen and status.get("isolationViolations", []) == listed:
            return
        await self.status.write_status(obj, {"isolationViolations": listed}, [new])
        if violations:
            await self.events.event(obj, reason="IsolationViolated", type_="Warning", message="; ".join(listed))
        elif old.get("reason") == "ViolationFound":
            await self.events.event(obj, reason="IsolationRestored", message=new["message"])
