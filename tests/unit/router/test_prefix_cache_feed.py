"""The pick by what the replicas' prefix caches hold (policy/cached.py, choice.py), the feed between the guard
and the router over HTTP (serving/kv_subscriber.py → cache_feed.py), and the router's tokenizer against the
guard's (prompt_tokens.py: the same token ids as transformers renders and tokenizes)."""
from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest
from aiohttp import ClientSession, ClientTimeout, web
from tokenizers import Tokenizer, models, pre_tokenizers

from gpufleet_api.guard import kv_blocks
from gpufleet_api.guard.guard_config import KVEventsConfig
from gpufleet_engine.admission.tokens import HfTokenizer
from gpufleet_engine.serving import kv_subscriber
from gpufleet_engine.vllm.kv_events import BlockRemoved, BlockStored, EventBatch
from gpufleet_router import cache_feed
from gpufleet_router.policy.cached import CacheView
from gpufleet_router.policy.choice import FEED_LAG_SECONDS, Picker, Reason
from gpufleet_router.policy.prefixes import Prefix, prefix_of
from gpufleet_router.policy.replicas import Reading, Replica
from gpufleet_router.prompt_tokens import PromptTokens

BS = 4
TEXT_BLOCK = BS * 4


def picker(*pods: str) -> Picker:
    p = Picker()
    p.set_replicas([Replica(pod, f"10.0.0.{i}:8080", True) for i, pod in enumerate(pods)])
    for pod in pods:
        p.observe(pod, Reading(taken_at=0.0, ready=True, free_blocks=100, total_blocks=100))
    return p


def prompt(i: int) -> tuple[Prefix, list[int]]:
    """A prompt of 8 token blocks (its text about as long) and its token ids."""
    ids = [1000 * i + t for t in range(8 * BS)]
    text = "".join(f"w{t:03d}" for t in ids)[:8 * TEXT_BLOCK]
    base = prefix_of(text, TEXT_BLOCK, 2)
    assert base is not None
    return dataclasses.replace(base, tokens=kv_blocks.chain(ids, BS), block_size=BS), ids


def feed_of(blocks: list[bytes], epoch: str = "e1", seq: int = 1) -> kv_blocks.BlocksFeed:
    return kv_blocks.BlocksFeed(epoch, seq, BS, True, kv_blocks.pack(blocks))


def view(p: Picker, pod: str, blocks: list[bytes], at: float) -> None:
    cache = p.cache_view(pod)
    assert cache is not None
    cache.apply(feed_of(blocks), at)


def test_the_view_follows_the_whole_set_then_the_changes():
    v = CacheView()
    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    v.apply(feed_of([a, b]), 1.0)
    assert v.match([a, b, c]) == 2 and v.match([b]) == 1 and v.match([c, a]) == 0
    v.apply(kv_blocks.BlocksFeed("e1", 3, BS, False, kv_blocks.pack([c]), kv_blocks.pack([b])), 2.0)
    assert v.blocks == {a, c} and v.seq == 3 and v.taken_at == 2.0
    assert v.match([a, b, c]) == 1    # vLLM stops reusing at the first block not cached


def test_the_cache_that_holds_the_prompt_wins_over_a_stale_learned_placement():
    p = picker("a", "b")
    prefix, _ = prompt(1)
    p.finished("a", p.sent("a", 4, 0.0, prefix))        # the router sent it to a long ago ...
    view(p, "a", [], at=100.0)                           # ... and a's cache has evicted it since
    view(p, "b", list(prefix.tokens), at=100.0)          # b holds it (another router sent it there)
    pick = p.pick(4, prefix)
    assert pick is not None and pick.replica.pod == "b" and pick.reason == Reason.AFFINITY and pick.affinity_hit


def test_a_recent_send_counts_until_the_feed_can_show_it():
    p = picker("a", "b")
    prefix, _ = prompt(2)
    ring_first = p.pick(4, prefix)
    assert ring_first is not None
    other = "b" if ring_first.replica.pod == "a" else "a"
    p.finished(other, p.sent(other, 4, 100.0 - FEED_LAG_SECONDS / 2, prefix))
    for pod in ("a", "b"):
        view(p, pod, [], at=100.0)
    pick = p.pick(4, prefix)
    assert pick is not None and pick.replica.pod == other and pick.reason == Reason.AFFINITY
    # Past the lag the feed's word stands: nothing is held, the ring places it anew.
    for pod in ("a", "b"):
        view(p, pod, [], at=100.0 + 2 * FEED_LAG_SECONDS)
    again = p.pick(4, prefix)
    assert again is not None and again.reason == Reason.NEW_PREFIX


