"""Which replica takes a request: pure, no I/O, no clock of its own.

Two signals, in this order:

1. Prefix affinity. Requests whose prompts begin with the same blocks (a
   shared system prompt) should reach the replica that already holds those
   blocks in vLLM's prefix cache. The prompt's leading blocks are hashed and
   the hash placed on a consistent-hash ring of the service's replicas, so
   every router maps a prefix to the same replica without talking to the
   others, and a replica coming or going moves only its own keys. The load
   is bounded (Mirrokni et al., "Consistent Hashing with Bounded Loads"):
   walking the ring from the key, a replica already carrying
   ceil((1 + load_factor) x the mean) + 1 of the router's requests in
   flight, or without room for the request, is passed over, so a popular
   prefix spills to the next replica on the ring (which then caches it too)
   instead of piling onto one.
2. Free KV, for everything else (a prompt shorter than one block, or no
   replica on the ring within its bound and with room): the replica with
   the most KV blocks free for admission: the guard's last reading, less
   what this router sent it since that reading was taken and is still
   running (the reading cannot include those yet; finished ones freed their
   blocks).

Replicas that are not ready or are draining are never chosen. A replica not
read yet counts as having no known room: it is chosen by affinity or, when
nothing has been read, by the fewest requests in flight from this router.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from typing import Iterable, Sequence

VIRTUAL_NODES = 64
DEFAULT_LOAD_FACTOR = 0.25
AFFINITY_SLACK = 1     # requests over the bounded-load capacity a prefix's replica may still take


class Reason:
    """Why a replica was picked: the ``reason`` label of gpufleet_router_picks_total."""
    AFFINITY = "prefix_affinity"   # the prefix's replica on the ring, with room
    KV = "kv_free"                 # the most free KV blocks net of the router's own sends
    LEAST_BUSY = "least_in_flight"  # no reading yet anywhere: fewest in flight from this router


REASONS = (Reason.AFFINITY, Reason.KV, Reason.LEAST_BUSY)


@dataclasses.dataclass(frozen=True)
class Reading:
    """One guard /metrics read of one replica (signals.parse_guard)."""
    taken_at: float            # when the read was sent (the router's monotonic clock)
    ready: bool                # the guard says ready (false while draining or the engine is down)
    free_blocks: int           # blocks the guard would admit into now: free less the watermark, unreserved
    total_blocks: int
    queued: int = 0            # waiting in the guard's queues


@dataclasses.dataclass(eq=False)
class Sent:
    """One request this router sent, counted against its replica's room until a reading includes it
    or it finishes (compared by identity: two requests of one size at one instant are two)."""
    at: float
    blocks: int


@dataclasses.dataclass(frozen=True)
class Replica:
    pod: str
    address: str               # host:port of the guard
    serving: bool = True       # the pod is Ready, addressed and not terminating (its API object says so)


@dataclasses.dataclass(frozen=True)
class Pick:
    replica: Replica
    reason: str
    affinity_hit: bool         # the request had a prefix key and went to the key's replica


def prefix_key(text: str, block_chars: int, blocks: int) -> str | None:
    """A hash of the prompt's first ``blocks`` whole blocks of ``block_chars``
    characters; None when the prompt is shorter than one block (nothing a
    prefix cache would reuse). Only whole blocks count: vLLM caches whole blocks."""
    if block_chars <= 0 or blocks <= 0:
        return None
    whole = min(blocks, len(text) // block_chars)
    if whole == 0:
        return None
    return hashlib.blake2b(text[:whole * block_chars].encode(), digest_size=8).hexdigest()


def _point(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


class Ring:
    """A consistent-hash ring over pod names (``VIRTUAL_NODES`` points each)."""

    def __init__(self, pods: Iterable[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((_point(f"{pod}#{i}"), pod) for pod in set(pods) for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._pods = [p for _, p in points]

    def walk(self, key: str) -> list[str]:
        """Every pod once, in ring order from ``key``'s position."""
        if not self._pods:
            return []
        start = bisect.bisect(self._hashes, _point(key)) % len(self._pods)
        seen: dict[str, None] = {}
        for i in range(len(self._pods)):
            seen.setdefault(self._pods[(start + i) % len(self._pods)], None)
        return list(seen)


