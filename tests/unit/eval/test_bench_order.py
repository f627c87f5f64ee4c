"""eval.bench_order (issue 52, item 5): the orders it measures are permutations, fixed per question."""

from __future__ import annotations

import pytest

from eval.bench_order import permuted


def test_orders_are_fixed_permutations_other_than_the_given_one():
    assert permuted("reverse", 4, "q") == [3, 2, 1, 0]
    for n in (2, 3, 6):
        got = permuted("shuffle", n, "short-000")
        assert sorted(got) == list(range(n)) and got != list(range(n))
        assert got == permuted("shuffle", n, "short-000")  # resumable: the same order on a rerun
    assert permuted("shuffle", 1, "q") == [0]
    with pytest.raises(ValueError, match="unknown order"):
        permuted("cache", 3, "q")
