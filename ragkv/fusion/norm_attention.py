"""Norm-aware attention over (possibly fused) KV blocks: one unit-direction block, per-member norms.

A fused block of a member sequence is ``n_K * u_K`` (keys) and ``n_V * u_V`` (values), where the
unit directions ``u`` are shared by every member and the scalars are the member's own original
block norms. Because ``q . (n_K u_t) = n_K (q . u_t)`` and ``sum_t p_t n_V u_t = n_V sum_t p_t u_t``,
attention multiplies the logits of every key of the block by ``n_K`` and the block's PV partial
sum by ``n_V``: exactly attention over the rescaled replicated blocks (the paper's accuracy mode,
§6.1-6.3), but with one physical copy (the paper's memory mode, §6.4). The paper measured those two
modes separately and left this kernel as future work (digest A.2.4); this is that kernel, in
PyTorch. Unfused blocks simply have norms 1 and hold their original data.
"""

from __future__ import annotations

import torch

from ragkv.attention.dense import position_mask
from ragkv.attention.paged import attend_blocks, decode_mask, gather_blocks


def _gqa_q(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[..., Hq, D]`` -> ``[..., Hkv, G, D]``: query head h uses kv head h // G."""
    *lead, hq, d = q.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    return q.reshape(*lead, hkv, hq // hkv, d)


def norm_aware_attention(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    k_norm: torch.Tensor,
    v_norm: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence: ``q [n, Hq, D]`` over blocks ``k/v_blocks [nb, bs, Hkv, D]`` with per-block norms ``[nb]``.

    ``k_pos [nb * bs]`` are the key positions (``-1`` or anything ``> q_pos`` masks a slot). Returns
    ``[n, Hq, D]`` in ``q``'s dtype; computed in fp32.
    """
    nb, bs, hkv, d = k_blocks.shape
    qg = _gqa_q(q.float(), hkv)  # [n, Hkv, G, D]
    k = k_blocks.float().reshape(nb * bs, hkv, d)
    v = v_blocks.float().reshape(nb * bs, hkv, d)
    kn = k_norm.float().repeat_interleave(bs)  # [T]
    vn = v_norm.float().repeat_interleave(bs)
    logits = torch.einsum("nhgd,thd->nhgt", qg, k) * (kn * scale)  # logits x n_K per block
    mask = position_mask(q_pos, k_pos, sliding_window) & (k_pos[None, :] >= 0)
    logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    out = torch.einsum("nhgt,thd->nhgd", p * vn, v)  # PV partial of each block x n_V
    return out.reshape(q.shape).to(q.dtype)


def paged_norm_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    k_norm: torch.Tensor | None,
    v_norm: torch.Tensor | None,
    lengths: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
    fused: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Batched paged decode (:func:`ragkv.attention.paged.paged_attention`) over fused blocks.

    Per-block norms ``k_norm, v_norm [B, nb]`` (``None``: all 1) rescale each sequence's gathered
    copy of its blocks; ``fused = (seq_idx, block_idx, n_K, n_V)`` lists only the fused entries (the
    sparse form of the norms; the rest are 1). The pool keeps one unit copy. Returns ``[B, Hq, D]``.
    """
    k, v = gather_blocks(k_pool, v_pool, tables)
    # Norm-aware: multiplying the gathered copy of a fused block by its member's n_K (n_V) is the same
    # arithmetic as scaling that block's logits (PV partial sum); the pool keeps one unit copy.
    if k_norm is not None:
        k = k * k_norm.to(k.dtype)[:, :, None, None, None]
    if v_norm is not None:
        v = v * v_norm.to(v.dtype)[:, :, None, None, None]
    if fused is not None:  # only the fused blocks of the fresh gathered copy are rescaled, in place
        bi, bj, nk, nv = fused
        k[bi, bj] *= nk.to(k.dtype)[:, None, None, None]
        v[bi, bj] *= nv.to(v.dtype)[:, None, None, None]
    if mask is None:
        mask = decode_mask(lengths, tables.shape[1] * k_pool.shape[1], sliding_window)
    return attend_blocks(q, k, v, mask, scale)


def replicate_rescaled(blocks: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``norms[i] * blocks[i]``: the rescaled replicated blocks that norm-aware attention stands for."""
    return blocks * norms.to(blocks.dtype).reshape(-1, *([1] * (blocks.dim() - 1)))
