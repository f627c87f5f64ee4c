"""ragkv.attention.dense: the explicit and blocked paths equal plain attention."""

from __future__ import annotations

import pytest
import torch

from ragkv.attention.dense import attention, attention_probs, explicit_attention


def _qkv(n_q: int, n_k: int, hq: int = 6, hkv: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_q, hq, d, generator=g),
        torch.randn(n_k, hkv, d, generator=g),
        torch.randn(n_k, hkv, d, generator=g),
    )


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("where", ["tail", "scattered"])
def test_explicit_attention_is_attention_and_the_summed_probabilities(window, where):
    n_k = 200
    rows = torch.arange(n_k - 12, n_k) if where == "tail" else torch.tensor([3, 40, 41, 90, 150, 199])
    q, k, v = _qkv(rows.numel(), n_k)
    pos = torch.arange(n_k)
    out, mass = explicit_attention(q, k, v, rows, pos, 0.25, window)
    torch.testing.assert_close(out, attention(q, k, v, rows, pos, 0.25, sliding_window=window))
    torch.testing.assert_close(mass, attention_probs(q, k, rows, pos, 0.25, window).sum(dim=(0, 1)))
    # every query's probabilities sum to one, so the mass sums to rows x heads
    assert float(mass.sum()) == pytest.approx(rows.numel() * q.shape[1], rel=1e-5)
    assert float(mass[int(rows.max()) + 1 :].sum()) == 0.0  # nothing on keys after every query


@pytest.mark.parametrize("where", ["tail", "scattered", "head"])
def test_position_blocks_equal_one_call(where):
    n_k = 300
    g = torch.Generator().manual_seed(1)
    rows = {
        "tail": torch.arange(n_k - 40, n_k),  # bunched at the end: not split (nothing to skip)
        "scattered": torch.randperm(n_k, generator=g)[:60].sort().values,  # split into blocks
        "head": torch.cat([torch.arange(10, 40), torch.tensor([n_k - 1])]),
    }[where]
    q, k, v = _qkv(rows.numel(), n_k)
    pos = torch.arange(n_k)
    torch.testing.assert_close(
        attention(q, k, v, rows, pos, 0.25, position_blocks=4), attention(q, k, v, rows, pos, 0.25)
    )


def test_explicit_attention_with_an_identity_temper_is_attention_under_gqa():
    from ragkv.attention.dense import ContextTemper

    n_k = 120
    rows = torch.tensor([5, 60, 61, 119])
    q, k, v = _qkv(rows.numel(), n_k)  # 6 query heads over 2 KV heads
    pos = torch.arange(n_k)
    ctx = torch.zeros(n_k, dtype=torch.bool)
    ctx[10:90] = True
    out, mass = explicit_attention(q, k, v, rows, pos, 0.25, temper=ContextTemper(1.0, 1.0, ctx))
    torch.testing.assert_close(out, attention(q, k, v, rows, pos, 0.25))
    torch.testing.assert_close(mass, attention_probs(q, k, rows, pos, 0.25).sum(dim=(0, 1)))
