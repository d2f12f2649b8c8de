"""The informer's pure core: a LIST and watch events applied to the cache, and what follows a failure."""
from __future__ import annotations

import pytest

from gpufleet_kit.backoff import Backoff
from gpufleet_kit.kube.watch_cache import Applied, Step, WatchCache, key_of, recovery


def pod(name: str, rv: str, ready: bool = False, namespace: str = "ml") -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": namespace, "resourceVersion": rv},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def ev(kind: str, obj: dict) -> dict:
    return {"type": kind, "object": obj}


def test_objects_are_keyed_by_namespace_and_name():
    assert key_of(pod("a", "1")) == "ml/a"
    assert key_of({"metadata": {"name": "node-1"}}) == "node-1"   # cluster-scoped


def test_a_list_replaces_the_cache_and_counts_a_change_only_when_something_changed():
    cache = WatchCache()
    assert cache.replace([pod("a", "1"), pod("b", "2")], "5") is True
    assert cache.resource_version == "5" and sorted(cache.objects) == ["ml/a", "ml/b"] and cache.version == 1
    assert cache.replace([pod("a", "1"), pod("b", "2")], "9") is False    # a re-list that finds nothing new
    assert cache.resource_version == "9" and cache.version == 1
    assert cache.replace([pod("a", "3")], "10") is True                    # one changed, one gone
    assert list(cache.objects) == ["ml/a"] and cache.objects["ml/a"]["metadata"]["resourceVersion"] == "3"
    assert cache.version == 2
    assert cache.clear() is True and cache.objects == {} and cache.resource_version == ""


def test_added_modified_and_deleted_change_the_cache_and_move_its_version():
    cache = WatchCache()
    cache.replace([], "1")
    applied = cache.apply(ev("ADDED", pod("a", "2")))
    assert applied.step is Step.CONTINUE and applied.changed and cache.resource_version == "2"
    applied = cache.apply(ev("MODIFIED", pod("a", "3", ready=True)))
    assert applied.changed and cache.objects["ml/a"]["status"]["conditions"][0]["status"] == "True"
    assert not cache.apply(ev("MODIFIED", pod("a", "3", ready=True))).changed   # the same version again
    applied = cache.apply(ev("DELETED", pod("a", "4", ready=True)))
    assert applied.changed and cache.objects == {} and cache.resource_version == "4"
    assert not cache.apply(ev("DELETED", pod("a", "5"))).changed   # already gone
    assert cache.version == 3


def test_a_bookmark_moves_the_resume_point_without_a_change():
    cache = WatchCache()
    cache.replace([pod("a", "1")], "1")
    applied = cache.apply(ev("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "42"}}))
    assert applied == Applied(Step.CONTINUE, False)
    assert cache.resource_version == "42" and list(cache.objects) == ["ml/a"] and cache.version == 1


def test_an_error_event_410_says_list_again_and_another_says_reconnect():
    cache = WatchCache()
    cache.replace([pod("a", "1")], "7")
    gone = cache.apply(ev("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"}))
    assert gone.step is Step.RELIST and gone.status == 410 and not gone.changed
    other = cache.apply(ev("ERROR", {"kind": "Status", "code": 500, "reason": "InternalError"}))
    assert other.step is Step.RECONNECT and other.status == 500
    assert cache.resource_version == "7" and list(cache.objects) == ["ml/a"]   # an error changes nothing


@pytest.mark.parametrize("status, listing, relist, clear, pause", [
    (410, False, True, False, False),    # too old: LIST again at once
    (410, True, True, False, False),
    (None, False, False, False, True),   # connection lost: WATCH again from the last version, after a pause
    (500, False, False, False, True),
    (None, True, True, False, True),     # a LIST that failed is tried again
    (404, True, True, True, True),       # kind not served: none, and LIST again later
    (403, False, True, False, True),     # watch refused: LIST again at the backoff's pace
    (401, True, True, False, True),
])
def test_what_follows_a_failure(status, listing, relist, clear, pause):
    what = recovery(status, listing=listing)
    assert (what.relist, what.clear, what.pause) == (relist, clear, pause)


def test_the_backoff_doubles_to_its_cap_within_jitter_and_resets():
    backoff = Backoff(first=0.5, cap=4.0, jitter=0.2, rand=lambda: 0.5)   # the middle of the ±20%
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    backoff.reset()
    assert backoff.next() == 0.5
    low, high = Backoff(first=1.0, jitter=0.2, rand=lambda: 0.0), Backoff(first=1.0, jitter=0.2, rand=lambda: 1.0)
    assert low.next() == pytest.approx(0.8) and high.next() == pytest.approx(1.2)
