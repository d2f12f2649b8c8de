"""LoRA adapter traffic inside vLLM's engine: loads, evictions and activations per adapter.

Only vLLM's engine knows when an adapter is read from disk into its CPU-side cache (a load,
``--max-cpu-loras``), dropped from that cache to make room (an eviction), or moved into one of
the batch's GPU slots (an activation, ``--max-loras``): the guard sees requests, not the cache.
The gpufleet vLLM plugin (``plugin.register``) wraps vLLM's LRU adapter cache
(``LRUCacheWorkerLoRAManager._load_adapter``, ``LRUCacheLoRAModelManager.remove_oldest_adapter``
and ``activate_adapter``) in the engine's process and writes the counts, by adapter name, to
``lora-<pid>.json`` in the plugin's directory (``GPUFLEET_GPU_MEMORY_DIR``, shared with the
guard) once a second when they changed and every ``HEARTBEAT_SECONDS`` regardless. The guard
(``LoraStatsCollector``) exports them as ``gpufleet_guard_adapter_{loads,evictions,activations}_total``
for the adapters in its set only, so the label stays bounded; a file older than
``STALE_AFTER_SECONDS`` is a vLLM process that is gone (a restart starts the counters anew,
which Prometheus' rate() takes as a counter reset).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpufleet_api.guard import guard_metrics as m

log = logging.getLogger("gpufleet_engine.vllm.lora_stats")

FILE_PREFIX = "lora-"
EVENTS = ("loads", "evictions", "activations")
WRITE_SECONDS = 1.0
HEARTBEAT_SECONDS = 5.0
STALE_AFTER_SECONDS = 30.0


class LoraCounts:
    """This process's counts by adapter name (vLLM's cache knows adapters by integer id)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[int, str] = {}
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(EVENTS, 0))
        self.changed = threading.Event()

    def count(self, event: str, adapter_id: int) -> None:
        with self.lock:
            self.counts[self.names.get(adapter_id, str(adapter_id))][event] += 1
        self.changed.set()

    def document(self, pid: int, now: float) -> dict:
        with self.lock:
            return {"pid": pid, "time": now, "adapters": {k: dict(v) for k, v in self.counts.items()}}


# One per process: the wrapped methods count here, and a forked child (its own writer) goes on counting.
COUNTS = LoraCounts()


def wrap_vllm(counts: LoraCounts = COUNTS) -> None:
    """Count inside vLLM's LRU adapter cache (idempotent)."""
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    if getattr(LRUCacheLoRAModelManager, "_gpufleet_counted", False):
        return
    load, remove_oldest, activate = (LRUCacheWorkerLoRAManager._load_adapter,
                                     LRUCacheLoRAModelManager.remove_oldest_adapter,
                                     LRUCacheLoRAModelManager.activate_adapter)

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        lora = load(self, lora_request)
        counts.names[lora_request.lora_int_id] = lora_request.lora_name
        counts.count("loads", lora_request.lora_int_id)
        return lora

    def remove_oldest_adapter(self: Any) -> bool:
        before = set(self.list_adapters())
        removed = remove_oldest(self)
        for adapter_id in before - set(self.list_adapters()):
            counts.count("evictions", adapter_id)
        return removed

    def activate_adapter(self: Any, lora_id: int) -> bool:
        moved = activate(self, lora_id)
        if moved:
            counts.count("activations", lora_id)
        return moved

    LRUCacheWorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]
    LRUCacheLoRAModelManager.remove_oldest_adapter = remove_oldest_adapter  # type: ignore[method-assign]
    LRUCacheLoRAModelManager.activate_adapter = activate_adapter  # type: ignore[method-assign]
    LRUCacheLoRAModelManager._gpufleet_counted = True  # type: ignore[attr-defined]


def start(directory: Path, counts: LoraCounts = COUNTS) -> LoraCounts:
    """Wrap vLLM's cache in this process and write its counts into ``directory`` from a daemon thread."""
    wrap_vllm(counts)
    pid = os.getpid()
    path = directory / f"{FILE_PREFIX}{pid}.json"

    def run() -> None:
        failed = False
        last = 0.0
        while True:
            counts.changed.wait(WRITE_SECONDS)
            now = time.time()
            if counts.changed.is_set() or now - last >= HEARTBEAT_SECONDS:
                counts.changed.clear()
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_name(f".{path.name}.tmp")
                    tmp.write_text(json.dumps(counts.document(pid, now)))
                    os.replace(tmp, path)
                    last = now
                except OSError:
                    if not failed:
                        log.exception("gpufleet: cannot write LoRA counts to %s; retrying", path)
                        failed = True
            time.sleep(WRITE_SECONDS)  # at most one write a second, however busy the cache

    threading.Thread(target=run, name="gpufleet-lora-stats", daemon=True).start()
    return counts


def read(directory: Path | None, now: float) -> dict[str, dict[str, int]]:
    """The counts of every live vLLM process in ``directory``, summed by adapter."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(EVENTS, 0))
    if directory is None:
        return totals
    for path in directory.glob(f"{FILE_PREFIX}*.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced while read: the next scrape gets it
        if not isinstance(doc, dict) or not isinstance(doc.get("time"), (int, float)) \
                or now - doc["time"] > STALE_AFTER_SECONDS or not isinstance(doc.get("adapters"), dict):
            continue
        for name, events in doc["adapters"].items():
            if isinstance(events, dict):
                for event in EVENTS:
                    value = events.get(event, 0)
                    if isinstance(value, int) and value > 0:
                        totals[name][event] += value
    return totals


_FAMILIES = (
    ("loads", m.ADAPTER_LOADS, "Adapters read from disk into vLLM's CPU-side adapter cache."),
    ("evictions", m.ADAPTER_EVICTIONS, "Adapters dropped from vLLM's CPU-side cache to make room for another."),
    ("activations", m.ADAPTER_ACTIVATIONS, "Adapters moved into one of vLLM's per-batch adapter slots."),
)


class LoraStatsCollector(Collector):
    """``gpufleet_guard_adapter_{loads,evictions,activations}_total`` at scrape time, for ``names()``
    only (the adapters of this replica's set), each at zero until counted."""

    def __init__(self, directory: Path | None, names: Callable[[], Iterable[str]],
                 clock: Callable[[], float] = time.time):
        self.directory, self.names, self.clock = directory, names, clock

    def describe(self) -> Iterator[CounterMetricFamily]:
        for _, name, doc in _FAMILIES:
            yield CounterMetricFamily(name, doc, labels=["adapter"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        names = sorted(self.names())
        totals = read(self.directory, self.clock()) if names else {}
        for event, name, doc in _FAMILIES:
            family = CounterMetricFamily(name, doc, labels=["adapter"])
            for adapter in names:
                family.add_metric([adapter], float(totals.get(adapter, {}).get(event, 0)))
            yield family
