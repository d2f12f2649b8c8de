"""vLLM's KV events, decoded, and the blocks they say its prefix cache holds (pure: bytes in, state out).

vLLM (``vllm/distributed/kv_events.py``) publishes each batch as a ZMQ multipart message (topic, sequence
number as 8 big-endian bytes, msgpack payload): a ``KVEventBatch`` encoded as an array (ts, events,
data-parallel rank) whose events are tagged maps (``{"type": "BlockStored", ...}``). The structs below
mirror the fields the guard reads; fields vLLM adds later are ignored, so the guard needs no import of vLLM.

``CachedBlocks`` keeps the set of cached blocks named by gpufleet_api.guard.kv_blocks' hash chain over token
ids (vLLM's hash to ours, counted, since two vLLM blocks differing only in keys the chain leaves out are one
block to the router) and a journal of the set's changes for the router's feed.
"""
from __future__ import annotations

import collections
import secrets
from typing import Any, Union

import msgspec

from gpufleet_api.guard import kv_blocks

GPU = "GPU"
JOURNAL_LIMIT = 65536   # changes kept for the feed; a router further behind gets the whole set


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    extra_keys: Union[list[Union[list[Any], None]], None] = None
    group_idx: Union[int, None] = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Union[bytes, int]]
    medium: Union[str, None] = None
    group_idx: Union[int, None] = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: Union[int, None] = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode(payload: bytes) -> EventBatch:
    """One published batch; msgspec.DecodeError for what is not one."""
    return _decoder.decode(payload)


def _extra(keys: list[Any] | None, lora_name: str | None) -> bytes:
    """A block's keys beyond its adapter (multimodal inputs, a cache salt), folded into its hash so that no
    plain text request matches it; vLLM lists the adapter's name first where there is one."""
    if not keys:
        return b""
    rest = keys[1:] if lora_name is not None and keys[0] == lora_name else keys
    return msgspec.msgpack.encode(rest) if rest else b""


class CachedBlocks:
    """The blocks vLLM's GPU prefix cache holds, by our hash, with the journal the feed reads."""

    def __init__(self, journal_limit: int = JOURNAL_LIMIT):
        self.block_size = 0
        self.orphans = 0            # blocks whose parent was never seen (stored before the guard followed)
        self._ours: dict[bytes | int, bytes] = {}       # vLLM's hash -> ours
        self._count: collections.Counter[bytes] = collections.Counter()
        self._journal: collections.deque[tuple[bool, bytes]] = collections.deque(maxlen=journal_limit)
        self.seq = 0                # changes made in this epoch
        self.epoch = secrets.token_hex(8)

    def __len__(self) -> int:
        return len(self._count)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self.reset()

    def reset(self) -> None:
        """Nothing cached (vLLM cleared its cache, or the guard lost events): a new epoch, so every router
        takes the whole (empty) set next."""
        self._ours.clear()
        self._count.clear()
        self._journal.clear()
        self.seq = 0
        self.epoch = secrets.token_hex(8)

    def _stored(self, e: BlockStored) -> None:
        if (e.medium not in (None, GPU)) or e.group_idx not in (None, 0):
            return   # an offloaded copy, or another KV cache group's block: not what a prefill reuses here
        self.block_size = e.block_size
        if e.parent_block_hash is None:
            parent: bytes | None = kv_blocks.root(e.lora_name)
        else:
            parent = self._ours.get(e.parent_block_hash)
        for i, theirs in enumerate(e.block_hashes):
            tokens = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
            if parent is None or len(tokens) < e.block_size:
                self.orphans += 1
                continue
            keys = e.extra_keys[i] if e.extra_keys and i < len(e.extra_keys) else None
            ours = kv_blocks.block_hash(parent, tokens, _extra(keys, e.lora_name))
            if theirs not in self._ours:
                self._ours[theirs] = ours
                self._count[ours] += 1
                if self._count[ours] == 1:
                    self._change(True, ours)
            parent = ours

    def _removed(self, e: BlockRemoved) -> None:
        if (e.medium not in (None, GPU)) or e.group_idx not in (None, 0):
            return
        for theirs in e.block_hashes:
            ours = self._ours.pop(theirs, None)
            if ours is None:
                continue
            self._count[ours] -= 1
            if self._count[ours] <= 0:
                del self._count[ours]
                self._change(False, ours)

    def _change(self, added: bool, block: bytes) -> None:
        self.seq += 1
        self._journal.append((added, block))

    def feed(self, epoch: str | None, since: int | None) -> kv_blocks.BlocksFeed:
        """What changed since the router's last answer (``epoch``, ``since``), or the whole set."""
        kept_from = self.seq - len(self._journal)   # the journal holds changes kept_from+1 .. seq
        if epoch != self.epoch or since is None or not kept_from <= since <= self.seq:
            return kv_blocks.BlocksFeed(self.epoch, self.seq, self.block_size, True, kv_blocks.pack(self._count))
        last: dict[bytes, bool] = {}
        for i in range(since - kept_from, len(self._journal)):
            added, block = self._journal[i]
            last[block] = added
        return kv_blocks.BlocksFeed(self.epoch, self.seq, self.block_size, False,
                                    kv_blocks.pack(b for b, a in last.items() if a),
                                    kv_blocks.pack(b for b, a in last.items() if not a))
