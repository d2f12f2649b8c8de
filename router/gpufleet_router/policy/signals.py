"""A replica's room for new work, parsed from its guard's /metrics text (pure).

The guard publishes its admission ledger (docs/metrics.md): free blocks in
vLLM's view corrected for what it admitted since its last read, the blocks
reserved for its in-flight requests, the pool and the watermark it keeps
free. A request is admitted when its blocks fit both views, so the room is
the smaller of the two. It also publishes the state of each LoRA adapter it
holds (``gpufleet_guard_adapter_state{adapter, state}``, 1 for the current
state): a replica takes an adapter's requests only while it is ``Loaded``."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gpufleet_api.guard import guard_metrics as guard
from gpufleet_api.guard.adapters import AdapterStateName

from ..errors import RouterError
from .replicas import Reading


class UnreadableMetrics(RouterError, ValueError):
    """The text is not a guard's /metrics (a name missing): the replica's room is unknown."""


def parse_guard(text: str, taken_at: float) -> Reading:
    values: dict[str, float] = {}
    queued = 0.0
    loaded = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == guard.QUEUE_DEPTH:
                queued += sample.value
            elif sample.name == guard.ADAPTER_STATE:
                if sample.labels.get("state") == LOADED and sample.value == 1.0 and sample.labels.get("adapter"):
                    loaded.add(sample.labels["adapter"])
            elif sample.name in _WANTED:
                values[sample.name] = sample.value
    missing = [name for name in _WANTED if name not in values]
    if missing:
        raise UnreadableMetrics(f"no {', '.join(missing)} in the guard's metrics")
    total = int(values[guard.KV_TOTAL_BLOCKS])
    free = int(values[guard.KV_FREE_BLOCKS]) - int(values[guard.KV_WATERMARK_BLOCKS])
    unreserved = total - int(values[guard.KV_RESERVED_BLOCKS])
    return Reading(taken_at=taken_at, ready=values[guard.READY] == 1.0, free_blocks=max(0, min(free, unreserved)),
                   total_blocks=total, queued=int(queued), adapters=frozenset(loaded))


LOADED: AdapterStateName = "Loaded"
_WANTED = (guard.KV_FREE_BLOCKS, guard.KV_TOTAL_BLOCKS, guard.KV_RESERVED_BLOCKS, guard.KV_WATERMARK_BLOCKS,
           guard.READY)
