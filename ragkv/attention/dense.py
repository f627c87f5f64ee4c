"""Dense (fp16/bf16/fp32) attention of a set of query rows over keys at explicit positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def layer_windows(sliding_window, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from one window for every layer (int or None) or a per-layer sequence."""
    if sliding_window is None or isinstance(sliding_window, int):
        return (sliding_window,) * num_layers
    out = tuple(None if w is None else int(w) for w in sliding_window)
    if len(out) != num_layers:
        raise ValueError(f"{len(out)} sliding windows for {num_layers} layers")
    return out


def position_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean ``[n_q, n_k]`` mask: key allowed iff ``k_pos <= q_pos`` (and inside the window)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    scale: float,
    causal_contiguous: bool = False,
    sliding_window: int | None = None,
    position_blocks: int = 0,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q [n, Hq, D]`` over ``k, v [N, Hkv, D]`` -> ``[n, Hq, D]``; GQA by head groups.

    Selected query rows are scattered, so the mask is built from explicit positions rather than a
    lower-triangular shape (the reference CacheBlend code's bottom-right mask is only approximate
    for scattered rows). ``causal_contiguous`` is the fast path when q and k are the same
    contiguous run of positions (ordinary prefill).

    ``position_blocks > 1`` is for prefill, where key ``j`` sits at position ``j``: the (sorted)
    query rows are split into that many groups and each group attends only to the keys up to its
    last position, so scattered HKVD rows skip most of the masked-out half of the causal square.

    ``segments = (q_seg, k_seg)``: several sequences packed in one pass, each sharing segment 0 (a
    common head): a query sees a key of its own segment or of segment 0 (and the causal rule by position).
    """
    n_q = q.shape[0]
    if segments is not None:
        q_seg, k_seg = segments
        mask = position_mask(q_pos, k_pos, sliding_window)
        mask &= (k_seg[None, :] == 0) | (k_seg[None, :] == q_seg[:, None])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)
    if position_blocks > 1 and not causal_contiguous and sliding_window is None and n_q:
        first, n_k = int(q_pos[0]), k.shape[0]
        if int(q_pos[-1]) == n_k - 1 and n_k - first == n_q and 3 * first <= n_k:
            # The queries are the prompt's tail after a cached head (prefix caching). The causal
            # kernel over the whole square, with zero queries standing in for the head's rows, beats
            # the masked kernel while the head is under ~1/3 of the prompt (6K tokens, SmolLM2
            # shapes, one thread: 0.65 s vs 0.89 s with a 50-token head; 0.62 vs 0.55 at 1/2).
            qp = torch.cat([q.new_zeros(first, *q.shape[1:]), q])
            return attention(qp, k, v, None, None, scale, causal_contiguous=True)[first:]
    if position_blocks > 1 and not causal_contiguous and n_q >= 2 * position_blocks:
        groups = torch.arange(n_q, device=q.device).tensor_split(position_blocks)
        stops = [int(q_pos[idx[-1]]) + 1 for idx in groups]
        # Split only where it skips a real share of the keys. Queries bunched near the end (a question
        # pass's suffix rows) would pay each block's tiles over nearly every key: measured 1.5-2x slower
        # for 60 tail rows of 6K keys in 4 blocks, while uniformly scattered rows skip ~3/8 of them.
        if sum(len(idx) * stop for idx, stop in zip(groups, stops, strict=True)) <= 0.75 * n_q * k.shape[0]:
            return torch.cat(
                [
                    attention(
                        q[idx],
                        k[:stop],
                        v[:stop],
                        q_pos[idx],
                        k_pos[:stop],
                        scale,
                        sliding_window=sliding_window,
                    )
                    for idx, stop in zip(groups, stops, strict=True)
                ]
            )
    if causal_contiguous and sliding_window is None:
        # a whole causal square (full prefill, chunk KV, a blend that recomputes every row): the
        # split-invariant kernel, so that it equals an exact pass after any cached prefix bit for bit
        from ragkv.attention.exact import exact_attention

        return exact_attention(q, k, v, 0, scale)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    mask = position_mask(q_pos, k_pos, sliding_window)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Explicit attention probabilities ``[n, Hq, N]`` (fp32), for fidelity metrics only."""
    n, hq, _ = q.shape
    z = _grouped_logits(q, k, scale)
    z.masked_fill_(~position_mask(q_pos, k_pos, sliding_window), float("-inf"))
    return torch.softmax(z, dim=-1).permute(2, 0, 1, 3).reshape(n, hq, k.shape[0])


