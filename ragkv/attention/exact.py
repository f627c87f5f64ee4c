"""Split-invariant causal attention: a row's result depends on its position and the keys up to it, never
on which other rows share the pass.

Why: exact prefix reuse must give full prefill's logits bit for bit (vLLM's batch-invariant mode, SGLang's
deterministic mode; docs/EXACT_REUSE.md). A fused causal kernel over the whole square blocks its rows and
keys by the *sequence length* (PyTorch's CPU flash kernel: query blocks of 32/64/256 rows by query
length, key blocks of up to 512 by key length), so the same row computed in a 3,700-token pass and in a
300-token tail pass after a cached head is summed in another order, and a greedy near-tie can flip.

Here the keys of a row at position ``p`` in tile ``t = p // tile`` are reduced in two calls whose shapes
depend on ``t`` alone:

1. the whole tiles before it, keys ``[0, t * tile)``, no mask (the kernel's own key blocks are then a
   function of ``t`` too);
2. its own tile as a causal square: all ``tile`` keys, and the query rows from the tile's start to this
   pass's last row (rows not computed in this pass are zero queries whose outputs are dropped; keys past
   the prompt are zero and masked by causality).

The two partial results are merged by their log-sum-exp, elementwise. What remains shape-dependent is the
number of query rows in a kernel call (the GEMM's M): the query heads of a KV head are stacked as rows
and padded to a multiple of :data:`QUERY_ROW_MULTIPLE`, where this CPU's GEMMs are row-invariant
(measured; the model's self-check, :func:`ragkv.blend.exact.exactness_check`, verifies it per machine).
"""

from __future__ import annotations

import torch

#: keys per tile (a row's reduction order is fixed by its tile); 128 keeps the diagonal square's
#: wasted work small for short tail passes and the number of kernel calls low for long prompts
TILE = 128
#: rows of the elementwise merge are padded to a multiple of this (a vectorized exp's scalar tail)
ROW_MULTIPLE = 32
#: stacked query rows of the kernel call over whole tiles are padded to a multiple of this: GEMMs whose
#: row count is not a multiple of 8 sum in another order on this CPU (1-3, 5-7, 9-11 rows measured);
#: 16 keeps a margin (8 also held in the split-invariance test over every tail of 1-40 rows)
QUERY_ROW_MULTIPLE = 16
#: the causal square's query rows are cut after this pass's last row, to a multiple of this (held in the
#: split-invariance tests over every head and tail of 1-139 rows, like QUERY_ROW_MULTIPLE)
SQUARE_ROW_MULTIPLE = 16

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [n, ...]`` with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _flash_lse(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``q [1, H, n, D]`` over ``k, v [1, H, N, D]`` (PyTorch's CPU flash kernel)."""
    out, lse = _flash(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float, tile: int = TILE
) -> torch.Tensor:
    """Causal attention of ``q [n, Hq, D]`` (rows at positions ``first .. first+n-1``) over post-RoPE
    ``k, v [first+n (or more), Hkv, D]`` at positions ``0 ..``; ``[n, Hq, D]``, split-invariant (module doc).

    Keys after ``first + n - 1`` are ignored (a caller may pass a longer buffer).
    """
    n, hq, d = q.shape
    if n == 0:
        return q.new_zeros(0, hq, d)
    hkv = k.shape[1]
    g = hq // hkv
    end = first + n
    k, v = k[:end], v[:end]
    out = torch.empty(n, hq, d, dtype=torch.float32, device=q.device)
    for t in range(first // tile, (end - 1) // tile + 1):
        t0, t1 = t * tile, (t + 1) * tile
        lo, hi = max(first, t0), min(end, t1)  # this pass's rows in tile t
        rows = q[lo - first : hi - first]  # [r, Hq, D]
        r = hi - lo
        # 2. the tile's own keys, causally: the square's first rows up to this pass's last one, padded
        # to whole query blocks (the kernel blocks queries by 32 from the tile's start and the keys,
        # always the whole tile, in one block: a row's sums do not depend on the rows below it)
        rq = min(tile, -(-(hi - t0) // SQUARE_ROW_MULTIPLE) * SQUARE_ROW_MULTIPLE)
        sq = rows.new_zeros(rq, hq, d)
        sq[lo - t0 : hi - t0] = rows
        kt = _pad_rows(k[t0:hi], tile)
        vt = _pad_rows(v[t0:hi], tile)
        o2, lse2 = _flash_lse(
            sq.transpose(0, 1)[None],
            kt.repeat_interleave(g, dim=1).transpose(0, 1)[None],
            vt.repeat_interleave(g, dim=1).transpose(0, 1)[None],
            scale,
            causal=True,
        )
        o2 = o2[0, :, lo - t0 : hi - t0].transpose(0, 1).float()  # [r, Hq, D]
        if t == 0:
            out[lo - first : hi - first] = o2
            continue
        # 1. every whole tile before: each KV head's query heads stacked row-wise (no copy of K/V), the
        # stacked rows padded to a multiple of QUERY_ROW_MULTIPLE (the GEMM's M), not each head's rows
        rp = -(-r // ROW_MULTIPLE) * ROW_MULTIPLE
        gr = g * r
        qg = rows.reshape(r, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, gr, d)
        qg = (
            _pad_rows(qg.transpose(0, 1), -(-gr // QUERY_ROW_MULTIPLE) * QUERY_ROW_MULTIPLE)
            .transpose(0, 1)
            .contiguous()
        )
        o1, lse1 = _flash_lse(
            qg[None], k[:t0].transpose(0, 1)[None], v[:t0].transpose(0, 1)[None], scale, False
        )
        o1 = o1[0, :, :gr].reshape(hkv, g, r, d).permute(2, 0, 1, 3).reshape(r, hq, d).float()
        lse1 = _pad_rows(lse1[0, :, :gr].reshape(hkv, g, r).permute(2, 0, 1).reshape(r, hq), rp)
        # the merge runs on rows padded to a multiple of ROW_MULTIPLE: a vectorized exp's scalar tail
        # would otherwise fall on other rows in another pass (and give other bits)
        lse2 = _pad_rows(lse2[0, :, lo - t0 : hi - t0].transpose(0, 1), rp)  # [rp, Hq]
        lse = torch.logaddexp(lse1, lse2)
        w1 = torch.exp(lse1 - lse)[:r, :, None]
        w2 = torch.exp(lse2 - lse)[:r, :, None]
        out[lo - first : hi - first] = w1 * o1 + w2 * o2
    return out.to(q.dtype)
