"""Status as observed state: a service's fast-moving figures reach status at most every N seconds,
everything an on-call acts on at once with the figures riding along (reconcile/figures.py)."""
import pytest

from gpufleet.reconcile import figures
from gpufleet.reconcile.figures import TIME_FIELD, FigurePacer
from gpufleet_api import parse_spec

STAMP = "2027-01-01T00:00:00Z"
SHOWN = {"kvCacheUsagePercent": 40, "ttftP99Milliseconds": 300, "desiredReplicas": 2}
LIMITS = {"kvCacheUsagePercent": 80, "ttftP99Milliseconds": 2000}


def written_at(pacer: FigurePacer, now: float) -> FigurePacer:
    pacer.wrote({TIME_FIELD: STAMP}, now)
    return pacer


def test_figures_that_moved_are_written_once_the_interval_has_passed_and_not_before():
    pacer = written_at(FigurePacer(20), 100.0)
    moved = {"kvCacheUsagePercent": 41, "ttftP99Milliseconds": 310}
    assert pacer.plan(moved, SHOWN, 101.0, stamp=STAMP) == {}
    assert pacer.plan(moved, SHOWN, 119.9, stamp=STAMP) == {}
    assert pacer.plan(moved, SHOWN, 120.0, stamp=STAMP) == {**moved, TIME_FIELD: STAMP}


def test_the_first_figures_of_this_process_are_written_at_once():
    assert FigurePacer(20).plan({"kvCacheUsagePercent": 41}, SHOWN, 5.0, stamp=STAMP) == {
        "kvCacheUsagePercent": 41, TIME_FIELD: STAMP}


def test_figures_that_hold_still_are_not_rewritten_even_when_due():
    pacer = written_at(FigurePacer(20), 0.0)
    assert pacer.plan({"kvCacheUsagePercent": 40, "ttftP99Milliseconds": 300}, SHOWN, 1000.0) == {}


def test_other_fields_are_written_at_once_and_the_figures_ride_along():
    pacer = written_at(FigurePacer(20), 100.0)
    fields = {"kvCacheUsagePercent": 45, "prefillDecodeRatio": {"prefill": 1, "decode": 2}}
    assert pacer.plan(fields, SHOWN, 101.0, stamp=STAMP) == {**fields, TIME_FIELD: STAMP}


def test_a_condition_change_writes_at_once_with_the_figures():
    pacer = written_at(FigurePacer(20), 100.0)
    assert pacer.plan({"kvCacheUsagePercent": 45}, SHOWN, 101.0, urgent=True, stamp=STAMP) == {
        "kvCacheUsagePercent": 45, TIME_FIELD: STAMP}
    # Figures that did not move add nothing to the write (and no new time).
    assert pacer.plan({"kvCacheUsagePercent": 40}, SHOWN, 101.0, urgent=True, stamp=STAMP) == {}


def test_unchanged_other_fields_are_no_reason_to_write():
    pacer = written_at(FigurePacer(20), 100.0)
    assert pacer.plan({"kvCacheUsagePercent": 45, "desiredReplicas": 2}, SHOWN, 101.0) == {}


def test_interval_0_writes_every_change():
    pacer = FigurePacer(0)
    for now in range(5):
        plan = pacer.plan({"kvCacheUsagePercent": 41 + now}, SHOWN, float(now), stamp=STAMP)
        assert plan == {"kvCacheUsagePercent": 41 + now, TIME_FIELD: STAMP}
        pacer.wrote(plan, float(now))


def test_rising_above_a_limit_is_written_at_once_falling_back_waits():
    pacer = written_at(FigurePacer(20), 100.0)
    hot = {"kvCacheUsagePercent": 85}
    assert pacer.plan(hot, SHOWN, 101.0, limits=LIMITS, stamp=STAMP) == {**hot, TIME_FIELD: STAMP}
    pacer.wrote({**hot, TIME_FIELD: STAMP}, 101.0)
    shown_hot = {**SHOWN, **hot}
    assert pacer.plan({"kvCacheUsagePercent": 60}, shown_hot, 102.0, limits=LIMITS) == {}
    assert pacer.plan({"kvCacheUsagePercent": 90}, shown_hot, 103.0, limits=LIMITS) == {}  # still above: paced
    slow = {"ttftP99Milliseconds": 2500}
    assert pacer.plan(slow, SHOWN, 103.0, limits=LIMITS, stamp=STAMP) == {**slow, TIME_FIELD: STAMP}


def test_a_figure_hovering_at_its_limit_costs_at_most_two_writes_an_interval():
    pacer, shown, writes = FigurePacer(20), dict(SHOWN), 0
    for now in range(200):
        plan = pacer.plan({"kvCacheUsagePercent": 81 if now % 2 else 79}, shown, float(now), limits=LIMITS)
        if plan:
            writes += 1
            shown.update(plan)
            pacer.wrote(plan, float(now))
    assert writes <= 2 * 200 / 20 + 1


def test_only_a_write_that_carried_the_figures_starts_the_interval_again():
    pacer = written_at(FigurePacer(20), 100.0)
    pacer.wrote({"prefillDecodeRatio": {}}, 110.0)
    assert pacer.written_at == 100.0
    assert figures.due(pacer.written_at, 120.0, 20) and not figures.due(pacer.written_at, 119.0, 20)
    assert figures.due(None, 0.0, 20) and figures.due(100.0, 100.0, 0)


def test_the_limits_are_the_services_own():
    spec = parse_spec({"model": {"name": "m"}, "autoscaling": {"kvHighWatermarkPercent": 70},
                       "slo": {"ttftP99Milliseconds": 900}})
    assert figures.limits(spec) == {"kvCacheUsagePercent": 70, "ttftP99Milliseconds": 900}


@pytest.mark.parametrize("shown, now, expected", [
    ({}, {"kvCacheUsagePercent": 81}, ["kvCacheUsagePercent"]),
    ({"kvCacheUsagePercent": 80}, {"kvCacheUsagePercent": 81}, ["kvCacheUsagePercent"]),
    ({"kvCacheUsagePercent": 81}, {"kvCacheUsagePercent": 95}, []),
    ({"kvCacheUsagePercent": 40}, {"kvCacheUsagePercent": 80}, []),
    ({"kvCacheUsagePercent": 40}, {}, []),
])
def test_risen_above(shown, now, expected):
    assert figures.risen_above(shown, now, LIMITS) == expected