def _grouped_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 logits ``[Hkv, G, n, N]`` of ``q [n, Hq, D]`` over ``k [N, Hkv, D]``, query heads grouped by
    their KV head (no GQA copy of K)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    return torch.einsum("nkgd,mkd->kgnm", q.float().reshape(n, hkv, hq // hkv, d), k.float()).mul_(scale)


@dataclass(frozen=True)
class ContextTemper:
    """APE's temperature ``T`` and scale ``S`` on the attention that query-side rows pay to context rows.

    ``context [N]`` marks the key positions of reused chunks (position ``i`` -> ``context[i]``; later
    positions are not context). For a query row, the context block's logits are divided by ``T`` inside
    the block and the block's total weight becomes ``S * (sum_j exp(z_j / T)) ** T`` against the other
    keys (APE, arXiv 2502.05431, section 3): per key ``z_j' = z_j / T + log S + (T - 1) * LSE(z_C / T)``.
    ``T = S = 1`` is plain attention.
    """

    temperature: float
    scale: float
    context: torch.Tensor  # bool [n_positions]

    def __post_init__(self):
        if not 0.0 < self.temperature <= 2.0 or self.scale <= 0.0:
            raise ValueError("APE temperature must be in (0, 2] and its scale > 0")

    def context_keys(self, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool ``[N]``: which keys (by position) are context rows."""
        ctx = self.context.to(k_pos.device)
        inside = k_pos < ctx.numel()
        return inside & ctx[k_pos.clamp(max=max(ctx.numel() - 1, 0))]


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    temper: ContextTemper | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` of a few query-side rows, explicitly in fp32, and the mass ``[N]`` they put on
    each key; with ``temper``, APE's :class:`ContextTemper` on the context keys.

    For rows whose scores are needed or changed (a question pass's rows, APE's question and decode
    rows): one pass of logits and softmax gives both the output and the mass, where a fused kernel
    plus explicit probabilities paid twice (measured, 60 rows over 6K keys, one thread: ~25 ms instead
    of ~47 ms a layer). Heads stay grouped by KV head (no GQA copy of K/V); without a window or a
    temper, the mask touches only keys at or after the first query's position.
    """
    n, hq, d = q.shape
    z = _grouped_logits(q, k, scale)
    if temper is not None:
        allowed = position_mask(q_pos, k_pos, sliding_window)  # [n, N]
        ctx = temper.context_keys(k_pos)[None, :] & allowed
        zc = (z / temper.temperature).masked_fill(~ctx, float("-inf"))
        # a query with no context key: its LSE is -inf; clamped so that masked entries stay -inf (not NaN)
        lse = torch.logsumexp(zc, dim=-1, keepdim=True).clamp(min=-1e30)
        adjusted = zc + math.log(temper.scale) + (temper.temperature - 1.0) * lse
        z = torch.where(ctx, adjusted, z.masked_fill(~allowed, float("-inf")))
    elif n:
        c0 = 0  # keys before c0 are visible to every query: keys sorted by position, no window
        if sliding_window is None and bool((k_pos[1:] >= k_pos[:-1]).all()):
            c0 = int(torch.searchsorted(k_pos, q_pos.min() + 1))
        z[..., c0:].masked_fill_(~position_mask(q_pos, k_pos[c0:], sliding_window), float("-inf"))
    probs = torch.softmax(z, dim=-1)  # [Hkv, G, n, N]
    out = torch.einsum("kgnm,mkd->nkgd", probs, v.float()).reshape(n, hq, d).to(q.dtype)
    return out, probs.sum(dim=(0, 1, 2))
