"""The cold-start estimate a held request's Retry-After comes from."""
from gpufleet_router.policy.cold_start import DEFAULT_COLD_START_SECONDS, ColdStarts


def test_before_any_measurement_the_default_is_expected():
    c = ColdStarts()
    assert c.expected() == DEFAULT_COLD_START_SECONDS and c.measured == 0


def test_the_median_of_recent_cold_starts_is_expected_and_old_ones_are_forgotten():
    c = ColdStarts(keep=3)
    for seconds in (300.0, 20.0, 30.0, 40.0):
        c.record(seconds)
    assert c.measured == 3 and c.expected() == 30.0


def test_retry_after_is_what_remains_and_at_least_a_second():
    c = ColdStarts()
    c.record(30.0)
    assert c.retry_after(10.0) == 20.0
    assert c.retry_after(45.0) == 1.0
