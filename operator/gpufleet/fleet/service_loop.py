"""Per-InferenceService control loop: one tick reads the replicas and hands them to each collaborator.

Ticked by the shared ``FleetLoop`` (one per operator). The loop does the reads of every tick
(the ready replicas, their samples, the TTFT p99 window) and writes the fast-moving status figures
(KV usage and TTFT p99, at most every ``figures_interval`` seconds, everything else at once:
``reconcile.figures``) with the Scaling condition. Each job is a collaborator's:

- ``autoscaler.ServiceAutoscaler``: the unified pool's or each pool's decisions, applied under the
  service's lock, and the Scaling condition;
- ``scale_in_marks.ScaleInMarks``: the pod-deletion-cost mark before a scale-in, cleared from a
  replica that outlives it;
- ``ratio_meter.RatioMeter``: a disaggregated service's live prefill:decode ratio;
- ``fragmentation_audit.FragmentationAuditor``: the fragmentation audit and the restart of a
  replica losing memory;
- ``adapter_sync.AdapterSync``, ``canary.CanaryLoop``, ``demand_share.DemandShare``: the adapters,
  a canary rollout, and the learned answer lengths shared with new replicas.

A follower makes the same reads into the same state and writes nothing (``follow``), so that a new
leader decides on what the old one would have seen (``take_over``).
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Sequence

from gpufleet_api import InferenceServiceSpec, SpecError, parse_spec

from ..adapters.index import Adapter
from ..autoscale.signals import ReplicaSample, bucket_delta, quantile_from_buckets
from ..autoscale.takeover import Warm
from ..reconcile import figures
from .adapter_sync import AdapterSync
from .autoscaler import ServiceAutoscaler
from .canary import SLI_WRITE_S, CanaryLoop
from .demand_share import DemandShare
from .fragmentation_audit import FragmentationAuditor
from .pod_views import readable_replicas, role_of, samples_by_role
from .ports import ServicePorts
from .ratio_meter import RatioMeter
from .scale_in_marks import ScaleInMarks

TTFT_WINDOW_S = 60


class ServiceLoop:
    """``figures_interval``: seconds between writes of the fast-moving status figures
    (``reconcile.figures``; 0: every change)."""

    def __init__(self, ports: ServicePorts, namespace: str, name: str,
                 figures_interval: float = figures.DEFAULT_INTERVAL_S):
        self.ports = ports
        self.ns, self.name = namespace, name
        self.ttft_history: collections.deque = collections.deque()
        self._spec_key: tuple | None = None
        self._spec: InferenceServiceSpec | None = None
        self.figures = figures.FigurePacer(figures_interval)
        self.marks = ScaleInMarks(ports, namespace, name)
        self.autoscaler = ServiceAutoscaler(ports, namespace, name, self.marks, self.figures)
        self.ratio = RatioMeter()
        self.fragmentation = FragmentationAuditor(ports, namespace, name, self.autoscaler.scaling_in)
        self.demand_share = DemandShare(ports.objects, ports.replicas, namespace, name)
        self.adapters = AdapterSync(ports, namespace, name, figures_interval=figures_interval)
        self.canary = CanaryLoop(ports, namespace, name, sli_write_seconds=max(SLI_WRITE_S, figures_interval))
        self.warm: Warm | None = None  # the last reading as a follower, until this loop leads (``take_over``)

    def spec_of(self, body: dict) -> InferenceServiceSpec | None:
        """The parsed spec, parsed once per generation; None when invalid."""
        meta = body.get("metadata", {})
        key = (meta.get("uid"), meta.get("generation"))
        if key != self._spec_key or key == (None, None):
            try:
                self._spec = parse_spec(body.get("spec"))
            except SpecError:
                self._spec = None
            self._spec_key = key
        return self._spec

    # --- reading ---------------------------------------------------------------

    async def read_replicas(self, spec: InferenceServiceSpec, pods: list[dict], now: float, *,
                            leading: bool = True) -> tuple[list[dict], list[ReplicaSample], float | None]:
        """The reads of every tick, the leader's and a follower's alike, into this loop's state: the
        ready replicas, their samples, and the TTFT p99 for status (its window advanced); the adapters'
        request rates and the decode pool's token window advanced too. A follower (``leading``
        False) counts no read errors: it exports no per-service series."""
        ready = readable_replicas(pods)
        samples = list(await asyncio.gather(*(self.ports.replicas.sample(p["name"], p["ip"]) for p in ready)))
        if leading:
            for s in samples:
                if not s.ok:
                    self.ports.metrics.read_errors.labels(self.ns, self.name).inc()
        if spec.engine.lora is not None:
            self.adapters.observe(samples, now)
        if spec.disaggregation is not None:
            decode = {p["name"] for p in ready if role_of(p) == "decode"}
            self.ratio.observe([s for s in samples if s.pod in decode], now)
        return ready, samples, self.ttft_p99(samples, now)

    def ttft_p99(self, samples: Sequence[ReplicaSample], now: float) -> float | None:
        merged: dict[float, float] = {}
        for s in samples:
            for le, count in s.ttft_buckets:
                merged[le] = merged.get(le, 0.0) + count
        snapshot = tuple(sorted(merged.items()))
        self.ttft_history.append((now, snapshot))
        while self.ttft_history and now - self.ttft_history[0][0] > TTFT_WINDOW_S:
            self.ttft_history.popleft()
        if len(self.ttft_history) < 2 or not snapshot:
            return None
        return quantile_from_buckets(bucket_delta(snapshot, self.ttft_history[0][1]), 0.99)

    def figure_fields(self, samples: Sequence[ReplicaSample], p99: float | None) -> dict:
        """The status figures of this read (the KV usage gauge set too)."""
        fields: dict = {}
        kv = [s.kv_usage for s in samples if s.ok and s.kv_usage is not None]
        if kv:
            mean = sum(kv) / len(kv)
            self.ports.metrics.kv_usage.labels(self.ns, self.name).set(mean)
            fields["kvCacheUsagePercent"] = round(mean * 100)
        waste = [s.kv_waste for s in samples if s.ok and s.kv_waste is not None]
        if waste:
            fields["kvWastePercent"] = round(100 * sum(waste) / len(waste))
        if p99 is not None:
            fields["ttftP99Milliseconds"] = round(p99 * 1000)
        return fields

    # --- one tick -----------------------------------------------------------------

    async def sync_adapters(self, body: dict, pods: list[dict], adapters: Sequence[Adapter],
                            now: float | None = None) -> None:
        """Only the adapters' pass, for a service the loop does not tick (no ready replica): their
        status still says why they are not loaded (LoraDisabled, Placing)."""
        spec = self.spec_of(body)
        if spec is not None:
            await self.adapters.tick(spec, readable_replicas(pods), adapters,
                                     time.monotonic() if now is None else now)

    async def tick(self, body: dict, pods: list[dict], now: float | None = None, demand: int = 0,
                   adapters: Sequence[Adapter] = (), audits: bool = True) -> None:
        """``demand``: requests routers hold for the service (it may be at zero replicas);
        ``adapters``: the InferenceAdapters naming it; ``audits``: False while a new leader's first
        pass runs (the fragmentation audit, due or requested, waits for the next tick)."""
        now = time.monotonic() if now is None else now
        self.fragmentation.watching(now)
        self.autoscaler.new_pass()
        self.warm = None  # the leader's own reads supersede a follower's
        spec = self.spec_of(body)
        if spec is None:
            return  # the reconciler reports InvalidSpec
        ready, samples, p99 = await self.read_replicas(spec, pods, now)
        if spec.engine.lora is not None or adapters:
            # Before autoscaling: a replica that just became ready gets its adapters first.
            await self.adapters.tick(spec, ready, adapters, now)
        fields = self.figure_fields(samples, p99)
        conditions: list[dict] = []
        if spec.disaggregation is not None:
            self.ratio.measure(body, spec, now, fields)
            if spec.autoscaling.mode == "Auto":
                conditions = await self.autoscaler.autoscale_pools(body, spec, samples_by_role(ready, samples),
                                                                   now, fields)
        elif spec.autoscaling.mode == "Auto":
            conditions = await self.autoscaler.autoscale(body, spec, samples, now, fields, demand)
        # The figures at most every figures_interval; conditions and other fields at once, with the figures.
        write = self.figures.plan(fields, body.get("status") or {}, now, urgent=bool(conditions),
                                  limits=figures.limits(spec))
        if write or conditions:
            await self.ports.status.write_status(body, write, conditions)
            self.figures.wrote(write, now)
        if spec.rollout is not None and spec.rollout.strategy == "Canary" and spec.disaggregation is None:
            await self.canary.tick(body, spec, pods, samples)
        await self.marks.release_outlived(body, pods)
        if spec.admission.reservation == "Predicted":
            # A disaggregated service's answer lengths are what its decode pods see (a prefill pod
            # answers one token), and its guards of both pools read the one demand.json.
            sharing = [p for p in ready if role_of(p) == "decode"] if spec.disaggregation else ready
            await self.demand_share.tick(body, sharing, pods, now)
        if audits and self.fragmentation.due(body, spec, now):
            await self.fragmentation.audit(body, spec, ready, now, samples=samples, pods=pods)

    # --- following, and taking over -------------------------------------------------------

    async def follow(self, body: dict, pods: list[dict], now: float | None = None) -> None:
        """A follower's tick: ``tick``'s reads into the same state, and nothing written (no status,
        no scaling, no Event, no metric, no call to a replica but the reads), so that this replica,
        should it take the Lease over, decides on what the leader would have seen (``take_over``).
        Only an autoscaled service has state worth keeping warm."""
        now = time.monotonic() if now is None else now
        spec = self.spec_of(body)
        if spec is None or spec.autoscaling.mode != "Auto":
            self.warm = None
            return
        ready, samples, _ = await self.read_replicas(spec, pods, now, leading=False)
        self.warm = self.autoscaler.follow(body, spec, ready, samples, now)

    async def take_over(self, body: dict, pods: list[dict], now: float | None = None, *, max_age: float,
                        demand: int = 0, adapters: Sequence[Adapter] = (), audits: bool = True) -> None:
        """This loop's first tick under a new leader. A scale-out its last reading as a follower
        asked for is carried out at once, before the replicas are read again
        (``ServiceAutoscaler.take_over``); otherwise, or when the replicas changed meanwhile, an
        ordinary tick."""
        now = time.monotonic() if now is None else now
        warm, self.warm = self.warm, None
        spec = self.spec_of(body)
        self.fragmentation.watching(now)
        if warm is not None and spec is not None and await self.autoscaler.take_over(body, spec, warm, now,
                                                                                      max_age=max_age):
            return
        await self.tick(body, pods, now, demand, adapters, audits=audits)