def test_without_a_feed_the_learned_placement_decides_as_before():
    p = picker("a", "b")
    prefix, _ = prompt(3)
    first = p.pick(4, prefix)
    assert first is not None
    p.finished(first.replica.pod, p.sent(first.replica.pod, 4, 0.0, prefix))
    p.no_cache_feed("a")
    p.no_cache_feed("b")
    pick = p.pick(4, prefix)
    assert pick is not None and pick.replica.pod == first.replica.pod and pick.reason == Reason.AFFINITY


def test_a_feed_of_another_block_size_is_not_read_for_the_prompt():
    p = picker("a", "b")
    prefix, _ = prompt(4)
    cache = p.cache_view("b")
    assert cache is not None
    cache.apply(kv_blocks.BlocksFeed("e", 1, BS * 2, True, kv_blocks.pack(prefix.tokens)), 10.0)
    assert p.match("b", prefix) == 0


def test_an_unready_replica_forgets_its_view():
    p = picker("a")
    prefix, _ = prompt(5)
    view(p, "a", list(prefix.tokens), at=1.0)
    p.observe("a", Reading(taken_at=2.0, ready=False, free_blocks=0, total_blocks=100))
    assert "a" not in p.cached


async def test_the_router_reads_the_guards_feed_whole_then_by_changes():
    follower = kv_subscriber.KVEventsFollower(KVEventsConfig(endpoint="ipc:///nowhere"))
    ids = list(range(3 * BS))
    enc = msgspec.msgpack.Encoder()
    follower.take([b"", (0).to_bytes(8, "big"), enc.encode(EventBatch(0.0, [BlockStored(
        [b"v1", b"v2", b"v3"], None, ids, BS, medium="GPU")]))])
    app = web.Application()
    app.router.add_get(kv_blocks.KV_BLOCKS_PATH, kv_subscriber.blocks_route(follower))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = f"127.0.0.1:{runner.addresses[0][1]}"
    p = picker("a", "gone")
    try:
        async with ClientSession() as http:
            timeout = ClientTimeout(total=10)
            assert await cache_feed.read_feed(http, p, "a", address, timeout, 1.0)
            assert p.cached["a"].blocks == set(kv_blocks.chain(ids, BS))
            follower.take([b"", (1).to_bytes(8, "big"), enc.encode(EventBatch(0.0, [BlockRemoved([b"v3"])]))])
            assert await cache_feed.read_feed(http, p, "a", address, timeout, 2.0)
            assert p.cached["a"].blocks == set(kv_blocks.chain(ids, BS)[:2]) and p.cached["a"].seq == 4
            # A guard without the feed (404) or out of reach: the replica is placed by what was learned.
            assert not await cache_feed.read_feed(http, p, "a", f"{address}/not-a-guard", timeout, 3.0)
            assert "a" not in p.cached
    finally:
        await runner.cleanup()


CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def guard_tokenizer() -> HfTokenizer:
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "you",
             "are", "a", "helpful", "bot", "hello", "there", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(r"(<\|im_start\|>|<\|im_end\|>|<s>|\n| )", "isolated")
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = CHATML
    return HfTokenizer(hf)


def test_the_routers_token_ids_are_the_guards(guard_tokenizer):
    files = guard_tokenizer.portable()
    assert files is not None and files.chat_template == CHATML and files.special_tokens["bos_token"] == "<s>"
    router = PromptTokens(msgspec.json.decode(msgspec.json.encode(files), type=kv_blocks.TokenizerFiles))
    messages = [{"role": "system", "content": "you are a helpful bot"}, {"role": "user", "content": "hello there"}]
    want = guard_tokenizer.chat_ids(messages, {"add_generation_prompt": True})
    assert list(router.ids({"messages": messages}, "/v1/chat/completions") or []) == want
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    assert list(router.ids({"messages": parts}, "/v1/chat/completions") or []) == guard_tokenizer.chat_ids(
        [{"role": "user", "content": "hello\nthere"}], {"add_generation_prompt": True})
    assert list(router.ids({"prompt": "hello there"}, "/v1/completions") or []) == guard_tokenizer.encode(
        "hello there")
    # The request may carry the model's own template (the bench and some gateways send it): rendered as vLLM does.
    assert list(router.ids({"messages": messages, "chat_template": files.chat_template}, "/v1/chat/completions")
                or []) == want


