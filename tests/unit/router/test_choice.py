"""The replica choice (choice.py): free KV net of the router's own sends,
learned prefix placement (the longest run of a prompt's blocks the router
sent to a replica), new prefixes spread on a consistent-hash ring within a
footprint bound, a bounded load, unready and draining replicas skipped."""
from __future__ import annotations

import collections

import pytest

from gpufleet_router.policy.choice import Picker, Reason
from gpufleet_router.policy.prefixes import (
    DEFAULT_POOL_BLOCKS,
    LEARNED_PER_POOL_BLOCK,
    MATCH_BLOCKS,
    Learned,
    Prefix,
    Ring,
    prefix_of,
)
from gpufleet_router.policy.replicas import Reading, Replica


def prefix_key(text: str, block_chars: int, blocks: int) -> str | None:
    """The ring key alone: the hash of the prompt's first ``blocks`` whole blocks."""
    prefix = prefix_of(text, block_chars, blocks, match_blocks=0)
    return prefix.key if prefix else None


def picker(*pods: str, load_factor: float = 0.25, serving: dict[str, bool] | None = None) -> Picker:
    p = Picker(load_factor)
    p.set_replicas([Replica(pod, f"10.0.0.{i}:8080", (serving or {}).get(pod, True))
                    for i, pod in enumerate(pods)])
    return p


def read(p: Picker, pod: str, free: int, *, total: int = 100, ready: bool = True, at: float = 0.0) -> None:
    p.observe(pod, Reading(taken_at=at, ready=ready, free_blocks=free, total_blocks=total))


def key(k: str) -> Prefix:
    """A prefix known by its ring key only (no blocks to learn)."""
    return Prefix(k, ())


def text(i: int, words: int = 60) -> str:
    return f"system prompt {i:04d} " + "lorem ipsum " * words


def test_the_replica_with_the_most_free_blocks_takes_a_request_without_a_prefix():
    p = picker("a", "b", "c")
    read(p, "a", 10)
    read(p, "b", 60)
    read(p, "c", 30)
    pick = p.pick(5, None)
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == ("b", Reason.KV, False)


def test_blocks_sent_since_the_reading_count_against_the_replica():
    p = picker("a", "b")
    read(p, "a", 50, at=1.0)
    read(p, "b", 40, at=1.0)
    p.sent("a", 20, now=2.0)      # after the reading: not in it yet
    assert p.room("a") == 30
    assert p.pick(5, None).replica.pod == "b"


def test_a_new_reading_replaces_the_sends_it_already_includes():
    p = picker("a", "b")
    read(p, "a", 50, at=1.0)
    p.sent("a", 20, now=2.0)
    p.sent("a", 7, now=4.0)
    read(p, "a", 30, at=3.0)      # taken after the first send, before the second
    assert p.room("a") == 23


def test_unready_and_draining_replicas_are_never_picked():
    p = picker("a", "b", "c", serving={"c": False})   # c's pod is terminating
    read(p, "a", 90, ready=False)                      # a's guard is draining
    read(p, "b", 5)
    read(p, "c", 90)
    for prefix in (None, key("k1"), key("k2"), prefix_of(text(1), 64, 4)):
        assert p.pick(1, prefix).replica.pod == "b"
    read(p, "b", 5, ready=False)
    assert p.pick(1, None) is None


def test_excluded_replicas_are_skipped_for_a_retry():
    p = picker("a", "b")
    read(p, "a", 90)
    read(p, "b", 10)
    assert p.pick(1, None, exclude=["a"]).replica.pod == "b"
    assert p.pick(1, None, exclude=["a", "b"]) is None


def test_before_any_reading_the_least_busy_replica_takes_it():
    p = picker("a", "b")
    p.sent("a", 3, now=0.0)
    pick = p.pick(1, None)
    assert (pick.replica.pod, pick.reason) == ("b", Reason.LEAST_BUSY)
    p.finished("a")
    assert p.in_flight == {}


def test_requests_sharing_a_prefix_go_to_its_replica_on_the_ring_while_it_has_room():
    p = picker("a", "b", "c", "d")
    for pod in "abcd":
        read(p, pod, 80 if pod != "c" else 90)
    prefix = prefix_of("You are a helpful assistant. " * 20, 64, 4)
    first = p.pick(2, prefix)
    # Nothing learned yet: the ring's replica (every footprint is equal).
    assert (first.replica.pod, first.reason, first.affinity_hit) == (Ring("abcd").walk(prefix.key)[0],
                                                                     Reason.NEW_PREFIX, False)
    p.finished(first.replica.pod, p.sent(first.replica.pod, 2, 0.0, prefix))
    picks = [p.pick(2, prefix) for _ in range(10)]
    assert {x.replica.pod for x in picks} == {first.replica.pod}
    assert all(x.reason == Reason.AFFINITY and x.affinity_hit for x in picks)


