"""Canary revisions, the pure parts: the revision hash, the canary's manifests, the SLO analysis of
SLI counter deltas, and the step state machine (docs/rollouts.md)."""
import json
from datetime import datetime, timedelta, timezone

import pytest

from gpufleet.autoscale.signals import parse_replica
from gpufleet.manifests import children, guard_config, names, revision
from gpufleet.reconcile.desired import CanaryChildren, desired_children, spec_revision
from gpufleet.reconcile.validation import validate
from gpufleet.rollout import analysis, steps
from gpufleet_api import parse_spec

ISVC = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat"}}
T0 = datetime(2026, 12, 4, 12, 0, 0, tzinfo=timezone.utc)


def spec(**over):
    base = {"model": {"name": "org/m"}, "rollout": {"strategy": "Canary"}}
    base.update(over)
    return parse_spec(base)


def stable(s, replicas=2):
    _, hashes = children.build_configmap(ISVC, s)
    return children.build_deployment(ISVC, s, replicas, hashes["unified"])


# --- revision ------------------------------------------------------------------------------


def test_every_engine_pod_carries_a_stable_ten_hex_revision():
    dep = stable(spec())
    rev = dep["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION]
    assert len(rev) == 10 and int(rev, 16) >= 0
    assert rev == revision.of_template(dep["spec"]["template"]) == spec_revision(ISVC, spec())
    assert revision.of_deployment(stable(spec(), replicas=5)) == rev  # replicas are not the revision


@pytest.mark.parametrize("change", [
    {"model": {"name": "org/other"}},
    {"engine": {"image": "registry.example/engine:2"}},
    {"engine": {"extraArgs": ["--enforce-eager"]}},
])
def test_what_a_replica_serves_makes_a_new_revision(change):
    assert spec_revision(ISVC, spec(**change)) != spec_revision(ISVC, spec())


def test_an_admission_only_change_is_no_new_revision():
    assert spec_revision(ISVC, spec(admission={"kvWatermarkPercent": 10, "maxConcurrency": 7})) == \
        spec_revision(ISVC, spec())


def test_the_canary_deployment_reads_its_own_key_under_its_own_selector_with_the_stable_revision():
    s = spec(engine={"image": "registry.example/engine:2"})
    objs = desired_children(ISVC, s, {"unified": 4}, with_podmonitor=False,
                            canary=CanaryChildren(canary_replicas=1, canary_key=True))
    deps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    canary = deps["chat-canary"]
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["selector"]["matchLabels"] == {**names.selector_labels("chat"), names.LABEL_TRACK: "canary"}
    labels = canary["spec"]["template"]["metadata"]["labels"]
    assert labels[names.LABEL_TRACK] == "canary"
    assert labels[names.LABEL_REVISION] == spec_revision(ISVC, s) == \
        deps["chat-engine"]["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION]
    for c in canary["spec"]["template"]["spec"]["containers"]:
        assert c["command"][-1] == "/etc/gpufleet/guard-canary.json"
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    assert set(cm["data"]) == {"guard.json", "guard-canary.json"}


def test_the_stable_keeps_its_template_and_restart_fields_while_live_fields_still_reach_it():
    old, new = spec(), spec(engine={"image": "registry.example/engine:2", "extraArgs": ["--enforce-eager"]},
                            admission={"kvWatermarkPercent": 12})
    live = stable(old)
    running = guard_config.build_guard_config("chat", "ml", old)
    objs = desired_children(ISVC, new, {"unified": 3}, with_podmonitor=False, canary=CanaryChildren(
        stable_template=live["spec"]["template"], stable_running=running, canary_replicas=1, canary_key=True))
    dep = next(o for o in objs if o["metadata"]["name"] == "chat-engine")
    assert dep["spec"]["template"] == live["spec"]["template"] and dep["spec"]["replicas"] == 3
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    stable_doc, canary_doc = json.loads(cm["data"]["guard.json"]), json.loads(cm["data"]["guard-canary.json"])
    assert stable_doc["engine"]["extraArgs"] == [] and canary_doc["engine"]["extraArgs"] == ["--enforce-eager"]
    assert stable_doc["kvWatermarkPercent"] == canary_doc["kvWatermarkPercent"] == 12


def test_promotion_rolls_the_stable_without_a_surge_pod():
    objs = desired_children(ISVC, spec(), {"unified": 2}, with_podmonitor=False,
                            canary=CanaryChildren(canary_replicas=2, canary_key=True, promoting=True))
    dep = next(o for o in objs if o["metadata"]["name"] == "chat-engine")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


# --- analysis -----------------------------------------------------------------------------------

GUARD = """# TYPE gpufleet_guard_sli_events counter
gpufleet_guard_sli_events_total{{sli="availability",class="interactive"}} {a}
gpufleet_guard_sli_events_total{{sli="availability",class="batch"}} 0
gpufleet_guard_sli_events_total{{sli="ttft",class="interactive"}} {t}
gpufleet_guard_sli_events_total{{sli="ttft",class="background"}} 50
# TYPE gpufleet_guard_sli_good_events counter
gpufleet_guard_sli_good_events_total{{sli="availability",class="interactive"}} {ag}
gpufleet_guard_sli_good_events_total{{sli="ttft",class="interactive"}} {tg}
gpufleet_guard_sli_good_events_total{{sli="ttft",class="background"}} 0
gpufleet_guard_sli_good_events_total{{sli="availability",class="background"}} 0
"""


def test_the_guard_sli_counters_are_read_per_sli_as_the_burn_rate_alerts_count_them():
    # availability over every class; the latency SLIs without the background class
    s = parse_replica("p", "", GUARD.format(a=30, t=20, ag=29, tg=20))
    assert s.sli == (("availability", 30.0, 29.0), ("ttft", 20.0, 20.0))


def test_the_window_sums_each_replicas_increase_counting_restarts_and_new_replicas_from_zero():
    baseline = {"a": {"availability": (100.0, 99.0)}, "b": {"availability": (50.0, 50.0)}}
    now = {"a": {"availability": (130.0, 127.0)},   # +30, 28 good
           "b": {"availability": (5.0, 4.0)},       # restarted: 5, 4 good
           "c": {"availability": (10.0, 10.0)}}     # started in the step
    assert analysis.window(now, baseline) == {"availability": (45.0, 42.0)}


def test_burn_rate_is_the_error_ratio_over_the_budget_and_breaches_when_its_low_end_is_above_max_burn_rate():
    # budget 1 - 99.0/100 = 0.01; 30 bad of 1000 = 0.03 -> burn 3; the 95% interval's low end 2.1% -> 2.1
    results = analysis.judge({"availability": (1000.0, 970.0)}, availability_percent="99.0", min_requests=20,
                             max_burn_rate="1.5")
    avail = results[[r.sli for r in results].index("availability")]
    assert avail.error_ratio == pytest.approx(0.03) and avail.burn_rate == pytest.approx(3.0) and avail.breach
    assert avail.burn_rate_low == pytest.approx(2.11, abs=0.01)
    assert analysis.first_breach(results) is avail
    assert "30 of 1000 events bad" in avail.describe() and "maxBurnRate 1.5" in avail.describe()
    # Burning at 3x, but not surely above 2.5x: no breach.
    inside = analysis.judge({"availability": (1000.0, 970.0)}, availability_percent="99.0", min_requests=20,
                            max_burn_rate="2.5")
    assert analysis.first_breach(inside) is None


def test_one_late_gap_among_a_few_is_no_evidence_and_every_event_bad_is():
    # What rolled back a healthy canary on the real node: 1 late ITL gap of 35 (burn 28.6x a 0.1% budget).
    one_late = analysis.judge({"itl": (35.0, 34.0)}, availability_percent="99.9", min_requests=5,
                              max_burn_rate="14.4")
    assert one_late[[r.sli for r in one_late].index("itl")].burn_rate == pytest.approx(28.57, abs=0.01)
    assert analysis.first_breach(one_late) is None
    all_late = analysis.judge({"ttft": (5.0, 0.0)}, availability_percent="99.9", min_requests=5,
                              max_burn_rate="14.4")
    assert analysis.first_breach(all_late) is not None
    some_failing = analysis.judge({"availability": (100.0, 95.0)}, availability_percent="99.9", min_requests=20,
                                  max_burn_rate="14.4")
    assert analysis.first_breach(some_failing) is not None


def test_an_sli_with_fewer_than_min_requests_events_is_not_judged():
    results = analysis.judge({"ttft": (19.0, 0.0)}, availability_percent="99.9", min_requests=20,
                             max_burn_rate="14.4")
    assert analysis.first_breach(results) is None
    rows = analysis.status_rows("abc", results)
    assert {"revision": "abc", "sli": "ttft", "events": 19, "goodEvents": 0, "burnRate": "1000.00"} in rows
    assert {"revision": "abc", "sli": "itl", "events": 0, "goodEvents": 0} in rows


# --- steps ----------------------------------------------------------------------------------------------


def rollout_spec(**over):
    base = {"strategy": "Canary", "steps": [{"weightPercent": 10, "holdSeconds": 60},
                                            {"weightPercent": 100, "holdSeconds": 30}]}
    base.update(over)
    r = spec(rollout=base).rollout
    assert r is not None
    return r


def test_rolling_strategy_and_a_first_deployment_roll_as_today():
    for r, live in ((None, steps.Live("old")), (rollout_spec(strategy="Rolling"), steps.Live("old")),
                    (rollout_spec(), steps.Live(None))):
        p = steps.plan(r, unified=True, new="new", live=live, previous=None, now=T0)
        assert not p.stable_keeps_template and p.canary_weight is None and not p.events


def test_a_new_revision_starts_a_canary_beside_the_untouched_stable():
    p = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=None, now=T0)
    assert p.stable_keeps_template and p.canary_weight == 10
    assert p.rollout["canaryRevision"] == "new" and p.rollout["stableRevision"] == "old"
    assert p.rollout["phase"] == "Progressing" and p.rollout["step"] == 0
    assert [e[0] for e in p.events] == ["CanaryStarted"]
    again = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=p.rollout, now=T0)
    assert again.canary_weight == 10 and not again.events


