"""Which replica takes a request: pure, no I/O, no clock of its own.

Three signals, in this order:

1. Learned placement. Requests whose prompts begin with the same blocks (a
   shared system prompt) should reach the replica that already holds those
   blocks in vLLM's prefix cache. The router remembers, per replica, the
   leading blocks of the prompts it sent there: a chain of cumulative hashes,
   one per whole block of the prompt (up to ``MATCH_BLOCKS``), kept in an LRU
   twice as large as the replica's KV pool (its reading's total blocks; the
   router's blocks, at 4 characters a token, outnumber vLLM's), so what the
   LRU forgets is about what vLLM's own LRU evicted. A request goes to
   the replica holding the longest run of its leading blocks, when that run
   covers at least half of its chain (as SGLang's and vllm-router's
   cache_aware do with their prefix trees); equal runs are ordered by the
   consistent-hash ring from the prompt's key (below).

   Where the replica's guard feeds what vLLM's prefix cache really holds
   (its KV events, cached.py) and the router tokenized the prompt as vLLM
   does, the held run is the longer of the cache's own (the prompt's token
   blocks cached, in order) and what the router sent there in the last
   ``FEED_LAG_SECONDS`` before the feed was read (a prompt whose prefill has
   not yet reached the feed): the feed corrects what the learned LRU gets
   wrong (an eviction it guessed too late or too early, a prompt another
   router sent), the recent sends cover the feed's lag; such a run (in
   token blocks) is followed from one block, as vLLM reuses any cached run.
   Without a feed (events off, an older guard, no tokenizer yet) the
   learned run alone.
2. Placement of a prefix no replica holds. Walking the consistent-hash ring
   from the hash of the prompt's leading blocks, the first replica whose
   learned footprint (distinct prompt keys remembered) is at most
   ``FOOTPRINT_SLACK`` over the smallest, or within ``FOOTPRINT_FACTOR`` of
   the mean with this prompt added, takes it. The ring makes every router place a new prefix on the
   same replica without talking to the others; the footprint bound spreads
   distinct prefixes evenly over the pools, which the bare ring (a few
   prompts, a few replicas) does not.

   Both are under a bounded load (Mirrokni et al., "Consistent Hashing with
   Bounded Loads"): a replica already carrying ceil((1 + load_factor) x the
   mean) + 1 of the router's requests in flight, or without room for the
   request, is not chosen, so a popular prefix spills to another replica
   (which then caches it too) instead of piling onto one.
3. Free KV, for everything else (a prompt shorter than one block, or no
   replica within its bound and with room): the replica with the most KV
   blocks free for admission: the guard's last reading, less what this
   router sent it since that reading was taken and is still running (the
   reading cannot include those yet; finished ones freed their blocks).

Replicas that are not ready or are draining are never chosen (and a replica
whose guard says not ready forgets what was learned of it: an engine that
restarted has an empty cache). A replica not read yet counts as having no
known room: it is chosen by placement or, when nothing has been read, by the
fewest requests in flight from this router.

A request for a LoRA adapter goes only to replicas whose last successful
reading says they hold it loaded (``Reading.adapters``; a read that fails
since, as a guard too busy to answer in time does, does not unsay it); the
signals above choose among those. Its prefix is keyed with the adapter's
name: vLLM caches an adapter's blocks apart from the base model's and other
adapters'.

``Policy.ROUND_ROBIN`` ignores all of the above but eligibility (and the
adapter's holders): each request goes to the next replica in name order. It
is the baseline the benchmarks compare against, not a production choice.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from .cached import CacheView
from .prefixes import DEFAULT_POOL_BLOCKS, LEARNED_PER_POOL_BLOCK, Learned, Prefix, Ring
from .replicas import Reading, Replica

DEFAULT_LOAD_FACTOR = 0.25
AFFINITY_SLACK = 1     # requests over the bounded-load capacity a prefix's replica may still take
# A new prefix's ring replica may hold this many learned prefixes more than the fewest, or this much more than
# the mean (bench/router_placement_sim.py: slack 0 is best for one router, 1 keeps two routers near the ring).
FOOTPRINT_SLACK = 1
FOOTPRINT_FACTOR = 0.1
# How long after a send the prompt's blocks may still be missing from the guard's feed: its queue and prefill
# on a busy replica, vLLM's publishing, the router's next read. Sends this recent count as held.
FEED_LAG_SECONDS = 5.0


class Reason:
    """Why a replica was picked: the ``reason`` label of gpufleet_router_picks_total."""
    AFFINITY = "prefix_affinity"   # the replica holding the longest run of the prompt's leading blocks
    NEW_PREFIX = "prefix_placed"   # a prefix no replica holds: its ring replica, or the smallest footprint
    KV = "kv_free"                 # the most free KV blocks net of the router's own sends
    LEAST_BUSY = "least_in_flight"  # no reading yet anywhere: fewest in flight from this router


    ROUND_ROBIN = "round_robin"    # --policy round_robin: the next replica in turn


REASONS = (Reason.AFFINITY, Reason.NEW_PREFIX, Reason.KV, Reason.LEAST_BUSY, Reason.ROUND_ROBIN)


class Policy:
    """How a replica is chosen among the eligible ones (the router's ``--policy``)."""
    KV_AWARE = "kv_aware"          # prefix affinity, then free KV (this module's docstring)
    ROUND_ROBIN = "round_robin"    # each in turn, by name: the benchmarks' baseline


POLICIES = (Policy.KV_AWARE, Policy.ROUND_ROBIN)


@dataclasses.dataclass(eq=False)
class Sent:
    """One request this router sent, counted against its replica's room until a reading includes it
    or it finishes (compared by identity: two requests of one size at one instant are two)."""
    at: float
    blocks: int


@dataclasses.dataclass(frozen=True)
class Pick:
    replica: Replica
    reason: str
    affinity_hit: bool         # the replica holds (as far as this router learned) the prompt's prefix


class Split:
    """The canary's share of a service's new requests (status.rollout.canaryWeightPercent), spread evenly
    by smooth weighted round robin (nginx's): of every 100 requests, exactly ``percent`` go to the canary,
    interleaved, not in runs."""

    def __init__(self) -> None:
        self._credit = {True: 0, False: 0}   # to the canary?

    def canary_next(self, percent: int) -> bool:
        percent = min(100, max(0, percent))
        weights = {True: percent, False: 100 - percent}
        for side in weights:
            self._credit[side] += weights[side]
        chosen = max((True, False), key=lambda side: (self._credit[side], side))
        self._credit[chosen] -= 100
        return chosen


class Picker:
    """One service's replicas as this router sees them: readings, its own
    sends since each reading, its requests in flight and the prefixes it sent."""

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR, policy: str = Policy.KV_AWARE):
        if load_factor < 0:
            raise ValueError(f"load_factor must be >= 0, got {load_factor}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.load_factor = load_factor
        self.policy = policy
        self._turn = 0   # round robin: picks made so far
        self.replicas: dict[str, Replica] = {}
        self.readings: dict[str, Reading] = {}
        self.in_flight: dict[str, int] = {}
        self.learned: dict[str, Learned] = {}
        self.cached: dict[str, CacheView] = {}   # pod -> its prefix cache, as its guard's feed says
        # pod -> the LoRA adapters its last successful reading said it holds loaded. Kept through failed reads
        # (a guard too busy to answer /metrics in time, on a node starting another engine, still holds them:
        # an adapter goes only by an unload, which a reading shows, or with its engine, which its pod shows).
        self.adapters: dict[str, frozenset[str]] = {}
        self._sent: dict[str, list[Sent]] = {}  # pod -> requests sent since its last reading, still running
        self._ring = Ring(())
        self._ring_pods: frozenset[str] = frozenset()
        # A canary in progress: its revision and share of new requests (the rest go to the other replicas).
        self.canary_revision = ""
        self.canary_percent = 0
        self.split = Split()

    # --- what the router learns --------------------------------------------

    def set_replicas(self, replicas: Sequence[Replica]) -> None:
        before = self.replicas
        self.replicas = {r.pod: r for r in replicas}
        for pod, r in self.replicas.items():
            was = before.get(pod)
            if r.serving and was is not None and not was.serving:
                # Back to Ready (its engine restarted): the last reading was taken while it was down
                # and says "not ready" until the next read; its pod's readiness is the newer word.
                self.readings.pop(pod, None)
                self.adapters.pop(pod, None)   # its engine restarted: adapters are loaded again, and read
                self.cached.pop(pod, None)
        for table in (self.readings, self._sent, self.learned, self.adapters, self.cached):
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
        self.adapters[pod] = reading.adapters
        # Sends before the read began are in its numbers; later ones are not.
        self._sent[pod] = [x for x in self._sent.get(pod, []) if x.at >= reading.taken_at]
        if not reading.ready:
            self.learned.pop(pod, None)   # draining or its engine down: its cache will not be there
            self.cached.pop(pod, None)
        elif reading.total_blocks > 0:
            self._learned(pod).resize(LEARNED_PER_POOL_BLOCK * reading.total_blocks)

    def cache_view(self, pod: str) -> CacheView | None:
        """The replica's feed state to apply the next answer to (created on first use); None: not a replica."""
        if pod not in self.replicas:
            return None
        return self.cached.setdefault(pod, CacheView())

    def no_cache_feed(self, pod: str) -> None:
        """The replica's guard feeds nothing (events off, an older guard) or its feed failed: learned only."""
        self.cached.pop(pod, None)

    def _learned(self, pod: str) -> Learned:
        learned = self.learned.get(pod)
        if learned is None:
            reading = self.readings.get(pod)
            learned = self.learned[pod] = Learned(LEARNED_PER_POOL_BLOCK * (
                reading.total_blocks if reading and reading.total_blocks > 0 else DEFAULT_POOL_BLOCKS))
        return learned

    def sent(self, pod: str, blocks: int, now: float, prefix: Prefix | None = None) -> Sent:
        """A request went to ``pod``; pass what this returns to ``finished``."""
        ticket = Sent(now, max(0, blocks))
        self._sent.setdefault(pod, []).append(ticket)
        self.in_flight[pod] = self.in_flight.get(pod, 0) + 1
        if prefix is not None and pod in self.replicas:
            self._learned(pod).add(prefix, now)
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

    def recovering(self, revision: str, exclude: Iterable[str] = ()) -> bool:
        """A replica of ``revision`` (outside ``exclude``) that is not eligible now but is not being
        deleted either: its engine restarting, or its guard's last reading not ready. It may take
        requests again in a moment."""
        excluded, eligible = set(exclude), {r.pod for r in self.eligible()}
        return any(r.revision == revision and r.pod not in excluded and r.pod not in eligible and not r.terminating
                   for r in self.replicas.values())

    def holds(self, pod: str, adapter: str) -> bool:
        """The replica's last successful reading says it holds ``adapter`` loaded (never read: not known to;
        a read failed since: still held)."""
        return adapter in self.adapters.get(pod, frozenset())

    def holders(self, adapter: str) -> list[Replica]:
        """The eligible replicas holding ``adapter`` loaded."""
        return [r for r in self.eligible() if self.holds(r.pod, adapter)]

    def room(self, pod: str) -> int | None:
        """Blocks the replica would admit into, net of this router's sends since the reading; None: unread."""
        reading = self.readings.get(pod)
        if reading is None:
            return None
        return reading.free_blocks - sum(x.blocks for x in self._sent.get(pod, []))

    def match(self, pod: str, prefix: Prefix) -> int:
        """Leading blocks of the prompt ``pod`` holds: with its feed and the prompt's tokens, the cache's run
        or the run sent there lately, whichever is longer; else what this router sent there and remembers.
        Counted in the prompt's token blocks where it has them (``depth``), else in its text blocks."""
        learned = self.learned.get(pod)
        view = self.cached.get(pod)
        if not prefix.tokens:
            return learned.match(prefix.chain) if learned else 0
        if view is None or view.block_size != prefix.block_size or view.epoch is None:
            return self._in_tokens(prefix, learned.match(prefix.chain) if learned else 0)
        recent = learned.match(prefix.chain, since=view.taken_at - FEED_LAG_SECONDS) if learned else 0
        return max(view.match(prefix.tokens), self._in_tokens(prefix, recent))

    @staticmethod
    def _in_tokens(prefix: Prefix, text_blocks: int) -> int:
        """A run of the prompt's text blocks as a run of its token blocks (the same share of the prompt)."""
        return min(len(prefix.tokens), -(-text_blocks * len(prefix.tokens) // len(prefix.chain)))

    def pick(self, cost_blocks: int, prefix: Prefix | None, exclude: Iterable[str] = (),
             adapter: str | None = None, revision: str | None = None, strict: bool = False) -> Pick | None:
        """The replica for a request needing about ``cost_blocks`` KV blocks whose prompt begins with
        ``prefix``, through ``adapter`` when it names one; None when no replica is eligible (for an
        adapter: none eligible holds it).

        The revision first: with ``revision`` (a retry or a resumption of a request already placed),
        a replica of that revision when one is eligible (``strict``: only those); without, during a
        canary, the canary's share of requests goes to its revision and the rest to the others (when one
        side has no eligible replica, all go to the other); then the policy within the group."""
        excluded = set(exclude)
        candidates = [r for r in (self.eligible() if adapter is None else self.holders(adapter))
                      if r.pod not in excluded]
        if revision is not None:
            same = [r for r in candidates if r.revision == revision]
            candidates = same if same or strict else candidates
        elif self.canary_revision and 0 < self.canary_percent:
            canary = [r for r in candidates if r.revision == self.canary_revision]
            stable = [r for r in candidates if r.revision != self.canary_revision]
            if canary and stable:
                candidates = canary if self.split.canary_next(self.canary_percent) else stable
        if not candidates:
            return None
        if self.policy == Policy.ROUND_ROBIN:
            candidates.sort(key=lambda r: r.pod)
            self._turn += 1
            return Pick(candidates[(self._turn - 1) % len(candidates)], Reason.ROUND_ROBIN, False)
        by_pod = {r.pod: r for r in candidates}
        held = {}
        if prefix is not None:
            held = {pod: self.match(pod, prefix) for pod in by_pod}
            chosen = self._by_prefix(by_pod, cost_blocks, prefix, held)
            if chosen is not None:
                return chosen
        read = [(room, r) for r in candidates if (room := self.room(r.pod)) is not None]
        if read:
            # Most room first; among equals, fewer of our requests in flight, then a stable order.
            best = max(read, key=lambda x: (x[0], -self.in_flight.get(x[1].pod, 0), x[1].pod))[1]
            return Pick(best, Reason.KV, self._holds(prefix, held.get(best.pod, 0)))
        best = min(candidates, key=lambda r: (self.in_flight.get(r.pod, 0), r.pod))
        return Pick(best, Reason.LEAST_BUSY, self._holds(prefix, held.get(best.pod, 0)))

    @staticmethod
    def _holds(prefix: Prefix | None, matched: int) -> bool:
        """A match long enough to follow: at least half of the prompt's text chain (and a block), a guess from
        what this router sent; counted in token blocks (the caches' feeds read), any block, as vLLM reuses
        any cached run: a prompt whose tail was evicted is still cheaper where its head is."""
        if prefix is None or matched <= 0:
            return False
        return bool(prefix.tokens) or 2 * matched >= len(prefix.chain)

    def _ring_of(self, pods: Iterable[str]) -> Ring:
        wanted = frozenset(self.replicas)
        if wanted != self._ring_pods:
            # The ring holds every known replica, eligible or not: a replica that is briefly
            # unready keeps its keys, which pass to the next replica only while it is out.
            self._ring = Ring(wanted)
            self._ring_pods = wanted
        return self._ring

    def _by_prefix(self, by_pod: dict[str, Replica], cost_blocks: int, prefix: Prefix,
                   held: dict[str, int]) -> Pick | None:
        """Among the replicas under the bounded load and with room: the longest held run of the
        prompt's blocks; without one, a new placement on the ring within the footprint bound."""
        loads = {pod: self.in_flight.get(pod, 0) for pod in by_pod}
        # Mirrokni et al.: capacity ceil((1 + e) x mean), counting the request being placed, plus one
        # request of slack: at light load (fewer requests than replicas) the bare bound would be 1 and
        # scatter a prefix's concurrent requests, when the replica that caches it has room for them all.
        capacity = math.ceil((1 + self.load_factor) * (sum(loads.values()) + 1) / len(by_pod)) + AFFINITY_SLACK
        order = [pod for pod in self._ring_of(by_pod).walk(prefix.key) if pod in by_pod]
        # A replica holding the prompt's leading blocks needs room for the rest only (vLLM shares the
        # cached blocks); should its guard's ledger still refuse, the retry goes to another replica.
        open_ = [pod for pod in order if loads[pod] + 1 <= capacity
                 and ((room := self.room(pod)) is None or room >= cost_blocks - held[pod])]
        if not open_:
            return None
        best = max(open_, key=lambda pod: held[pod])   # the first of the longest, in ring order
        if self._holds(prefix, held[best]):
            return Pick(by_pod[best], Reason.AFFINITY, True)
        # Nobody holds it: the first replica in ring order not holding more than its share of the learned
        # prefixes: FOOTPRINT_SLACK over the fewest, or FOOTPRINT_FACTOR over the mean with this one added.
        # The slack keeps two routers, whose learned sets differ, mostly on the ring's (common) choice.
        footprint = {pod: self.learned[pod].prefixes if pod in self.learned else 0 for pod in open_}
        bound = max(min(footprint.values()) + FOOTPRINT_SLACK,
                    (1 + FOOTPRINT_FACTOR) * (sum(footprint.values()) + 1) / len(open_) - 1)
        chosen = next(pod for pod in open_ if footprint[pod] <= bound)
        return Pick(by_pod[chosen], Reason.NEW_PREFIX, False)
