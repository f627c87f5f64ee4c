"""F1/EM scoring against hand-checked cases, and the fidelity measures."""

import pytest
import torch

from ragkv.metrics import (
    attention_deviation,
    exact_match,
    first_token_agreement,
    first_token_kl,
    max_over_golds,
    normalize_answer,
    token_f1,
)


def test_normalization_drops_articles_punctuation_case():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a day") == "apple day"


@pytest.mark.parametrize(
    "pred,gold,f1",
    [
        ("Barack Obama", "barack obama", 1.0),
        ("the president Barack Obama", "Barack Obama", 2 * (2 / 3) * 1 / (2 / 3 + 1)),
        ("Paris", "London", 0.0),
        ("", "London", 0.0),
        ("", "", 1.0),
        ("a the an", "", 1.0),
    ],
)
def test_token_f1_cases(pred, gold, f1):
    assert token_f1(pred, gold) == pytest.approx(f1)


def test_max_over_golds_list_and_list_of_lists():
    assert max_over_golds(token_f1, "New York City", ["Boston", "New York"]) == pytest.approx(0.8)
    assert max_over_golds(exact_match, "1912", [["April 1912", "1912"], ["1913"]]) == 1.0
    assert max_over_golds(token_f1, "x", []) == 0.0


def test_fidelity_measures():
    a = torch.tensor([2.0, 1.0, 0.0])
    assert first_token_kl(a, a) == pytest.approx(0.0, abs=1e-7)
    assert first_token_kl(a, torch.tensor([0.0, 1.0, 2.0])) > 0.5
    assert first_token_agreement(a, a + 1) and not first_token_agreement(a, -a)
    p = [torch.full((1, 2, 4), 0.25)] * 2
    assert attention_deviation(p, p) == [0.0, 0.0]
    with pytest.raises(ValueError):
        attention_deviation(p, p[:1])


def test_percentile_interpolates_between_ranks_and_skips_missing_values():
    """The one percentile (the engine's metrics and the benchmarks): numpy's default linear
    interpolation, None and NaN left out, ``empty`` when nothing is left."""
    import math

    import numpy as np

    from ragkv.metrics import percentile

    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    for q in (0, 10, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([1.0, None, float("nan"), 3.0], 50) == 2.0
    assert math.isnan(percentile([], 50)) and percentile([None], 50, empty=None) is None
    assert percentile(iter([7.0]), 99) == 7.0  # any iterable, one value
