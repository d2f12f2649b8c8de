"""The canary split by revision: the table reads status.rollout and each pod's gpufleet.dev/revision, the
picker sends exactly the canary's share of new requests to its revision (spread evenly), the rest to the
others, everything to one side when the other has no eligible replica, and a retry stays in its revision."""
from __future__ import annotations

import pytest

from gpufleet.manifests import names
from gpufleet_router.policy.choice import Picker, Policy, Split
from gpufleet_router.policy.replicas import Replica
from gpufleet_router.policy.table import build_table
from tests.unit.router.test_requests_and_table import isvc, serving


def revision_pod(name: str, revision: str | None, ip: str) -> dict:
    labels = {names.LABEL_SERVICE: "chat"}
    if revision is not None:
        labels[names.LABEL_REVISION] = revision
    return {"metadata": {"name": name, "namespace": "ml", "labels": labels}, "status": {"podIP": ip, "ready": True}}


def test_the_names_of_the_contract():
    assert names.LABEL_REVISION == "gpufleet.dev/revision" and names.LABEL_TRACK == "gpufleet.dev/track"


@pytest.mark.parametrize("percent", [0, 1, 10, 33, 50, 90, 100])
def test_of_every_hundred_requests_exactly_the_percent_go_to_the_canary(percent):
    split = Split()
    picks = [split.canary_next(percent) for _ in range(300)]
    assert sum(picks[:100]) == percent and sum(picks) == 3 * percent


def test_the_canary_share_is_interleaved_not_in_a_run():
    split = Split()
    picks = [split.canary_next(50) for _ in range(10)]
    assert all(picks[i] != picks[i + 1] for i in range(9))


def test_the_table_reads_the_canary_from_status_and_each_pods_revision():
    service = isvc("chat")
    service["status"] = {"rollout": {"stableRevision": "aaaaaaaaaa", "canaryRevision": "bbbbbbbbbb",
                                     "canaryWeightPercent": 10, "phase": "Progressing"}}
    route = build_table([service], [revision_pod("chat-1", "aaaaaaaaaa", "10.0.0.1"),
                                    revision_pod("chat-2", "bbbbbbbbbb", "10.0.0.2"),
                                    revision_pod("chat-3", None, "10.0.0.3")], serving).routes["org/chat"]
    assert (route.canary_revision, route.canary_weight) == ("bbbbbbbbbb", 10)
    assert [r.revision for r in route.replicas] == ["aaaaaaaaaa", "bbbbbbbbbb", ""]


@pytest.mark.parametrize("rollout,expected", [
    ({}, ("", 0)),
    ({"canaryWeightPercent": 30}, ("", 0)),                          # no canary revision: no split
    ({"canaryRevision": "b", "canaryWeightPercent": 250}, ("b", 100)),
    ({"canaryRevision": "b", "canaryWeightPercent": "x"}, ("b", 0)),
])
def test_an_odd_rollout_status_is_clamped_not_trusted(rollout, expected):
    service = isvc("chat")
    service["status"] = {"rollout": rollout}
    route = build_table([service], [], serving).routes["org/chat"]
    assert (route.canary_revision, route.canary_weight) == expected


def picker(*replicas: tuple[str, str], canary: str = "", percent: int = 0) -> Picker:
    p = Picker(policy=Policy.ROUND_ROBIN)
    p.set_replicas([Replica(pod, f"10.0.0.{i}:8080", revision=rev) for i, (pod, rev) in enumerate(replicas)])
    p.canary_revision, p.canary_percent = canary, percent
    return p


def test_new_requests_split_by_the_canary_weight_then_the_policy_within_the_revision():
    p = picker(("s1", "old"), ("s2", "old"), ("c1", "new"), canary="new", percent=20)
    pods = [pick.replica.pod for pick in (p.pick(1, None) for _ in range(100)) if pick]
    assert pods.count("c1") == 20 and pods.count("s1") == 40 and pods.count("s2") == 40


def test_without_an_eligible_canary_replica_everything_goes_to_the_others_and_back():
    p = picker(("s1", "old"), canary="new", percent=50)
    assert {p.pick(1, None).replica.pod for _ in range(10)} == {"s1"}      # type: ignore[union-attr]
    p = picker(("c1", "new"), canary="new", percent=10)
    assert {p.pick(1, None).replica.pod for _ in range(10)} == {"c1"}      # type: ignore[union-attr]


def test_a_retry_stays_in_its_revision_when_it_can_and_a_strict_one_only_there():
    p = picker(("s1", "old"), ("s2", "old"), ("c1", "new"), canary="new", percent=50)
    again = p.pick(1, None, exclude=["s1"], revision="old")
    assert again is not None and again.replica.pod == "s2"
    assert p.pick(1, None, exclude=["s1", "s2"], revision="old").replica.pod == "c1"   # type: ignore[union-attr]
    assert p.pick(1, None, exclude=["s1", "s2"], revision="old", strict=True) is None


def test_pods_without_a_revision_are_one_group_and_no_canary_means_no_split():
    p = picker(("a", ""), ("b", ""))
    assert {p.pick(1, None).replica.pod for _ in range(4)} == {"a", "b"}   # type: ignore[union-attr]


def test_the_fleet_gives_each_pool_its_services_split():
    from gpufleet_router.metrics import RouterMetrics
    from gpufleet_router.policy.table import Route, Table
    from gpufleet_router.server import Fleet, RouterSettings

    fleet = Fleet(RouterSettings(), RouterMetrics())
    replicas = (Replica("a", "x:1", revision="old"), Replica("b", "x:2", revision="new"))
    route = Route("ml", "chat", "m", 16, 1, 2, replicas, canary_revision="new", canary_weight=25)
    fleet.update(Table({"m": route}))
    p = fleet.picker("m")
    assert p is not None and (p.canary_revision, p.canary_percent) == ("new", 25)