def test_abort_rolls_back_and_starts_nothing_until_it_is_false_again():
    running = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=None,
                         now=T0).rollout
    p = steps.plan(rollout_spec(abort=True), unified=True, new="new", live=steps.Live("old"), previous=running,
                   now=T0)
    assert p.canary_weight is None and p.stable_keeps_template and p.rollout["phase"] == "Aborted"
    assert "canaryRevision" not in p.rollout and [e[0] for e in p.events] == ["CanaryAborted"]
    retried = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=p.rollout,
                         now=T0)
    assert retried.canary_weight == 10 and [e[0] for e in retried.events] == ["CanaryStarted"]


def test_a_rolled_back_revision_is_not_tried_again_until_the_spec_changes():
    rolled = {"stableRevision": "old", "canaryWeightPercent": 0, "phase": "RolledBack", "rolledBackRevision": "new"}
    p = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=rolled, now=T0)
    assert p.canary_weight is None and p.stable_keeps_template and p.rollout["phase"] == "RolledBack"
    other = steps.plan(rollout_spec(), unified=True, new="newer", live=steps.Live("old"), previous=rolled, now=T0)
    assert other.canary_weight == 10 and other.rollout["canaryRevision"] == "newer"


def test_promoting_rolls_the_stable_and_ends_promoted_once_it_has_rolled_out():
    promoting = {"stableRevision": "old", "canaryRevision": "new", "canaryWeightPercent": 100, "phase": "Promoting",
                 "step": 1}
    p = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=promoting, now=T0)
    assert not p.stable_keeps_template and p.promoting and p.canary_weight == 100
    p = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("new", stable_rolled_out=False),
                   previous=p.rollout, now=T0)
    assert p.promoting and p.canary_weight == 100
    p = steps.plan(rollout_spec(), unified=True, new="new", live=steps.Live("new", stable_rolled_out=True),
                   previous=p.rollout, now=T0)
    assert p.canary_weight is None and p.rollout["phase"] == "Promoted" and "canaryRevision" not in p.rollout
    assert [e[0] for e in p.events] == ["CanaryPromoted"]