def test_different_prefixes_spread_over_the_replicas():
    p = picker("a", "b", "c", "d")
    for pod in "abcd":
        read(p, pod, 80)
    keys = [key(prefix_key(f"system prompt {i:04d} " * 30, 64, 4)) for i in range(400)]
    counts = collections.Counter(p.pick(2, k).replica.pod for k in keys)
    assert set(counts) == set("abcd")
    assert min(counts.values()) > 400 / 4 * 0.5, counts


def test_a_popular_prefix_spills_to_the_next_replica_on_the_ring_past_the_load_bound():
    p = picker("a", "b", "c")
    key = prefix_of(text(7), 64, 4)
    home = Ring("abc").walk(key.key)
    for pod in "abc":
        read(p, pod, 100)
    placed, reasons = [], []
    for _ in range(9):
        pick = p.pick(1, key)
        placed.append(pick.replica.pod)
        reasons.append(pick.reason)
        p.sent(pick.replica.pod, 0, now=0.0, prefix=key)   # in flight, holding no measurable blocks yet
    # ceil(1.25 x mean) + 1 in flight at most on one replica: the home one first, then the next on the
    # ring (a new placement there: the fewest prefixes learned, in ring order), which then holds it too.
    assert placed[:4] == [home[0]] * 3 + [home[1]], placed
    assert reasons[:5] == [Reason.NEW_PREFIX, Reason.AFFINITY, Reason.AFFINITY, Reason.NEW_PREFIX,
                           Reason.AFFINITY], reasons
    assert max(collections.Counter(placed).values()) <= 5, placed
    # Its requests done, the prefix goes to the first replica in ring order holding it: home.
    for pod in placed:
        p.finished(pod)
    assert p.pick(1, key).replica.pod == home[0]


def test_an_affinity_replica_without_room_leaves_the_choice_to_the_ring_then_free_kv():
    p = picker("a", "b", "c")
    key = prefix_of(text(3), 64, 4)       # 11 blocks
    home, second, third = Ring("abc").walk(key.key)
    read(p, home, 3)
    read(p, second, 50)
    read(p, third, 60)
    p.sent(home, 0, 0.0, key)             # home learned it earlier, but has no room now
    pick = p.pick(20, key)                # 20 blocks, 11 of them held by home: it needs 9, has 3
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == (second, Reason.NEW_PREFIX, False)
    read(p, second, 5)
    pick = p.pick(20, key)
    assert (pick.replica.pod, pick.reason) == (third, Reason.NEW_PREFIX)
    read(p, third, 8)
    read(p, home, 9)
    pick = p.pick(20, key)
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == (home, Reason.AFFINITY, True)
    read(p, home, 7)                      # now nobody has room: the most of it
    pick = p.pick(20, key)
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == (third, Reason.KV, False)


def test_a_replica_holding_the_prompt_needs_room_for_the_rest_only():
    p = picker("a", "b")
    prompt = prefix_of(text(8), 64, 4)   # 11 blocks
    read(p, "a", 40)
    read(p, "b", 40)
    first = p.pick(14, prompt)
    p.finished(first.replica.pod, p.sent(first.replica.pod, 14, 0.0, prompt))
    read(p, first.replica.pod, 5)        # room for the 3 blocks it does not hold, not for all 14
    pick = p.pick(14, prompt)
    assert (pick.replica.pod, pick.reason) == (first.replica.pod, Reason.AFFINITY)
    read(p, first.replica.pod, 2)
    assert p.pick(14, prompt).replica.pod != first.replica.pod


def test_every_replica_lacking_room_falls_back_to_the_most_room():
    p = picker("a", "b")
    read(p, "a", 2)
    read(p, "b", 4)
    pick = p.pick(10, key("k"))
    assert (pick.replica.pod, pick.reason) == ("b", Reason.KV)


def test_a_replica_that_leaves_moves_only_its_own_keys():
    keys = [f"k{i}" for i in range(300)]
    before = Ring(["a", "b", "c", "d"])
    after = Ring(["a", "b", "c"])
    moved = [k for k in keys if before.walk(k)[0] != after.walk(k)[0]]
    assert all(before.walk(k)[0] == "d" for k in moved)
    assert 0 < len(moved) < len(keys) / 2


def test_a_replica_gone_from_the_service_forgets_its_reading_and_sends():
    p = picker("a", "b")
    read(p, "a", 10)
    p.sent("a", 1, now=1.0)
    p.set_replicas([Replica("b", "10.0.0.2:8080")])
    assert p.room("a") is None and "a" not in p.readings
    p.observe("a", Reading(0.0, True, 10, 100))   # a late reading of a removed pod is dropped
    assert "a" not in p.readings


