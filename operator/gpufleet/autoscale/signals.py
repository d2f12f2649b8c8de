"""One replica's signals, parsed from the vLLM and guard /metrics text."""
from __future__ import annotations

import dataclasses
import math

from prometheus_client.parser import text_string_to_metric_families

from gpufleet_engine.contract import guard_metrics as guard
from gpufleet_engine.contract.guard_metrics import SHED_REASONS

__all__ = ["SHED_REASONS", "ReplicaSample", "bucket_delta", "parse_replica", "quantile_from_buckets"]
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first


@dataclasses.dataclass(frozen=True)
class ReplicaSample:
    pod: str
    ok: bool
    error: str | None = None
    kv_usage: float | None = None        # 0..1
    engine_waiting: float = 0.0          # vLLM's own queue
    engine_running: float = 0.0
    guard_queued: float = 0.0            # waiting in the guard's queues
    guard_in_flight: float = 0.0
    shed_total: float = 0.0              # cumulative guard rejections that mean "overloaded"
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # cumulative (le, count) of the guard's TTFT
    queue_buckets: tuple[tuple[float, float], ...] = ()  # cumulative (le, count) of the guard's queue time
    kv_waste: float | None = None        # 0..1, KV blocks in use holding no token (None: unknown now)
    requests_total: float = 0.0          # cumulative requests the guard finished (any outcome): arrivals

    @property
    def load(self) -> float:
        """For choosing the replica to remove on scale-in: busy KV and requests."""
        return (self.kv_usage or 0.0) + self.engine_running + self.engine_waiting + self.guard_in_flight


def _samples(text: str):
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield s.name, s.labels, s.value


def parse_replica(pod: str, engine_text: str, guard_text: str) -> ReplicaSample:
    kv: dict[str, float] = {}
    waiting = running = queued = in_flight = shed = requests = 0.0
    waste: float | None = None
    ttft: dict[float, float] = {}
    queue: dict[float, float] = {}
    for name, _labels, value in _samples(engine_text):
        if name in KV_USAGE:
            kv.setdefault(name, value)
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:num_requests_running":
            running += value
    for name, labels, value in _samples(guard_text):
        if name == guard.QUEUE_DEPTH:
            queued += value
        elif name == guard.IN_FLIGHT:
            in_flight += value
        elif name == guard.KV_WASTE_RATIO:
            waste = value
        elif name == guard.REQUESTS + "_total":
            requests += value
        elif name == guard.REJECTIONS + "_total" and labels.get("reason") in SHED_REASONS:
            shed += value
        elif name == guard.TTFT_SECONDS + "_bucket":
            le = float(labels["le"])
            ttft[le] = ttft.get(le, 0.0) + value
        elif name == guard.QUEUE_SECONDS + "_bucket":  # every class: waiting is waiting
            le = float(labels["le"])
            queue[le] = queue.get(le, 0.0) + value
    usage = next((kv[n] for n in KV_USAGE if n in kv), None)
    return ReplicaSample(pod=pod, ok=True, kv_usage=usage, engine_waiting=waiting, engine_running=running,
                         guard_queued=queued, guard_in_flight=in_flight, shed_total=shed,
                         ttft_buckets=tuple(sorted(ttft.items())), queue_buckets=tuple(sorted(queue.items())),
                         kv_waste=waste, requests_total=requests)


def quantile_from_buckets(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style histogram_quantile over cumulative (le, count) pairs."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def bucket_delta(new: tuple, old: tuple) -> list[tuple[float, float]]:
    """Observations between two cumulative snapshots (a reset counts from zero)."""
    old_map = dict(old)
    out = []
    for le, count in new:
        before = old_map.get(le, 0.0)
        out.append((le, count - before if count >= before else count))
    return out
