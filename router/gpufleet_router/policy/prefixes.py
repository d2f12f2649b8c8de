"""A prompt's prefix and what this router remembers sending where (pure): the learned placement of
choice.py.

``prefix_of`` hashes a prompt's leading whole blocks into a chain, one cumulative hash per block;
``Learned`` keeps, per replica, the blocks this router sent there, an LRU sized to the replica's KV pool;
``Ring`` is the consistent-hash ring a prefix no replica holds is placed by."""
from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

VIRTUAL_NODES = 64
MATCH_BLOCKS = 64      # leading blocks of a prompt remembered per replica
DEFAULT_POOL_BLOCKS = 4096  # a replica's learned blocks before its first reading says how large its pool is
# Learned blocks kept per block of the replica's pool. The router counts 4 characters a token; tokenizers take
# 4-6 on English text, so its blocks are up to 1.5x as many as vLLM's for one prompt: an LRU of the pool's size
# forgets prompts vLLM still holds, and the next request is placed anew elsewhere (a second prefill). Erring
# the other way costs one miss where the prompt was, which then caches it again.
LEARNED_PER_POOL_BLOCK = 2


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prompt's leading whole blocks: ``key`` (the first ``prefix_blocks`` of them, for the ring)
    and ``chain``, one cumulative hash per block (the i-th names the first i + 1 blocks). ``tokens``: the
    chain over the prompt's token ids in blocks of ``block_size`` (gpufleet_api.guard.kv_blocks), where the
    router could tokenize it as vLLM does: what the guards' feeds name cached blocks by (cached.py)."""
    key: str
    chain: tuple[bytes, ...]
    tokens: tuple[bytes, ...] = ()
    block_size: int = 0


def prefix_of(text: str, block_chars: int, blocks: int, match_blocks: int = MATCH_BLOCKS,
              adapter: str | None = None) -> Prefix | None:
    """The prompt's leading whole blocks of ``block_chars`` characters: the ring key hashes the first
    ``blocks`` (0 turns prefixes off), the chain covers up to ``max(blocks, match_blocks)``. None when the
    prompt is shorter than one block (nothing a prefix cache would reuse): vLLM caches whole blocks.
    With ``adapter``, the hashes start from its name: one prompt through two adapters is two prefixes."""
    if block_chars <= 0 or blocks <= 0:
        return None
    whole = min(max(blocks, match_blocks), len(text) // block_chars)
    if whole == 0:
        return None
    h = hashlib.blake2b(digest_size=8)
    if adapter is not None:
        h.update(adapter.encode() + b"\0")
    chain = []
    for i in range(whole):
        h.update(text[i * block_chars:(i + 1) * block_chars].encode())
        chain.append(h.copy().digest())
    return Prefix(chain[min(blocks, whole) - 1].hex(), tuple(chain))


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


class Learned:
    """The leading blocks this router sent to one replica, least recently sent first, at most ``capacity``;
    ``prefixes`` counts the distinct prompt keys among them (the footprint new prefixes are spread by)."""

    def __init__(self, capacity: int = DEFAULT_POOL_BLOCKS):
        self.capacity = max(1, capacity)
        self.prefixes = 0
        # block -> (is a key, when last sent)
        self._blocks: collections.OrderedDict[bytes, tuple[bool, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, chain: Sequence[bytes], since: float | None = None) -> int:
        """How many of the chain's leading blocks are held (a block's hash names its whole prefix; tails
        go before heads, so the longest held block ends the held run); with ``since``, sent since then."""
        for depth in range(len(chain), 0, -1):
            held = self._blocks.get(chain[depth - 1])
            if held is not None and (since is None or held[1] >= since):
                return depth
        return 0

    def add(self, prefix: Prefix, at: float = 0.0) -> None:
        # Last block first, so the chain's tail is older than its head and goes first (as vLLM frees a
        # request's blocks tail first, evicting the ends of prefixes before their shared starts).
        key = bytes.fromhex(prefix.key)
        for block in reversed(prefix.chain):
            held = self._blocks.get(block)
            if held is not None:
                self._blocks[block] = (held[0], at)
                self._blocks.move_to_end(block)
            else:
                is_key = block == key
                self._blocks[block] = (is_key, at)
                self.prefixes += is_key
        self.resize(self.capacity)

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        while len(self._blocks) > self.capacity:
            self.prefixes -= self._blocks.popitem(last=False)[1][0]