def test_a_failed_reading_makes_the_room_unknown_not_zero():
    p = picker("a", "b")
    read(p, "a", 80)
    read(p, "b", 10)
    p.observe("a", None)
    assert p.room("a") is None
    assert p.pick(1, None).replica.pod == "b"   # the read replica with room, not the unknown one


@pytest.mark.parametrize("text, blocks, expected_none", [
    ("x" * 63, 4, True),       # shorter than a block: nothing cacheable
    ("x" * 64, 4, False),
    ("x" * 1000, 0, True),     # affinity off
])
def test_prefix_keys_need_one_whole_block(text, blocks, expected_none):
    assert (prefix_key(text, 64, blocks) is None) == expected_none


def test_prefix_keys_depend_only_on_the_leading_whole_blocks():
    system = "S" * 256
    assert prefix_key(system + "question one", 64, 4) == prefix_key(system + "another question", 64, 4)
    assert prefix_key(system + "q", 64, 4) != prefix_key("T" + system[1:] + "q", 64, 4)
    # A short prompt's key covers its whole blocks only: a longer one sharing them gets a different key.
    assert prefix_key("A" * 130, 64, 4) == prefix_key("A" * 128 + "zz", 64, 4)


def test_a_negative_load_factor_is_refused():
    with pytest.raises(ValueError, match="load_factor"):
        Picker(-0.1)


def test_a_request_that_finished_before_the_next_reading_no_longer_counts_against_its_replica():
    p = picker("a")
    read(p, "a", 50, at=1.0)
    first = p.sent("a", 20, now=2.0)
    p.sent("a", 10, now=2.5)
    p.finished("a", first)
    assert p.room("a") == 40
    p.finished("a", first)        # twice is once
    assert p.room("a") == 40


def test_a_prompt_goes_where_the_router_sent_its_prefix_before_not_where_the_ring_points():
    p = picker("a", "b", "c")
    for pod in "abc":
        read(p, pod, 100)
    prompt = prefix_of(text(11) + "user question one", 64, 4)
    elsewhere = Ring("abc").walk(prompt.key)[-1]
    p.sent(elsewhere, 2, 0.0, prompt)     # e.g. spilled there earlier
    same_system = prefix_of(text(11) + "a different question, longer than the first", 64, 4)
    pick = p.pick(2, same_system)
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == (elsewhere, Reason.AFFINITY, True)


def test_the_longest_held_run_wins_and_equal_runs_go_in_ring_order():
    p = picker("a", "b", "c")
    for pod in "abc":
        read(p, pod, 100)
    system = text(5, words=40)
    longer = prefix_of(system + "shared few-shot examples " * 10 + "q1", 64, 4)
    shorter = prefix_of(system + "q2" * 40, 64, 4)
    p.sent("a", 1, 0.0, shorter)
    p.sent("b", 1, 0.0, longer)
    request = prefix_of(system + "shared few-shot examples " * 10 + "q3", 64, 4)
    assert p.match("b", request) > p.match("a", request) > 0
    assert p.pick(1, request).replica.pod == "b"
    p.sent("c", 1, 0.0, longer)           # now b and c hold the same run: the ring from the key decides
    first = next(pod for pod in Ring("abc").walk(request.key) if pod in "bc")
    assert p.pick(1, request).replica.pod == first


def test_a_match_under_half_of_the_prompt_is_a_new_placement():
    p = picker("a", "b")
    for pod in "ab":
        read(p, pod, 100)
    boilerplate = "You are an assistant of the ACME company. " * 4      # 2 blocks of 64 characters and more
    p.sent("a", 1, 0.0, prefix_of(boilerplate + "Policy one. " * 40, 64, 4))
    p.sent("a", 1, 0.0, prefix_of(boilerplate + "Policy three. " * 40, 64, 4))
    other = prefix_of(boilerplate + "Policy two. " * 40, 64, 4)
    assert 0 < p.match("a", other) < len(other.chain) / 2
    pick = p.pick(1, other)
    # a holds two learned prefixes, b none (more than the slack of one): the new one goes to b.
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == ("b", Reason.NEW_PREFIX, False)


def test_new_prefixes_spread_evenly_where_the_bare_ring_would_not():
    pods = "ab"
    p = picker(*pods)
    for pod in pods:
        read(p, pod, 1000)
    # Ten prompts the bare ring splits 8:2.
    candidates = [prefix_of(text(i), 64, 4) for i in range(100)]
    on_a = [x for x in candidates if Ring(pods).walk(x.key)[0] == "a"][:8]
    on_b = [x for x in candidates if Ring(pods).walk(x.key)[0] == "b"][:2]
    prompts = on_a[:4] + on_b + on_a[4:]
    for x in prompts:
        pick = p.pick(1, x)
        p.finished(pick.replica.pod, p.sent(pick.replica.pod, 1, 0.0, x))
    # At most FOOTPRINT_SLACK (1) over the fewest: 6:4 at worst.
    assert sorted(p.learned[pod].prefixes for pod in pods) in ([5, 5], [4, 6])
    # Each goes back where it was placed.
    for x in prompts:
        assert p.pick(1, x).reason == Reason.AFFINITY


