"""The guard's Prometheus metrics (``gpufleet_guard_*``, and vLLM's GPU memory as
``gpufleet_engine_gpu_memory_*``), on a registry of their own.

Names, types and labels are the catalogue in ``docs/metrics.md``. Every
class × outcome and class × reason series is created at zero up front, so
rate() and absent() in alert rules work before the first failure.
"""
from __future__ import annotations

import bisect
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Exemplar, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpufleet_api.guard import guard_metrics as m
from gpufleet_api.guard.adapters import FAILURE_REASONS
from gpufleet_api.guard.guard_config import SLOConfig
from gpufleet_api.guard.guard_metrics import OUTCOMES, REASONS, SLIS
from gpufleet_engine.vllm.gpu_memory import GpuMemoryCollector, GpuMemoryReader
from gpufleet_engine.vllm.lora_stats import LoraStatsCollector
from gpufleet_kit.openmetrics import exposition

__all__ = ["CONTENT_TYPE", "OUTCOMES", "REASONS", "GuardMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_OUTPUT_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0, 8.0)
# Routes whose answers the guard learns (embeddings produce none).
_GENERATING_ROUTES = ("/v1/chat/completions", "/v1/completions")

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _with(buckets: tuple[float, ...], objective: float) -> tuple[float, ...]:
    """``buckets`` with a bound at the objective, so quantiles near it are not interpolated across it."""
    return tuple(sorted({*buckets, objective}))


class _OptionalGauge(Collector):
    """A gauge read at scrape time that has no sample while its value is unknown (None)."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float | None]):
        self.name, self.documentation, self.read = name, documentation, read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation)
        value = self.read()
        if value is not None:
            family.add_metric([], value)
        yield family


class _AdapterStates(Collector):
    """``gpufleet_guard_adapter_state{adapter, state}``: per adapter of the book, 1 for its state
    and 0 for the others, read at scrape time (an adapter that left has no series)."""

    def __init__(self, read: Callable[[], list[tuple[str, str]]]):
        self.read = read

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(m.ADAPTER_STATE, "LoRA adapters of this replica by state: 1 for the state "
                                 "each is in, 0 for the others.", labels=["adapter", "state"])

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for adapter, state in self.read():
            for each in m.ADAPTER_STATES:
                family.add_metric([adapter, each], 1.0 if each == state else 0.0)
        yield family


class BucketCounts:
    """One series of a ``CountedHistogram``: its bucket counts (the last one past every bound) and sum."""

    __slots__ = ("counts", "sum", "exemplars")

    def __init__(self, buckets: int):
        self.counts = [0] * buckets
        self.sum = 0.0
        self.exemplars: list[Exemplar | None] = [None] * buckets

    def add(self, counts: Sequence[int], total: float) -> None:
        """Observations counted elsewhere into the same buckets (``CountedHistogram.bounds``)."""
        for i, n in enumerate(counts):
            if n:
                self.counts[i] += n
        self.sum += total

    def exemplar(self, bucket: int, value: float, labels: dict[str, str]) -> None:
        """An observation in ``bucket`` that opens a trace (OpenMetrics exemplar, the bucket's latest)."""
        self.exemplars[bucket] = Exemplar(labels, value, time.time())


class CountedHistogram(Collector):
    """A histogram by one label whose observations are counted into its buckets by the caller.

    The inter-chunk gaps of a stream are the guard's only per-token metric: a
    prometheus_client observe() a chunk (a lock, five calls) was the largest
    share of the relay's own CPU beside the socket writes, and every CPU cycle
    the relay spends is taken from vLLM on a shared host. The relay counts a
    gap with a bisection into ``bounds`` and an increment, and adds a stream's
    counts here at its end (and every few hundred gaps). Exposed as
    prometheus_client's Histogram is: ``_bucket{le}``, ``_count``, ``_sum``.
    """

    def __init__(self, name: str, documentation: str, label: str, buckets: Sequence[float],
                 registry: CollectorRegistry):
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = sorted(float(b) for b in buckets)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._series: dict[str, BucketCounts] = {}
        registry.register(self)

    def labels(self, value: str) -> BucketCounts:
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = BucketCounts(len(self.bounds) + 1)
        return series

    def bucket_of(self, value: float) -> int:
        return bisect.bisect_left(self.bounds, value)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=[self.label])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, series in list(self._series.items()):
            cumulative = list(itertools.accumulate(series.counts))
            buckets: list[Any] = [(le, n, e) if e is not None else (le, n)
                                  for le, n, e in zip(self._les, cumulative, series.exemplars)]
            family.add_metric([value], buckets, series.sum)
        yield family


class GuardMetrics:
    def __init__(self, classes: list[str], registry: CollectorRegistry | None = None,
                 slo: SLOConfig | None = None, gpu_memory: GpuMemoryReader | None = None,
                 role: str = "unified"):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge(m.ROLE_INFO, "What this pod does in its service: unified, prefill or decode (value 1).",
              ["role"], registry=r).labels(role).set(1)
        self.kv_handoffs = Counter(m.KV_HANDOFFS, "Admitted requests of a prefill/decode hand-off, by "
                                   "phase (prefill, decode) and outcome.", ["phase", "outcome"], registry=r)
        for phase, outcome in itertools.product(m.KV_HANDOFF_PHASES, m.KV_HANDOFF_OUTCOMES):
            self.kv_handoffs.labels(phase, outcome)
        # Set by the guard of a pod that writes the shared-storage connector's files; absent elsewhere.
        self.kv_storage_bytes: float | None = None
        r.register(_OptionalGauge(m.KV_STORAGE_BYTES, "Bytes of the KV connector's prompt files in its "
                                  "shared directory after the last bounding pass (pods that write it).",
                                  lambda: self.kv_storage_bytes))
        self.kv_storage_removed_prompts = Counter(m.KV_STORAGE_REMOVED_PROMPTS, "Prompts' KV files removed "
                                                  "from the connector's shared directory past its limit.",
                                                  registry=r)
        # GPU memory from inside vLLM (the plugin's reports), one series per device.
        self.gpu_memory = gpu_memory or GpuMemoryReader.from_environment()
        r.register(GpuMemoryCollector(self.gpu_memory))
        # Set by the guard, which knows the in-flight sequences (memory_report.kv_waste).
        self.kv_waste: Callable[[], float | None] = lambda: None
        r.register(_OptionalGauge(m.KV_WASTE_RATIO, "Share of the KV blocks in use holding no token of an "
                                  "in-flight request: 1 - tokens held / (blocks in use x block size). Absent "
                                  "while a sequence's length is unknown (docs/metrics.md).",
                                  lambda: self.kv_waste()))
        slo = slo or SLOConfig()
        self.sli_events = Counter(m.SLI_EVENTS, "Events judged against the service's objectives, by SLI "
                                  "(requests; for itl, gaps between streamed chunks).", ["class", "sli"],
                                  registry=r)
        self.sli_good_events = Counter(m.SLI_GOOD_EVENTS, "Events that met the service's objective, by SLI.",
                                       ["class", "sli"], registry=r)
        self.requests = Counter(m.REQUESTS, "Finished requests by class and outcome.",
                                ["class", "outcome"], registry=r)
        self.rejections = Counter(m.REJECTIONS, "Requests refused by the guard, by reason.",
                                  ["class", "reason"], registry=r)
        self.queue_seconds = Histogram(m.QUEUE_SECONDS,
                                       "Time from arrival to dispatch to vLLM.", ["class"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram(m.TTFT_SECONDS,
                                      "Time to first token as the client sees it (streaming requests).",
                                      ["class"], buckets=_with(_LATENCY_BUCKETS, slo.ttft_p99_seconds),
                                      registry=r)
        self.itl_seconds = CountedHistogram(m.ITL_SECONDS,
                                            "Inter-chunk latency as the client sees it (streaming requests).",
                                            "class", _with(_ITL_BUCKETS, slo.itl_p99_seconds), r)
        self.request_seconds = Histogram(m.REQUEST_SECONDS,
                                         "End-to-end latency of admitted requests.", ["class"],
                                         buckets=_with(_REQUEST_BUCKETS, slo.request_p99_seconds),
                                         registry=r)
        self.queue_depth = Gauge(m.QUEUE_DEPTH, "Requests waiting in the guard's queue.",
                                 ["class"], registry=r)
        self.max_concurrency = Gauge(m.MAX_CONCURRENCY,
                                     "Most requests the guard dispatches to vLLM at once (maxConcurrency).",
                                     registry=r)
        self.concurrency_limit = Gauge(m.CONCURRENCY_LIMIT,
                                       "Requests the guard lets into vLLM at once now: maxConcurrency, or "
                                       "fewer while the TTFT control holds it down (ttftControl).",
                                       registry=r)
        self.in_flight = Gauge(m.IN_FLIGHT, "Requests dispatched to vLLM and not finished.",
                               registry=r)
        self.in_flight_answering = Gauge(m.IN_FLIGHT_ANSWERING, "Requests in flight whose first token has "
                                         "gone out to the client: the answers an engine failure now cuts "
                                         "mid-answer.", registry=r)
        self.kv_free_blocks = Gauge(m.KV_FREE_BLOCKS,
                                    "Free KV blocks as the guard sees them.", registry=r)
        self.kv_reserved_blocks = Gauge(m.KV_RESERVED_BLOCKS,
                                        "KV blocks reserved for the guard's in-flight requests "
                                        "(prompt + predicted or full output, grown as answers stream).",
                                        registry=r)
        self.kv_total_blocks = Gauge(m.KV_TOTAL_BLOCKS, "KV blocks in vLLM's pool.",
                                     registry=r)
        self.kv_watermark_blocks = Gauge(m.KV_WATERMARK_BLOCKS,
                                         "KV blocks the guard keeps free.", registry=r)
        self.engine_up = Gauge(m.ENGINE_UP,
                               "1 when vLLM answered the guard's last metrics read.", registry=r)
        self.ready = Gauge(m.READY, "1 when the guard reports ready.", registry=r)
        self.output_tokens = Histogram(m.OUTPUT_TOKENS,
                                       "Output tokens per sequence of finished answers: the distribution "
                                       "the guard's reservations are learned from.", ["route", "class"],
                                       buckets=_OUTPUT_BUCKETS, registry=r)
        self.output_tokens_predicted = Gauge(m.OUTPUT_TOKENS_PREDICTED,
                                             "Output tokens per sequence reserved for a new request now "
                                             "(the mean of the learned lengths; absent until learned).",
                                             ["route", "class"], registry=r)
        self.output_prediction_ratio = Histogram(m.OUTPUT_PREDICTION_RATIO,
                                                 "Actual output over the output first reserved, per "
                                                 "finished answer (above 1: the reservation was extended).",
                                                 ["route", "class"], buckets=_RATIO_BUCKETS, registry=r)
        self.reservation_extensions = Counter(m.RESERVATION_EXTENSIONS,
                                              "Times an answer streamed past its reservation and the "
                                              "guard reserved more.", ["class"], registry=r)
        self.sent_ahead = Counter(m.SENT_AHEAD, "Requests sent on to vLLM before the guard parsed them, by "
                                  "outcome: kept (the copy sent was the one served) or aborted (vLLM's copy "
                                  "was closed: the parse refused the request, changed it, or found it "
                                  "bigger than the pool had room for).", ["class", "outcome"], registry=r)
        self.config_reloads = Counter(m.CONFIG_RELOADS, "New versions of guard.json read while running, by "
                                      "result: applied (live settings in effect) or invalid (refused; the "
                                      "running settings stay).", ["result"], registry=r)
        self.config_restart_pending = Gauge(m.CONFIG_RESTART_PENDING,
                                            "1 when the mounted guard.json changes settings that only a new "
                                            "pod applies (vLLM's engine section, addresses).", registry=r)
        for result in ("applied", "invalid"):
            self.config_reloads.labels(result)
        # LoRA adapters (serving/adapters.py): series for the adapters of this replica's set only,
        # created with add_adapter and removed with remove_adapter, so the label stays bounded.
        self.adapter_requests = Counter(m.ADAPTER_REQUESTS, "Finished and refused requests for a LoRA adapter, "
                                        "by adapter and outcome.", ["adapter", "outcome"], registry=r)
        self.adapter_tokens = Counter(m.ADAPTER_TOKENS, "Tokens of requests for a LoRA adapter, by adapter and "
                                      "kind (prompt: sent to vLLM; generation: answered).", ["adapter", "kind"],
                                      registry=r)
        self.adapter_ttft_seconds = Histogram(m.ADAPTER_TTFT_SECONDS, "Time to first token of streaming "
                                              "requests for a LoRA adapter.", ["adapter"],
                                              buckets=_with(_LATENCY_BUCKETS, slo.ttft_p99_seconds), registry=r)
        self.adapter_load_failures = Counter(m.ADAPTER_LOAD_FAILURES, "Times an adapter could not be fetched, "
                                             "checked or loaded into vLLM, by adapter and reason.",
                                             ["adapter", "reason"], registry=r)
        self.adapters: set[str] = set()
        self.adapter_states: Callable[[], list[tuple[str, str]]] = lambda: []
        r.register(_AdapterStates(lambda: self.adapter_states()))
        r.register(LoraStatsCollector(self.gpu_memory.directory, lambda: self.adapters))
        self.add_classes(classes)

    def _adapter_series(self, name: str) -> list[tuple[Any, tuple[str, ...]]]:
        """Every (metric, labels) series of one adapter."""
        return [*((self.adapter_requests, (name, o)) for o in OUTCOMES),
                *((self.adapter_tokens, (name, k)) for k in m.ADAPTER_TOKEN_KINDS),
                (self.adapter_ttft_seconds, (name,)),
                *((self.adapter_load_failures, (name, r)) for r in FAILURE_REASONS)]

    def add_adapter(self, name: str) -> None:
        """Create an adapter's series at zero (it joined this replica's set)."""
        if name in self.adapters:
            return
        self.adapters.add(name)
        for metric, labels in self._adapter_series(name):
            metric.labels(*labels)

    def remove_adapter(self, name: str) -> None:
        """Drop an adapter's series (it left this replica's set)."""
        if name not in self.adapters:
            return
        self.adapters.discard(name)
        for metric, labels in self._adapter_series(name):
            metric.remove(*labels)

    def add_classes(self, classes: list[str]) -> None:
        """Create every series of these queue classes at zero (a reload may add classes)."""
        for c in classes:
            for o in OUTCOMES:
                self.requests.labels(c, o)
            for reason in REASONS:
                self.rejections.labels(c, reason)
            for sli in SLIS:
                self.sli_events.labels(c, sli)
                self.sli_good_events.labels(c, sli)
            self.queue_seconds.labels(c)
            self.ttft_seconds.labels(c)
            self.itl_seconds.labels(c)
            self.request_seconds.labels(c)
            self.queue_depth.labels(c)
            self.reservation_extensions.labels(c)
            for outcome in m.SENT_AHEAD_OUTCOMES:
                self.sent_ahead.labels(c, outcome)
            for route in _GENERATING_ROUTES:
                self.output_tokens.labels(route, c)
                self.output_prediction_ratio.labels(route, c)

    def count_sli(self, class_name: str, judgement: list[tuple[str, int, int]]) -> None:
        """Add one request's SLI events (``sli.judge``)."""
        for sli, good, events in judgement:
            self.sli_events.labels(class_name, sli).inc(events)
            if good:
                self.sli_good_events.labels(class_name, sli).inc(good)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def render_for(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition the scraper's Accept header asks for: OpenMetrics (which carries the
        latency histograms' exemplars: docs/tracing.md) or Prometheus' text format."""
        return exposition(self.registry, accept)
