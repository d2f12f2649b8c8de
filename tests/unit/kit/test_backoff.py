"""The one backoff (gpufleet_kit.backoff) every component uses."""
from __future__ import annotations

import pytest

from gpufleet_kit.backoff import Backoff, KeyedBackoff, delay


def test_the_delay_doubles_from_the_first_pause_to_the_cap():
    assert [delay(n, 2.0, 60.0) for n in range(0, 8)] == [0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert delay(10_000, 0.25, 2.0) == 2.0   # no overflow however long the failures run


def test_a_backoff_without_jitter_doubles_and_resets():
    backoff = Backoff(first=0.5, cap=4.0)
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_jitter_stays_within_its_band():
    assert Backoff(first=1.0, jitter=0.2, rand=lambda: 0.0).next() == pytest.approx(0.8)
    assert Backoff(first=1.0, jitter=0.2, rand=lambda: 0.999999).next() == pytest.approx(1.2, abs=1e-5)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=1.0)


def test_a_keyed_backoff_keeps_each_key_apart_and_forgets_the_gone():
    backoff: KeyedBackoff[str] = KeyedBackoff(2.0, 60.0)
    assert backoff.failed("a", now=0.0) == 2.0 and backoff.failed("a", now=2.0) == 4.0
    assert backoff.failed("b", now=2.0) == 2.0
    assert backoff.waiting("a", 5.9) and not backoff.waiting("a", 6.0)
    assert backoff.failures("a") == 2
    backoff.succeeded("a")
    assert not backoff.waiting("a", 0.0) and backoff.failed("a", now=10.0) == 2.0
    backoff.forget_except({"a"})
    assert backoff.failures("b") == 0