class Picker:
    """One service's replicas as this router sees them: readings, its own
    sends since each reading, and its requests in flight."""

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR):
        if load_factor < 0:
            raise ValueError(f"load_factor must be >= 0, got {load_factor}")
        self.load_factor = load_factor
        self.replicas: dict[str, Replica] = {}
        self.readings: dict[str, Reading] = {}
        self.in_flight: dict[str, int] = {}
        self._sent: dict[str, list[Sent]] = {}  # pod -> requests sent since its last reading, still running
        self._ring = Ring(())
        self._ring_pods: frozenset[str] = frozenset()

    # --- what the router learns --------------------------------------------

    def set_replicas(self, replicas: Sequence[Replica]) -> None:
        self.replicas = {r.pod: r for r in replicas}
        for table in (self.readings, self._sent):
            for pod in list(table):
                if pod not in self.replicas:
                    del table[pod]
        for pod in list(self.in_flight):
            if pod not in self.replicas and not self.in_flight[pod]:
                del self.in_flight[pod]

    def observe(self, pod: str, reading: Reading | None) -> None:
        """A guard reading (None: the read failed, so nothing is known about its room)."""
        if pod not in self.replicas:
            return
        if reading is None:
            self.readings.pop(pod, None)
            return
        self.readings[pod] = reading
        # Sends before the read began are in its numbers; later ones are not.
        self._sent[pod] = [x for x in self._sent.get(pod, []) if x.at >= reading.taken_at]

    def sent(self, pod: str, blocks: int, now: float) -> Sent:
        """A request went to ``pod``; pass what this returns to ``finished``."""
        ticket = Sent(now, max(0, blocks))
        self._sent.setdefault(pod, []).append(ticket)
        self.in_flight[pod] = self.in_flight.get(pod, 0) + 1
        return ticket

    def finished(self, pod: str, ticket: Sent | None = None) -> None:
        """The request's answer ended: its blocks are free again, so a reading taken before that
        no longer owes them (one taken after never counted them)."""
        sent = self._sent.get(pod)
        if ticket is not None and sent and ticket in sent:
            sent.remove(ticket)
        left = self.in_flight.get(pod, 0) - 1
        if left > 0:
            self.in_flight[pod] = left
        else:
            self.in_flight.pop(pod, None)

    # --- the choice ------------------------------------------------------------

    def eligible(self) -> list[Replica]:
        """Serving by its pod and not refused by its guard's last reading."""
        out = []
        for r in self.replicas.values():
            reading = self.readings.get(r.pod)
            if r.serving and (reading is None or reading.ready):
                out.append(r)
        return out

    def room(self, pod: str) -> int | None:
        """Blocks the replica would admit into, net of this router's sends since the reading; None: unread."""
        reading = self.readings.get(pod)
        if reading is None:
            return None
        return reading.free_blocks - sum(x.blocks for x in self._sent.get(pod, []))

    def pick(self, cost_blocks: int, key: str | None, exclude: Iterable[str] = ()) -> Pick | None:
        """The replica for a request needing about ``cost_blocks`` KV blocks whose
        prompt has prefix ``key``; None when no replica is eligible."""
        excluded = set(exclude)
        candidates = [r for r in self.eligible() if r.pod not in excluded]
        if not candidates:
            return None
        by_pod = {r.pod: r for r in candidates}
        if key is not None:
            chosen = self._affinity(by_pod, cost_blocks, key)
            if chosen is not None:
                return Pick(chosen, Reason.AFFINITY, True)
        read = [(room, r) for r in candidates if (room := self.room(r.pod)) is not None]
        if read:
            # Most room first; among equals, fewer of our requests in flight, then a stable order.
            best = max(read, key=lambda x: (x[0], -self.in_flight.get(x[1].pod, 0), x[1].pod))[1]
            return Pick(best, Reason.KV, key is not None and self._first_on_ring(by_pod, key) == best.pod)
        best = min(candidates, key=lambda r: (self.in_flight.get(r.pod, 0), r.pod))
        return Pick(best, Reason.LEAST_BUSY, key is not None and self._first_on_ring(by_pod, key) == best.pod)

    def _ring_of(self, pods: Iterable[str]) -> Ring:
        wanted = frozenset(self.replicas)
        if wanted != self._ring_pods:
            # The ring holds every known replica, eligible or not: a replica that is briefly
            # unready keeps its keys, which pass to the next replica only while it is out.
            self._ring = Ring(wanted)
            self._ring_pods = wanted
        return self._ring

    def _first_on_ring(self, by_pod: dict[str, Replica], key: str) -> str | None:
        return next((p for p in self._ring_of(by_pod).walk(key) if p in by_pod), None)

    def _affinity(self, by_pod: dict[str, Replica], cost_blocks: int, key: str) -> Replica | None:
        """The first replica on the ring from ``key`` with room for the request and under its bounded load."""
        loads = {pod: self.in_flight.get(pod, 0) for pod in by_pod}
        # Mirrokni et al.: capacity ceil((1 + e) x mean), counting the request being placed, plus one
        # request of slack: at light load (fewer requests than replicas) the bare bound would be 1 and
        # scatter a prefix's concurrent requests, when the replica that caches it has room for them all.
        capacity = math.ceil((1 + self.load_factor) * (sum(loads.values()) + 1) / len(by_pod)) + AFFINITY_SLACK
        for pod in self._ring_of(by_pod).walk(key):
            if pod not in by_pod:
                continue
            room = self.room(pod)
            if loads[pod] + 1 <= capacity and (room is None or room >= cost_blocks):
                return by_pod[pod]
        return None
