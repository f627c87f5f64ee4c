"""Paged decode attention: one query row per sequence over its own KV blocks in a shared pool.

The engine's batched decode reads K/V from a pool ``[num_blocks, block_size, Hkv, D]`` through
per-sequence block tables. Gathering the blocks and attending over them is plain attention; the
fusion package adds per-block norms on top (:func:`ragkv.fusion.norm_attention.paged_norm_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragkv.attention.dense import position_mask


def decode_mask(lengths: torch.Tensor, num_keys: int, sliding_window: int | None = None) -> torch.Tensor:
    """``[B, num_keys]``: key ``t`` visible to the query at position ``lengths - 1`` (and in its window)."""
    return position_mask(lengths - 1, torch.arange(num_keys, device=lengths.device), sliding_window)


def gather_blocks(
    k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks, in table order: ``k, v [B, nb, bs, Hkv, D]`` (a transient copy)."""
    b, nb = tables.shape
    bs, hkv, d = k_pool.shape[1:]
    flat = tables.reshape(-1)
    return (
        k_pool.index_select(0, flat).view(b, nb, bs, hkv, d),
        v_pool.index_select(0, flat).view(b, nb, bs, hkv, d),
    )


def attend_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, Hq, D]`` over gathered ``k, v [B, nb, bs, Hkv, D]`` with visible keys ``mask [B, nb*bs]``."""
    b, nb, bs, hkv, d = k.shape
    k = k.reshape(b, nb * bs, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    v = v.reshape(b, nb * bs, hkv, d).transpose(1, 2)
    hq = q.shape[1]
    out = F.scaled_dot_product_attention(
        q.reshape(b, hq, 1, d).to(k.dtype),
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=hq != hkv,
    )
    return out.reshape(q.shape).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched decode: ``q [B, Hq, D]`` (the token at position ``lengths - 1``) over its block table.

    ``tables [B, nb]``: padding entries may point anywhere (masked by ``lengths [B]``); keys sit at
    positions ``0 .. lengths-1`` in table order. ``mask [B, nb * bs]`` may be passed precomputed (it
    is the same for every layer of a step with the same window). Returns ``[B, Hq, D]``.
    """
    k, v = gather_blocks(k_pool, v_pool, tables)
    if mask is None:
        mask = decode_mask(lengths, tables.shape[1] * k_pool.shape[1], sliding_window)
    return attend_blocks(q, k, v, mask, scale)


def batch_tables(seqs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's (``PagedSequence``s) block tables ``[L, B, NB]`` (padded with block 0: masked by length) and, when some
    entry is fused, its norms ``[2, L, B, NB]`` (else None); stacked once per step."""
    nb = max(s.num_blocks for s in seqs)
    tables = torch.stack([F.pad(s.table, (0, nb - s.num_blocks)) for s in seqs], 1)
    if not any(f for s in seqs for f in s.fused):
        return tables, None
    return tables, torch.stack([F.pad(s.norms, (0, nb - s.num_blocks), value=1.0) for s in seqs], 2)
