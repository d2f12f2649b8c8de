"""The blocks a replica's prefix cache holds, as the guard tells the router (pure; one source for both).

vLLM publishes its KV events (``--kv-events-config``: BlockStored, BlockRemoved, AllBlocksCleared) on a
ZMQ socket inside the engine pod; the guard follows them and names each cached block by ``block_hash``: a
chain over the block's token ids, not vLLM's own hash (whose algorithm, seed and encoding are vLLM's
internals and a flag's choice). The router tokenizes a request as vLLM does and hashes its blocks the same
way, so a block it computes is in the guard's set exactly when vLLM holds that prefix.

The feed (``KV_BLOCKS_PATH``): the router asks with the epoch and sequence number of its last answer and
gets what changed since (``full`` false), or the whole set (``full`` true) when it has none, the guard
restarted its index (a new epoch) or the changes asked for are older than the guard keeps.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

import msgspec

KV_BLOCKS_PATH = "/kv/blocks"        # the feed: ?epoch=<epoch>&since=<seq>
KV_TOKENIZER_PATH = "/kv/tokenizer"  # the model's tokenizer.json and chat template, for the router to tokenize
# Where vLLM publishes its events in a pod: the guard binds this loopback address and vLLM's publisher
# connects (vLLM binds only ipc:// and wildcard endpoints: publisher_binds); no port leaves the pod.
KV_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"
HASH_BYTES = 8
_ROOT_SEED = b"gpufleet-kv-blocks\0"


class BlocksFeed(msgspec.Struct, frozen=True, rename="camel"):
    """One answer of the feed. ``added`` / ``removed``: block hashes, HASH_BYTES each, concatenated
    (base64 in JSON). With ``full``, ``added`` is the whole set and ``removed`` is empty."""
    epoch: str
    seq: int
    block_size: int
    full: bool
    added: bytes = b""
    removed: bytes = b""


class TokenizerFiles(msgspec.Struct, frozen=True, rename="camel"):
    """What the router needs to tokenize a request as vLLM does: the model's ``tokenizer.json`` (the
    ``tokenizers`` library's format), its chat template and the special tokens the template names."""
    tokenizer: str
    chat_template: str | None = None
    special_tokens: dict[str, str] = msgspec.field(default_factory=dict)   # bos_token, eos_token, ...


def root(adapter: str | None) -> bytes:
    """The chain's start: vLLM keys an adapter's blocks apart from the base model's and other adapters'."""
    return hashlib.blake2b(_ROOT_SEED + (adapter or "").encode(), digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """One block's hash: its parent's (the prefix before it, or ``root``), its token ids and ``extra``
    (vLLM's other per-block keys, as a cache salt: a block with any is one no plain request matches)."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    if extra:
        h.update(extra)
    return h.digest()


def chain(token_ids: Sequence[int], block_size: int, adapter: str | None = None,
          limit: int | None = None) -> tuple[bytes, ...]:
    """The hashes of the prompt's whole blocks, in order (at most ``limit``): vLLM caches whole blocks."""
    if block_size <= 0:
        return ()
    whole = len(token_ids) // block_size
    if limit is not None:
        whole = min(whole, limit)
    parent, out = root(adapter), []
    for i in range(whole):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return tuple(out)


def pack(hashes: Iterable[bytes]) -> bytes:
    return b"".join(hashes)


def unpack(packed: bytes) -> list[bytes]:
    """The hashes ``pack`` joined; ValueError for a length that is not a whole number of them."""
    if len(packed) % HASH_BYTES:
        raise ValueError(f"{len(packed)} bytes is not a whole number of {HASH_BYTES}-byte block hashes")
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule (ZmqEventPublisher._is_bind_endpoint): its publisher binds wildcard and ipc/inproc
    endpoints and connects to the rest; the guard's subscriber does the other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
