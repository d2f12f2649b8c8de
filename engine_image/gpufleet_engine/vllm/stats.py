"""Read the few vLLM metrics the guard needs out of vLLM's Prometheus text.

vLLM's ``/metrics`` page is ~50 KB of histograms; the guard reads it every
poll interval, so this scans lines by prefix instead of building every metric
family (a full parse costs several milliseconds of the guard's event loop).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gpufleet_engine.admission.kv_ledger import KvSnapshot
from gpufleet_engine.errors import GuardError

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newest name first
CACHE_INFO = "vllm:cache_config_info"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_WANTED = (*KV_USAGE, CACHE_INFO, RUNNING, WAITING, PREEMPTIONS)
# The name ends at "{" or " ": a wanted name followed by either starts a wanted line, and no
# histogram bucket (most of the page) is split or has its labels read.
_WANTED_PREFIXES = tuple(name + end for name in _WANTED for end in "{ ")


class MetricsFormatError(GuardError, ValueError):
    """vLLM's metrics lack what the guard needs to admit on KV blocks."""


@dataclass(frozen=True)
class VllmStats:
    kv_usage_ratio: float      # mean over engines, 0..1
    num_gpu_blocks: int        # summed over engines
    block_size: int | None
    running: float
    waiting: float
    preemptions_total: float

    def kv_snapshot(self) -> KvSnapshot:
        return KvSnapshot.from_usage(self.num_gpu_blocks, self.kv_usage_ratio)


def _split(line: str) -> tuple[str, dict[str, str], float] | None:
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace]
        close = line.rfind("}")
        labels = dict(_LABEL.findall(line[brace + 1:close]))
        rest = line[close + 1:]
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    parts = rest.split()
    if not parts:
        return None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return None


def parse(text: str) -> VllmStats:
    """Extract KV usage, pool size and queue figures; raise MetricsFormatError if the pool is unknown."""
    usage: dict[str, list[float]] = {name: [] for name in KV_USAGE}
    blocks: list[int] = []
    block_sizes: set[int] = set()
    running = waiting = preemptions = 0.0
    for line in text.splitlines():
        if not line.startswith(_WANTED_PREFIXES):
            continue
        parsed = _split(line)
        if parsed is None:
            continue
        name, labels, value = parsed
        if name in usage:
            usage[name].append(value)
        elif name == CACHE_INFO:
            if labels.get("num_gpu_blocks", "None").isdigit():
                blocks.append(int(labels["num_gpu_blocks"]))
            if labels.get("block_size", "None").isdigit():
                block_sizes.add(int(labels["block_size"]))
        elif name == RUNNING:
            running += value
        elif name == WAITING:
            waiting += value
        elif name == PREEMPTIONS:
            preemptions += value
    ratios = next((usage[n] for n in KV_USAGE if usage[n]), None)
    if ratios is None:
        raise MetricsFormatError(f"vLLM's /metrics has no {KV_USAGE[0]} (nor {KV_USAGE[1]}); "
                                 f"is the engine started with --disable-log-stats? Remove that flag")
    if not blocks:
        raise MetricsFormatError(f"vLLM's /metrics has no {CACHE_INFO} with num_gpu_blocks; "
                                 f"the guard needs a vLLM release that exports it (0.6 or later)")
    return VllmStats(
        kv_usage_ratio=sum(ratios) / len(ratios),
        num_gpu_blocks=sum(blocks),
        block_size=min(block_sizes) if block_sizes else None,
        running=running,
        waiting=waiting,
        preemptions_total=preemptions,
    )
