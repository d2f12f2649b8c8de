"""What the router knows of one replica (pure): its pod, from the API server (table.py builds it), and its
guard's last reading (signals.py parses it). The choice among replicas (choice.py) reads both."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Replica:
    pod: str
    address: str               # host:port of the guard
    serving: bool = True       # the pod is Ready, addressed and not terminating (its API object says so)
    revision: str = ""         # its gpufleet.dev/revision label: what it serves ("" without one)
    terminating: bool = False  # deleted: it will not serve again (not serving for another reason: it may)


@dataclasses.dataclass(frozen=True)
class Reading:
    """One guard /metrics read of one replica (signals.parse_guard)."""
    taken_at: float            # when the read was sent (the router's monotonic clock)
    ready: bool                # the guard says ready (false while draining or the engine is down)
    free_blocks: int           # blocks the guard would admit into now: free less the watermark, unreserved
    total_blocks: int
    queued: int = 0            # waiting in the guard's queues
    adapters: frozenset[str] = frozenset()   # LoRA adapters the replica holds Loaded