def test_a_request_carrying_another_template_is_not_rendered_on_the_router(guard_tokenizer):
    """Any client may send a chat_template; rendering it would run the client's code on the router that every
    tenant shares (a loop of loops holds its event loop). Only the model's own is rendered."""
    files = guard_tokenizer.portable()
    assert files is not None
    router = PromptTokens(files)
    messages = [{"role": "user", "content": "hello"}]
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    assert router.ids({"messages": messages, "chat_template": bomb}, "/v1/chat/completions") is None
    assert time.monotonic() - started < 0.1 and not router.off_because


def test_a_service_whose_template_is_too_slow_is_no_longer_tokenized(guard_tokenizer, monkeypatch):
    """The model's own template and tokenizer run on the router's event loop: one that took longer than
    SLOW_SECONDS for a prompt turns that service's tokenizing off (its prompts go to the learned placement)."""
    from gpufleet_router import prompt_tokens

    files = guard_tokenizer.portable()
    assert files is not None
    slow = "{% for i in range(3000) %}{% for j in range(300) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
    router = PromptTokens(msgspec.structs.replace(files, chat_template=slow))
    monkeypatch.setattr(prompt_tokens, "SLOW_SECONDS", 0.0)
    messages = [{"role": "user", "content": "hello"}]
    assert router.ids({"messages": messages}, "/v1/chat/completions")   # rendered, and found slow
    assert router.off_because
    assert router.ids({"messages": messages}, "/v1/chat/completions") is None


def test_what_the_router_cannot_tokenize_as_vllm_does_is_left_to_the_learned_placement(guard_tokenizer):
    files = guard_tokenizer.portable()
    assert files is not None
    router = PromptTokens(files)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert router.ids({"messages": image}, "/v1/chat/completions") is None
    failing = "{{ raise_exception('no system role') }}"
    assert router.ids({"messages": [], "chat_template": failing}, "/v1/chat/completions") is None
    assert router.ids({"input": "x"}, "/v1/embeddings") is None


async def test_a_guard_that_heard_no_events_yet_feeds_nothing():
    """An empty set would say "nothing cached" for sure; before vLLM's first batch (an idle engine, or events
    sent elsewhere) the guard answers 503 and the router places by what it learned."""
    follower = kv_subscriber.KVEventsFollower(KVEventsConfig(endpoint="ipc:///nowhere"))
    app = web.Application()
    app.router.add_get(kv_blocks.KV_BLOCKS_PATH, kv_subscriber.blocks_route(follower))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    p = picker("a")
    try:
        async with ClientSession() as http:
            address = f"127.0.0.1:{runner.addresses[0][1]}"
            # It follows events (the tokenizer is worth loading), but has no view to give yet.
            assert await cache_feed.read_feed(http, p, "a", address, ClientTimeout(total=10), 1.0)
            assert "a" not in p.cached
    finally:
        await runner.cleanup()


def test_a_tokenized_prompt_carries_its_token_chain_and_is_costed_by_its_tokens():
    from gpufleet_router.policy import adapters
    from gpufleet_router.policy.placement import place
    from gpufleet_router.policy.table import Route, Table

    table = Table({"m": Route("ns", "svc", "m", BS, 1, 1, (Replica("a", "10.0.0.1:8080"),))})
    body = msgspec.json.encode({"model": "m", "max_tokens": 8, "prompt": "x" * 400})
    ids = list(range(40))
    placed = place(body, "/v1/completions", table, adapters.EMPTY, 2, lambda doc, route, target: ids)
    assert placed.prefix is not None and placed.prefix.tokens == kv_blocks.chain(ids, BS)
    assert placed.cost == (40 + 8) // BS      # 12 blocks, not the characters' estimate
    guessed = place(body, "/v1/completions", table, adapters.EMPTY, 2)
    assert guessed.prefix is not None and guessed.prefix.tokens == ()
    assert guessed.cost == (400 // 4 + 8) // BS   # 27 blocks from 4 characters a token
