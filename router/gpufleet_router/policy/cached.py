"""What a replica's prefix cache holds, as its guard's feed says (pure): the blocks vLLM's KV events
announced, named by gpufleet_api.guard.kv_blocks' chain over token ids, kept current by the feed's deltas.

The precise counterpart of prefixes.Learned (what this router sent where): Learned cannot see vLLM evict a
prompt, nor a prompt another router sent; the feed cannot see what was sent since its last answer. choice.py
reads both."""
from __future__ import annotations

from typing import Sequence

from gpufleet_api.guard import kv_blocks


class CacheView:
    """One replica's cached blocks as of ``taken_at`` (the router's clock when the feed was read)."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.block_size = 0
        self.epoch: str | None = None
        self.seq: int | None = None
        self.taken_at = float("-inf")

    def __len__(self) -> int:
        return len(self.blocks)

    def apply(self, feed: kv_blocks.BlocksFeed, taken_at: float) -> None:
        """The guard's answer to (``epoch``, ``seq``): the whole set or what changed since."""
        added = kv_blocks.unpack(feed.added)
        if feed.full:
            self.blocks = set(added)
        else:
            self.blocks.difference_update(kv_blocks.unpack(feed.removed))
            self.blocks.update(added)
        self.block_size, self.epoch, self.seq, self.taken_at = feed.block_size, feed.epoch, feed.seq, taken_at

    def match(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of the prompt's token chain the cache holds: vLLM reuses a prefix up to its first
        block not cached."""
        for depth, block in enumerate(chain):
            if block not in self.blocks:
                return depth
        return len(chain)
