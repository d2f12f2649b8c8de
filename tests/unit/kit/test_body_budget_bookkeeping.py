"""The budget's bookkeeping (gpufleet_kit.body_budget): a claim grows while it fits, is refused past the
limit without taking anything, and gives back everything it held exactly once."""
from __future__ import annotations

import pytest

from gpufleet_kit.body_budget import BodyBudget, BudgetExhausted


def test_claims_share_the_limit_and_give_back_what_they_held():
    budget = BodyBudget(100)
    with budget.claim() as a, budget.claim() as b:
        a.grow(60)
        with pytest.raises(BudgetExhausted) as refused:
            b.grow(41)
        assert (refused.value.held, refused.value.wanted, refused.value.limit) == (60, 41, 100)
        assert "budget of 100 bytes" in str(refused.value)
        b.grow(40)
        assert budget.held == 100 and budget.peak == 100 and budget.refused == 1
    assert budget.held == 0 and a.bytes == b.bytes == 0


def test_a_release_twice_gives_back_once():
    budget = BodyBudget(10)
    claim = budget.claim()
    claim.grow(7)
    claim.release()
    claim.release()
    assert budget.held == 0


def test_a_budget_must_hold_something():
    with pytest.raises(ValueError, match="at least 1 byte"):
        BodyBudget(0)
