"""Retry-After sized to the crowd: a simulated closed-loop crowd on a fake clock."""
import random

from gpufleet_engine.admission.retry_hint import RetryAdvisor


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(clients: int, admits_per_s: float, seconds: float, advisor: RetryAdvisor, clock: Clock):
    """Each client retries after the hint it got (jittered like the guard's
    retry-after-ms); openings appear at ``admits_per_s`` and go to whoever asks first."""
    rng = random.Random(1)
    due = [rng.uniform(0, 1) for _ in range(clients)]
    capacity, refusals, step = 0.0, 0, 0.01
    while clock.t < seconds:
        clock.t += step
        capacity = min(capacity + admits_per_s * step, 1.0)
        for i, d in enumerate(due):
            if d > clock.t:
                continue
            if capacity >= 1.0:
                capacity -= 1.0
                advisor.admitted()
                due[i] = clock.t + 1.0 / 1.5   # served, then comes back with a new request
            else:
                refusals += 1 if clock.t > seconds / 2 else 0
                due[i] = clock.t + advisor.refused() * rng.uniform(0.5, 1.5)
    return refusals / (seconds / 2)


def test_without_refusals_the_hint_is_the_configured_one():
    assert RetryAdvisor(1.0, clock=Clock()).hint() == 1.0


def test_refusals_settle_near_k_per_admission_instead_of_growing_with_the_crowd():
    clock = Clock()
    fixed = simulate(128, 10, 60, RetryAdvisor(1.0, maximum=1.0, clock=clock), clock)
    clock = Clock()
    advisor = RetryAdvisor(1.0, clock=clock)
    adaptive = simulate(128, 10, 60, advisor, clock)
    assert fixed > 90                       # ~one refusal per client per second
    assert 0.5 * advisor.k * 10 < adaptive < 1.2 * advisor.k * 10, adaptive   # ~k x 10 admissions per second
    assert adaptive < 0.7 * fixed
    assert 1.0 < advisor.hint() < 4.0       # ~128 / (k x 10)


def test_hint_stays_within_bounds_and_backs_off_when_nothing_is_admitted():
    clock = Clock()
    adv = RetryAdvisor(1.0, maximum=30.0, clock=clock)
    hints = []
    for _ in range(50):
        clock.t += 0.1
        hints.append(adv.refused())
    assert hints[0] == 1.0 and max(hints) <= 30.0 and hints[-1] == 30.0


def test_a_small_crowd_keeps_the_configured_hint():
    clock = Clock()
    adv = RetryAdvisor(1.0, clock=clock)
    simulate(4, 10, 30, adv, clock)
    assert adv.hint() == 1.0


def test_the_crowd_is_the_refused_clients_whose_retry_after_has_not_run_out():
    clock = Clock()
    adv = RetryAdvisor(1.0, clock=clock)
    for _ in range(20):
        adv.admitted()
    assert [adv.refused() for _ in range(3)] == [1.0, 1.0, 1.0]
    assert adv.crowd() == 3
    clock.t = 0.99
    assert adv.crowd() == 3
    clock.t = 1.0
    assert adv.crowd() == 0   # counted, not a rate over seconds that would still show them
