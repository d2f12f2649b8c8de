"""One replica's signals, parsed from the vLLM and guard /metrics text."""
from __future__ import annotations

import dataclasses
import math

from prometheus_client.parser import text_string_to_metric_families

from gpufleet_api.guard import guard_metrics as guard
from gpufleet_api.guard.guard_metrics import SHED_REASONS

__all__ = ["SHED_REASONS", "ReplicaSample", "RequestTokens", "bucket_delta", "parse_replica",
           "quantile_from_buckets"]
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first
# vLLM's per-request token histograms, observed as each request finishes: the measured request
# distribution (the planner's prompt and output lengths, and their rates).
PROMPT_TOKENS = "vllm:request_prompt_tokens"
OUTPUT_TOKENS = "vllm:request_generation_tokens"

Buckets = tuple[tuple[float, float], ...]


@dataclasses.dataclass(frozen=True)
class RequestTokens:
    """Cumulative counts of the requests an engine finished: how many, their prompt and output
    tokens in all, and the (le, count) buckets of each length. Deltas of two reads (``since``)
    are the requests finished in between."""
    requests: float = 0.0
    prompt_sum: float = 0.0
    output_sum: float = 0.0
    prompt_buckets: Buckets = ()
    output_buckets: Buckets = ()

    def since(self, before: "RequestTokens") -> "RequestTokens":
        """What finished after ``before`` (an engine restarted in between counts from zero)."""
        if self.requests < before.requests or self.prompt_sum < before.prompt_sum \
                or self.output_sum < before.output_sum:
            return self
        return RequestTokens(self.requests - before.requests, self.prompt_sum - before.prompt_sum,
                             self.output_sum - before.output_sum,
                             tuple(bucket_delta(self.prompt_buckets, before.prompt_buckets)),
                             tuple(bucket_delta(self.output_buckets, before.output_buckets)))

    def plus(self, other: "RequestTokens") -> "RequestTokens":
        return RequestTokens(self.requests + other.requests, self.prompt_sum + other.prompt_sum,
                             self.output_sum + other.output_sum,
                             _bucket_sum(self.prompt_buckets, other.prompt_buckets),
                             _bucket_sum(self.output_buckets, other.output_buckets))


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
    ttft_buckets: Buckets = ()           # cumulative (le, count) of the guard's TTFT
    queue_buckets: Buckets = ()          # cumulative (le, count) of the guard's queue time
    itl_buckets: Buckets = ()            # cumulative (le, count) of the guard's inter-token latency
    kv_waste: float | None = None        # 0..1, KV blocks in use holding no token (None: unknown now)
    requests_total: float = 0.0          # cumulative requests the guard finished (any outcome): arrivals
    request_tokens: RequestTokens = RequestTokens()  # vLLM's finished requests' token counts
    # cumulative requests per LoRA adapter (every outcome), (adapter, count) sorted by adapter
    adapter_requests: tuple[tuple[str, float], ...] = ()
    # cumulative SLI events and good events per sli (every class), (sli, events, good) sorted by sli
    sli: tuple[tuple[str, float, float], ...] = ()

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
    itl: dict[float, float] = {}
    tokens: dict[str, float] = {}
    prompt: dict[float, float] = {}
    output: dict[float, float] = {}
    adapters: dict[str, float] = {}
    sli_events: dict[str, float] = {}
    sli_good: dict[str, float] = {}
    for name, labels, value in _samples(engine_text):
        if name in KV_USAGE:
            kv.setdefault(name, value)
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:num_requests_running":
            running += value
        elif name == PROMPT_TOKENS + "_bucket":
            _add(prompt, labels, value)
        elif name == OUTPUT_TOKENS + "_bucket":
            _add(output, labels, value)
        elif name in (PROMPT_TOKENS + "_count", PROMPT_TOKENS + "_sum", OUTPUT_TOKENS + "_sum"):
            tokens[name] = tokens.get(name, 0.0) + value
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
            _add(ttft, labels, value)
        elif name == guard.QUEUE_SECONDS + "_bucket":  # every class: waiting is waiting
            _add(queue, labels, value)
        elif name == guard.ITL_SECONDS + "_bucket":
            _add(itl, labels, value)
        elif name == guard.ADAPTER_REQUESTS + "_total" and labels.get("adapter"):
            adapters[labels["adapter"]] = adapters.get(labels["adapter"], 0.0) + value
        elif name in (guard.SLI_EVENTS + "_total", guard.SLI_GOOD_EVENTS + "_total") and _alerted(labels):
            into = sli_events if name == guard.SLI_EVENTS + "_total" else sli_good
            into[labels["sli"]] = into.get(labels["sli"], 0.0) + value
    usage = next((kv[n] for n in KV_USAGE if n in kv), None)
    finished = RequestTokens(tokens.get(PROMPT_TOKENS + "_count", 0.0), tokens.get(PROMPT_TOKENS + "_sum", 0.0),
                             tokens.get(OUTPUT_TOKENS + "_sum", 0.0), tuple(sorted(prompt.items())),
                             tuple(sorted(output.items())))
    return ReplicaSample(pod=pod, ok=True, kv_usage=usage, engine_waiting=waiting, engine_running=running,
                         guard_queued=queued, guard_in_flight=in_flight, shed_total=shed,
                         ttft_buckets=tuple(sorted(ttft.items())), queue_buckets=tuple(sorted(queue.items())),
                         itl_buckets=tuple(sorted(itl.items())), kv_waste=waste, requests_total=requests,
                         request_tokens=finished, adapter_requests=tuple(sorted(adapters.items())),
                         sli=tuple((k, sli_events[k], sli_good.get(k, 0.0)) for k in sorted(sli_events)))


def _alerted(labels: dict[str, str]) -> bool:
    """An SLI series the burn-rate alerts count (rules/gpufleet.rules.yaml, group gpufleet-sli): every
    class's availability, the latency SLIs of every class but background."""
    sli = labels.get("sli")
    return bool(sli) and (sli == guard.SLI.AVAILABILITY or labels.get("class") != "background")


def _add(buckets: dict[float, float], labels: dict[str, str], value: float) -> None:
    """Sum a histogram's series (classes, engines) bucket by bucket."""
    le = float(labels["le"])
    buckets[le] = buckets.get(le, 0.0) + value


def _bucket_sum(a: Buckets, b: Buckets) -> Buckets:
    total = dict(a)
    for le, n in b:
        total[le] = total.get(le, 0.0) + n
    return tuple(sorted(total.items()))


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
