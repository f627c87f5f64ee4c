"""The dense decode cache: head-major storage, attention equal to the reference over explicit positions."""

from __future__ import annotations

import pytest
import torch

from ragkv.attention.dense import attention
from ragkv.attention.kvcache import DenseKVCache


def _rows(g, n, h=3, d=16):
    return torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)


@pytest.mark.parametrize("window", [None, 5])
def test_attend_equals_reference_attention_for_decode_and_hidden_rows(window):
    g = torch.Generator().manual_seed(0)
    cache = DenseKVCache(
        num_layers=2, num_kv_heads=3, head_dim=16, scale=0.25, capacity=4, sliding_window=window
    )
    # a blend-like prompt: positions out of order, then decode rows (the cache grows past its capacity)
    pos = torch.tensor([0, 1, 2, 7, 8, 3, 4, 5, 6, 9])
    k, v = _rows(g, len(pos))
    for layer in range(2):
        cache.write(layer, pos, k, v)
    all_k, all_v, all_pos = k, v, pos
    for step in range(3):
        q = torch.randn(1, 9, 16, generator=g)  # GQA: 3 query heads a KV head
        qp = torch.tensor([10 + step])
        nk, nv = _rows(g, 1)
        all_k, all_v, all_pos = torch.cat([all_k, nk]), torch.cat([all_v, nv]), torch.cat([all_pos, qp])
        cache.write(0, qp, nk, nv)
        got = cache.attend(0, q, qp)
        want = attention(q, all_k, all_v, qp, all_pos, 0.25, sliding_window=window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # several query rows, some before rows already written (a question pass): masked by position
    q = torch.randn(3, 9, 16, generator=g)
    qp = torch.tensor([4, 8, 12])
    got = cache.attend(0, q, qp)
    want = attention(q, all_k, all_v, qp, all_pos, 0.25, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    lk, lv, lp = cache.layer_kv(0)
    assert torch.equal(lk, all_k) and torch.equal(lv, all_v) and torch.equal(lp, all_pos)
    assert cache.length == len(pos)  # the last layer's rows
    assert cache.nbytes() == 2 * len(pos) * 3 * 16 * 4 * 2


def test_the_cache_offers_no_fused_slot_where_a_row_is_hidden_or_tempered():
    """Sliding windows, APE tempering, a position below rows already written, or another dtype: the
    step rotates, writes and attends as before (and nothing is counted)."""
    from ragkv.attention.dense import ContextTemper
    from ragkv.attention.kvcache import DenseKVCache

    def cache(**kw):
        c = DenseKVCache(num_layers=2, num_kv_heads=1, head_dim=16, scale=0.25, capacity=4, **kw)
        c.write(0, torch.tensor([3]), torch.randn(1, 1, 16), torch.randn(1, 1, 16))
        return c

    c = cache()
    k, v, row, scale = c.decode_slot(0, torch.tensor([4]))
    assert row == 1 and scale == 0.25 and c._len[0] == 2 and int(c._pos[0, 1]) == 4
    assert c.decode_slot(0, torch.tensor([2])) is None and c._len[0] == 2  # a row at 3 would be hidden
    assert cache(sliding_window=8).decode_slot(0, torch.tensor([4])) is None
    assert cache(dtype=torch.float16).decode_slot(0, torch.tensor([4])) is None
    t = cache()
    t.temper = ContextTemper(1.0, 1.0, torch.zeros(1, dtype=torch.bool))
    assert t.decode_slot(0, torch.tensor([4])) is None and t._len[0] == 1
