"""Learning output lengths: what a request reserves, and how a reservation grows."""
from __future__ import annotations

from gpufleet_engine.demand import OutputPredictor

KEY = ("/v1/chat/completions", "interactive")


def learned(lengths, quantile=0.9, **kwargs) -> OutputPredictor:
    p = OutputPredictor(quantile, **kwargs)
    for n in lengths:
        p.observe(KEY, n)
    return p


def test_until_enough_answers_are_known_the_prior_is_the_whole_budget():
    p = learned([10] * 15, min_samples=16)
    assert p.prediction(KEY) is None and p.reserve(KEY, 2000) == 2000
    p.observe(KEY, 10)
    assert p.reserve(KEY, 2000) == 10


def test_the_reservation_is_the_quantile_of_recent_answers_never_above_the_budget():
    p = learned(range(1, 101))                    # 1..100 tokens
    assert p.prediction(KEY) == 90
    assert p.reserve(KEY, 2000) == 90 and p.reserve(KEY, 50) == 50
    assert learned(range(1, 101), quantile=0.5).reserve(KEY, 2000) == 50
    assert learned(range(1, 101), quantile=1.0).reserve(KEY, 2000) == 100


def test_routes_and_classes_are_learned_apart():
    p = learned([100] * 20)
    assert p.reserve(("/v1/completions", "interactive"), 500) == 500
    assert p.reserve(KEY, 500) == 100


def test_old_answers_leave_the_window_so_the_prediction_follows_the_traffic():
    p = learned([500] * 64 + [20] * 64, window=64)
    assert p.prediction(KEY) == 20


def test_an_answer_past_its_reservation_is_extended_to_what_longer_answers_used():
    p = learned([10] * 90 + [200] * 5 + [400] * 5)   # p90 = 10
    assert p.reserve(KEY, 1000) == 10
    # Past 10 tokens only the long answers are left: their p90.
    assert p.extension(KEY, seen=10, budget=1000) == 400
    assert p.extension(KEY, seen=10, budget=300) == 300


def test_beyond_every_known_answer_the_reservation_doubles_up_to_the_budget():
    p = learned([10] * 20)
    assert p.extension(KEY, seen=30, budget=1000) == 60
    assert p.extension(KEY, seen=600, budget=1000) == 1000
    assert OutputPredictor(0.9).extension(KEY, seen=0, budget=8) == 2
