"""The one percentile (gpufleet_kit.stats) the components and benchmarks use."""
from __future__ import annotations

import pytest

from gpufleet_kit.stats import nearest_rank


def test_nearest_rank_gives_a_value_that_occurred():
    assert nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0
    assert nearest_rank([float(i) for i in range(1, 11)], 0.9) == 9.0
    assert nearest_rank([4.0], 0.99) == 4.0
    assert nearest_rank(list(range(1, 51)), 0.99) == 50   # p99 of 50 samples is the largest
    assert nearest_rank([10, 20, 30, 40], 0.5) == 20 and nearest_rank([10, 20, 30, 40], 0.51) == 30


@pytest.mark.parametrize("values,q", [([], 0.5), ([1.0], 0.0), ([1.0], 1.5)])
def test_nearest_rank_refuses_what_has_no_answer(values, q):
    with pytest.raises(ValueError):
        nearest_rank(values, q)