def test_the_learned_blocks_are_bounded_by_the_replicas_pool_tails_and_least_recent_first():
    p = picker("a", "b")
    read(p, "a", 10, total=8)             # twice the pool's blocks are remembered: 16
    old, new = prefix_of(text(1), 64, 4), prefix_of(text(2), 64, 4)
    assert len(old.chain) == len(new.chain) == 11
    p.sent("a", 1, 0.0, old)
    p.sent("a", 1, 0.0, new)
    learned = p.learned["a"]
    assert len(learned) == 16 and learned.prefixes == 2
    assert p.match("a", new) == 11 and p.match("a", old) == 5     # the older prompt lost its tail
    read(p, "a", 10, total=4)             # a smaller pool read later shrinks what is remembered
    assert len(learned) == 8 and learned.prefixes == 1
    assert p.match("a", old) == 0 and p.match("a", new) == 8


def test_a_replica_that_leaves_or_turns_unready_forgets_what_was_learned():
    p = picker("a", "b")
    read(p, "a", 50)
    read(p, "b", 50)
    prompt = prefix_of(text(4), 64, 4)
    p.sent("a", 1, 0.0, prompt)
    p.sent("b", 1, 0.0, prompt)
    read(p, "a", 50, ready=False)         # draining, or its engine restarts with an empty cache
    assert "a" not in p.learned and p.match("b", prompt) == len(prompt.chain)
    p.set_replicas([Replica("a", "10.0.0.0:8080")])
    assert "b" not in p.learned
    p.sent("b", 1, 0.0, prompt)           # a late send to a removed pod is not learned
    assert "b" not in p.learned


def test_before_a_reading_the_learned_blocks_have_a_default_bound():
    assert Learned().capacity == DEFAULT_POOL_BLOCKS
    p = picker("a")
    p.sent("a", 1, 0.0, prefix_of(text(1), 64, 4))
    assert p.learned["a"].capacity == LEARNED_PER_POOL_BLOCK * DEFAULT_POOL_BLOCKS


def test_prefix_chains_hash_cumulatively_and_the_key_is_the_first_blocks():
    a = prefix_of("S" * 256 + "question one, long enough for its own block" * 3, 64, 2)
    b = prefix_of("S" * 256 + "another question", 64, 2)
    assert a.chain[:4] == b.chain[:4] and a.chain[4] != b.chain[4] if len(b.chain) > 4 else a.chain[:4] == b.chain
    assert a.key == b.key == prefix_key("S" * 256, 64, 2) == a.chain[1].hex()
    assert len(prefix_of("x" * 64 * 200, 64, 4).chain) == MATCH_BLOCKS
    assert prefix_of("T" + "S" * 255, 64, 2).chain[3] != a.chain[3]   # a block names everything before it


def test_every_pick_reason_is_documented_in_the_metric_catalog():
    from pathlib import Path

    from gpufleet_router.policy.choice import REASONS

    catalog = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
    line = next(x for x in catalog.read_text().splitlines() if x.startswith("| gpufleet_router_picks_total "))
    assert all(reason in line for reason in REASONS), (REASONS, line)


def test_a_replica_back_to_ready_is_not_held_to_the_reading_taken_while_it_was_down():
    p = Picker()
    p.set_replicas([Replica("a", "a:1")])
    p.observe("a", Reading(taken_at=0.0, ready=False, free_blocks=0, total_blocks=100))   # its engine died
    assert p.eligible() == []
    p.set_replicas([Replica("a", "a:1", serving=False)])        # the pod not Ready: no longer read
    assert p.recovering("")
    p.set_replicas([Replica("a", "a:1")])                       # Ready again before the next reading
    assert [r.pod for r in p.eligible()] == ["a"] and not p.recovering("")


def test_recovering_counts_replicas_of_the_revision_that_may_serve_again():
    p = Picker()
    p.set_replicas([Replica("a", "a:1", revision="r1"), Replica("b", "b:1", serving=False, revision="r1"),
                    Replica("c", "c:1", serving=False, revision="r2"),
                    Replica("d", "d:1", serving=False, revision="r1", terminating=True)])
    assert p.recovering("r1") and not p.recovering("r1", exclude=["b"]) and p.recovering("r2")
    assert not p.recovering("r3")