def started(r=None):
    return steps.plan(r or rollout_spec(), unified=True, new="new", live=steps.Live("old"), previous=None,
                      now=T0).rollout


def test_a_step_holds_then_advances_then_promotes():
    r = rollout_spec()
    rollout = started(r)
    same, events = steps.advance(r, rollout, canary_ready=1, canary_desired=1, breach=None,
                                 now=T0 + timedelta(seconds=59))
    assert same is rollout and not events
    waiting, _ = steps.advance(r, rollout, canary_ready=0, canary_desired=1, breach=None,
                               now=T0 + timedelta(seconds=61))
    assert waiting is rollout  # held until every canary replica is ready
    nxt, events = steps.advance(r, rollout, canary_ready=1, canary_desired=1, breach=None,
                                now=T0 + timedelta(seconds=61))
    assert nxt["step"] == 1 and nxt["canaryWeightPercent"] == 100 and [e[0] for e in events] == ["CanaryStep"]
    promoting, _ = steps.advance(r, nxt, canary_ready=2, canary_desired=2, breach=None,
                                 now=T0 + timedelta(seconds=61 + 31))
    assert promoting["phase"] == "Promoting" and promoting["canaryRevision"] == "new"


def test_a_breach_rolls_back_naming_the_sli():
    r = rollout_spec()
    back, events = steps.advance(r, started(r), canary_ready=1, canary_desired=1,
                                 breach="ttft: 9 of 20 events bad", now=T0 + timedelta(seconds=5))
    assert back["phase"] == "RolledBack" and back["canaryWeightPercent"] == 0 and "canaryRevision" not in back
    assert back["rolledBackRevision"] == "new" and "ttft: 9 of 20 events bad" in back["message"]
    assert events[0][0] == "CanaryRolledBack" and events[0][2] == "Warning"


