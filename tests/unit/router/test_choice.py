"""The replica choice (choice.py): free KV net of the router's own sends,
prefix affinity on a bounded-load consistent-hash ring, unready and
draining replicas skipped."""
from __future__ import annotations

import collections

import pytest

from gpufleet.router.choice import Picker, Reading, Reason, Replica, Ring, prefix_key


def picker(*pods: str, load_factor: float = 0.25, serving: dict[str, bool] | None = None) -> Picker:
    p = Picker(load_factor)
    p.set_replicas([Replica(pod, f"10.0.0.{i}:8080", (serving or {}).get(pod, True))
                    for i, pod in enumerate(pods)])
    return p


def read(p: Picker, pod: str, free: int, *, total: int = 100, ready: bool = True, at: float = 0.0) -> None:
    p.observe(pod, Reading(taken_at=at, ready=ready, free_blocks=free, total_blocks=total))


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
    for key in (None, "k1", "k2", "k3"):
        assert p.pick(1, key).replica.pod == "b"
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
    key = prefix_key("You are a helpful assistant. " * 20, 64, 4)
    picks = [p.pick(2, key) for _ in range(10)]
    assert {x.replica.pod for x in picks} == {Ring("abcd").walk(key)[0]}
    assert all(x.reason == Reason.AFFINITY and x.affinity_hit for x in picks)


def test_different_prefixes_spread_over_the_replicas():
    p = picker("a", "b", "c", "d")
    for pod in "abcd":
        read(p, pod, 80)
    keys = [prefix_key(f"system prompt {i:04d} " * 30, 64, 4) for i in range(400)]
    counts = collections.Counter(p.pick(2, key).replica.pod for key in keys)
    assert set(counts) == set("abcd")
    assert min(counts.values()) > 400 / 4 * 0.5, counts


def test_a_popular_prefix_spills_to_the_next_replica_on_the_ring_past_the_load_bound():
    p = picker("a", "b", "c")
    key = "shared"
    home = Ring("abc").walk(key)
    for pod in "abc":
        read(p, pod, 100)
    placed = []
    for _ in range(9):
        pick = p.pick(1, key)
        assert pick.reason == Reason.AFFINITY
        placed.append(pick.replica.pod)
        p.sent(pick.replica.pod, 0, now=0.0)   # in flight, holding no measurable blocks yet
    # ceil(1.25 x mean) + 1 in flight at most on one replica: the home one first, then the next on the ring.
    assert placed[:4] == [home[0]] * 3 + [home[1]], placed
    assert max(collections.Counter(placed).values()) <= 5, placed
    # Its requests done, the prefix goes home again.
    for pod in placed:
        p.finished(pod)
    assert p.pick(1, key).replica.pod == home[0]


def test_an_affinity_replica_without_room_leaves_the_choice_to_the_ring_then_free_kv():
    p = picker("a", "b", "c")
    key = "k"
    home, second, third = Ring("abc").walk(key)
    read(p, home, 3)
    read(p, second, 50)
    read(p, third, 60)
    assert p.pick(10, key).replica.pod == second
    read(p, second, 5)
    pick = p.pick(10, key)
    assert (pick.replica.pod, pick.reason) == (third, Reason.AFFINITY)
    read(p, third, 8)
    read(p, home, 9)
    pick = p.pick(10, key)
    assert (pick.replica.pod, pick.reason, pick.affinity_hit) == (home, Reason.KV, True)


def test_every_replica_lacking_room_falls_back_to_the_most_room():
    p = picker("a", "b")
    read(p, "a", 2)
    read(p, "b", 4)
    pick = p.pick(10, "k")
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
