"""vLLM's KV events as vLLM encodes them (its own event classes, msgspec) → the guard's cached-block set and
the router's feed (engine_image/gpufleet_engine/vllm/kv_events.py, serving/kv_subscriber.py)."""
from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from gpufleet_api.guard import kv_blocks
from gpufleet_api.guard.guard_config import KVEventsConfig
from gpufleet_engine.serving.kv_subscriber import KVEventsFollower
from gpufleet_engine.vllm.kv_events import CachedBlocks, decode

BS = 4
PROMPT = list(range(100, 100 + 3 * BS + 2))   # three whole blocks and two tokens


def wire(*events, ts: float = 1.0) -> bytes:
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=ts, events=list(events)))


def stored(hashes, tokens, parent=None, lora=None, extra=None, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       lora_id=1 if lora else None, medium=medium, lora_name=lora, extra_keys=extra)


def held(blocks: CachedBlocks) -> set[bytes]:
    return set(kv_blocks.unpack(blocks.feed(None, None).added))


def test_a_stored_run_is_named_by_the_routers_chain_over_its_tokens():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([b"v1", b"v2"], PROMPT[:2 * BS]))))
    # A later step stores the third block as the child of the second (vLLM's parent hash).
    blocks.apply(decode(wire(stored([b"v3"], PROMPT[2 * BS:3 * BS], parent=b"v2"))))
    assert held(blocks) == set(kv_blocks.chain(PROMPT, BS))
    assert blocks.block_size == BS


def test_integer_block_hashes_decode_as_well():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([11, 12], PROMPT[:2 * BS]))))
    blocks.apply(decode(wire(stored([13], PROMPT[2 * BS:3 * BS], parent=12))))
    assert held(blocks) == set(kv_blocks.chain(PROMPT, BS))


def test_an_adapters_blocks_match_only_that_adapters_chain():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([b"a1"], PROMPT[:BS], lora="sql", extra=[("sql",)]))))
    assert held(blocks) == set(kv_blocks.chain(PROMPT, BS, adapter="sql", limit=1))
    assert not held(blocks) & set(kv_blocks.chain(PROMPT, BS))


def test_a_salted_block_matches_no_plain_request():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([b"s1"], PROMPT[:BS], extra=[("tenant-salt",)]))))
    assert len(blocks) == 1
    assert not held(blocks) & set(kv_blocks.chain(PROMPT, BS))


def test_offloaded_copies_and_orphans_are_not_counted():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([b"c1"], PROMPT[:BS], medium="CPU"),
                             stored([b"o2"], PROMPT[BS:2 * BS], parent=b"never-seen"))))
    assert len(blocks) == 0 and blocks.orphans == 1


def test_removal_and_the_feeds_delta():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([b"v1", b"v2", b"v3"], PROMPT[:3 * BS]))))
    first = blocks.feed(None, None)
    assert first.full and len(kv_blocks.unpack(first.added)) == 3
    blocks.apply(decode(wire(BlockRemoved(block_hashes=[b"v3"], medium="GPU"))))
    delta = blocks.feed(first.epoch, first.seq)
    chain = kv_blocks.chain(PROMPT, BS)
    assert not delta.full and kv_blocks.unpack(delta.removed) == [chain[2]] and delta.added == b""
    # Nothing since: an empty delta; a sequence number from the future or another epoch: the whole set.
    assert blocks.feed(delta.epoch, delta.seq).added == b"" and not blocks.feed(delta.epoch, delta.seq).full
    assert blocks.feed("another", delta.seq).full and blocks.feed(delta.epoch, delta.seq + 5).full


def test_a_router_too_far_behind_gets_the_whole_set():
    blocks = CachedBlocks(journal_limit=2)
    blocks.apply(decode(wire(stored([b"v1", b"v2", b"v3"], PROMPT[:3 * BS]))))
    assert blocks.feed(blocks.epoch, 0).full
    assert not blocks.feed(blocks.epoch, 1).full


def test_all_blocks_cleared_starts_a_new_epoch_with_nothing():
    blocks = CachedBlocks()
    blocks.apply(decode(wire(stored([b"v1"], PROMPT[:BS]))))
    before = blocks.feed(None, None)
    blocks.apply(decode(wire(AllBlocksCleared())))
    after = blocks.feed(before.epoch, before.seq)
    assert after.full and after.added == b"" and after.epoch != before.epoch


def test_a_gap_in_vllms_sequence_numbers_starts_the_set_again():
    follower = KVEventsFollower(KVEventsConfig(endpoint="ipc:///nowhere"))
    follower.take([b"", (0).to_bytes(8, "big"), wire(stored([b"v1"], PROMPT[:BS]))])
    epoch = follower.blocks.epoch
    follower.take([b"", (1).to_bytes(8, "big"), wire(stored([b"v2"], PROMPT[BS:2 * BS], parent=b"v1"))])
    assert len(follower.blocks) == 2 and follower.gaps == 0
    follower.take([b"", (5).to_bytes(8, "big"), wire(stored([b"w1"], PROMPT[:BS]))])
    assert follower.gaps == 1 and follower.blocks.epoch != epoch and len(follower.blocks) == 1


def test_an_undecodable_batch_is_counted_and_skipped():
    follower = KVEventsFollower(KVEventsConfig(endpoint="ipc:///nowhere"))
    follower.take([b"", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
    follower.take([b"only two", b"frames"])
    assert follower.undecodable == 2 and len(follower.blocks) == 0


@pytest.mark.parametrize("packed", [b"", b"x" * 8, b"y" * 24])
def test_pack_and_unpack_round_trip(packed):
    assert kv_blocks.pack(kv_blocks.unpack(packed)) == packed


def test_unpack_refuses_a_partial_hash():
    with pytest.raises(ValueError, match="whole number"):
        kv_blocks.unpack(b"x" * 9)
