"""compute_chunk_kv: the chunk convention's KV, and chunk KV written after a context (issue 38's
context-primed candidates)."""

from __future__ import annotations

import torch

from ragkv.model import random_model
from ragkv.model.forward import compute_chunk_kv


def _ids(m, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, m.config.vocab_size, (n,), generator=g).tolist()


def test_chunk_kv_after_a_context_is_the_chunks_rows_of_one_prefill_of_bos_context_chunk():
    m = random_model(seed=2, num_hidden_layers=3)
    chunk, ctx = _ids(m, 9, 0), _ids(m, 14, 1)
    kv = compute_chunk_kv(m, chunk, context=ctx)
    bos = [m.config.bos_token_id]
    _, k, v = m.forward(torch.tensor(bos + ctx + chunk), capture_kv=True)  # pre-RoPE K, as stored
    start = 1 + len(ctx)
    assert kv.start_pos == start and kv.token_ids.tolist() == chunk
    torch.testing.assert_close(kv.k, k[:, start:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.v, v[:, start:], rtol=1e-5, atol=1e-5)
    alone = compute_chunk_kv(m, chunk)
    assert alone.start_pos == 1 and not torch.allclose(alone.k, kv.k)  # the context changed the rows


def test_an_empty_context_is_the_convention_and_a_long_one_is_cut_from_the_front():
    m = random_model(seed=2, num_hidden_layers=2)
    chunk = _ids(m, 8, 3)
    plain = compute_chunk_kv(m, chunk)
    assert torch.equal(compute_chunk_kv(m, chunk, context=[]).k, plain.k)
    room = m.config.max_position - len(chunk) - 1
    long_ctx = _ids(m, room + 50, 4)
    cut = compute_chunk_kv(m, chunk, context=long_ctx)
    assert cut.start_pos == 1 + room
    torch.testing.assert_close(cut.k, compute_chunk_kv(m, chunk, context=long_ctx[-room:]).k)