def test_a_canary_not_ready_within_the_progress_deadline_rolls_back():
    r = rollout_spec(analysis={"progressDeadlineSeconds": 60})
    back, _ = steps.advance(r, started(r), canary_ready=0, canary_desired=1, breach=None,
                            now=T0 + timedelta(seconds=61))
    assert back["phase"] == "RolledBack" and "progressDeadlineSeconds 60" in back["message"]


def test_paused_holds_the_step_but_a_breach_still_rolls_back_and_promote_jumps_to_100():
    r = rollout_spec(paused=True)
    held, _ = steps.advance(r, started(r), canary_ready=1, canary_desired=1, breach=None,
                            now=T0 + timedelta(hours=1))
    assert held["phase"] == "Paused" and held["step"] == 0
    back, _ = steps.advance(r, held, canary_ready=1, canary_desired=1, breach="availability: 5 of 20 events bad",
                            now=T0 + timedelta(hours=1))
    assert back["phase"] == "RolledBack"
    p = rollout_spec(promote=True)
    jumped, _ = steps.advance(p, started(p), canary_ready=1, canary_desired=1, breach=None, now=T0)
    assert jumped["step"] == 1 and jumped["canaryWeightPercent"] == 100
    promoting, _ = steps.advance(p, jumped, canary_ready=2, canary_desired=2, breach=None, now=T0)
    assert promoting["phase"] == "Promoting"


def test_canary_replicas_are_the_weight_of_the_stable_rounded_up():
    assert [steps.canary_replicas(w, 4) for w in (1, 10, 25, 50, 100)] == [1, 1, 1, 2, 4]
    assert steps.canary_replicas(10, 0) == 1


# --- validation ---------------------------------------------------------------------------------------------


def test_steps_must_increase_and_end_at_100_and_rollout_refuses_disaggregation():
    problems = validate(spec(rollout={"strategy": "Canary", "steps": [{"weightPercent": 50}, {"weightPercent": 20}]}))
    assert any(p.startswith("spec.rollout.steps[1].weightPercent: 20 is not above the previous step's 50")
               for p in problems)
    assert any(p.startswith("spec.rollout.steps[1].weightPercent: 20; ") and "must be 100" in p for p in problems)
    dis = spec(disaggregation={}, engine={"kvTransfer": {"connector": "Nixl"}})
    assert any("spec.rollout cannot be combined with spec.disaggregation" in p for p in validate(dis))
    assert validate(spec()) == []
