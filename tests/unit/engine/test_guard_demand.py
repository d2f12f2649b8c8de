"""Learning output lengths: what a request reserves, and how a reservation grows."""
from __future__ import annotations

import pytest

from gpufleet_engine.admission.demand import Demand, OutputPredictor

KEY = ("/v1/chat/completions", "interactive")


def learned(lengths, **kwargs) -> OutputPredictor:
    p = OutputPredictor(**kwargs)
    for n in lengths:
        p.observe(KEY, n)
    return p


def test_until_enough_answers_are_known_the_prior_is_the_whole_budget_with_no_variance():
    p = learned([10] * 15, min_samples=16)
    assert p.prediction(KEY) is None and p.reserve(KEY, 2000) == Demand(2000, 0.0)
    p.observe(KEY, 10)
    assert p.reserve(KEY, 2000) == Demand(10, 0.0)


def test_the_reservation_is_the_mean_of_recent_answers_with_their_variance_never_above_the_budget():
    p = learned(range(1, 101))                    # 1..100 tokens: mean 50.5, variance (100² - 1) / 12
    assert p.prediction(KEY) == 50.5
    d = p.reserve(KEY, 2000)
    assert d.tokens == 51 and d.variance == pytest.approx((100 ** 2 - 1) / 12)
    # The budget clips the answers the mean is taken over: min(budget, length).
    clipped = p.reserve(KEY, 20)
    assert clipped.tokens == 19 and clipped.variance < d.variance  # (1+…+20 + 80·20) / 100 = 18.1
    assert p.reserve(KEY, 1).tokens == 1


def test_routes_and_classes_are_learned_apart():
    p = learned([100] * 20)
    assert p.reserve(("/v1/completions", "interactive"), 500) == Demand(500)
    assert p.reserve(KEY, 500) == Demand(100)


def test_old_answers_leave_the_window_so_the_prediction_follows_the_traffic():
    p = learned([500] * 64 + [20] * 64, window=64)
    assert p.prediction(KEY) == 20


def test_an_answer_past_its_reservation_is_extended_to_what_longer_answers_used():
    p = learned([10] * 90 + [200] * 5 + [400] * 5)   # mean 39
    assert p.reserve(KEY, 1000).tokens == 39
    # Past 39 tokens only the long answers are left: their mean (300) and variance (100²).
    assert p.extension(KEY, seen=39, budget=1000) == Demand(300, 10000.0)
    assert p.extension(KEY, seen=39, budget=300).tokens == 250     # 200 and 300 (clipped)


def test_beyond_every_known_answer_the_reservation_doubles_up_to_the_budget():
    p = learned([10] * 20)
    assert p.extension(KEY, seen=30, budget=1000) == Demand(60)
    assert p.extension(KEY, seen=600, budget=1000) == Demand(1000)
    assert OutputPredictor().extension(KEY, seen=0, budget=8) == Demand(2)


def test_the_moments_kept_as_sums_equal_the_moments_of_the_window_as_it_slides():
    """The sorted lengths' squares and the window's total are updated on every answer, so that an
    admission reads two slice sums; they must agree with the moments taken over the window itself."""
    import random
    import statistics

    rng = random.Random(5)
    p = OutputPredictor(min_samples=1, window=64)
    window: list[int] = []
    for _ in range(400):
        n = int(rng.paretovariate(1.2) * 20)
        p.observe(KEY, n)
        window = (window + [n])[-64:]
        budget, above = rng.choice([16, 64, 300, 5000]), rng.choice([-1, 10, 50])
        assert p.prediction(KEY) == pytest.approx(statistics.fmean(window))
        longer = [min(budget, x) for x in window if x > above]
        extension = p.extension(KEY, above, budget) if above >= 0 else None
        if above < 0:
            d = p.reserve(KEY, budget)
            assert d.variance == pytest.approx(statistics.pvariance(longer), abs=1e-9)
            assert d.tokens == max(1, min(budget, -(-sum(longer) // len(longer))))
        elif longer:
            assert extension is not None
            assert extension.variance == pytest.approx(statistics.pvariance(longer), abs=1e-9)
