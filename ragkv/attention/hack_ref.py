"""PyTorch reference of HACK homomorphic attention (Eq. 4) on quantized K/V: the CPU path and the oracle.

S = Q'K'^T and O = P'V' are computed from integer codes plus the three per-partition corrections
(Eq. 4 of HACK, reconstructed in the digest part B.2.3)::

    C_ik = sum_p [ sA sB * sum_j a'_ij b'_jk + sA mB * sum_j a'_ij + mA sB * sum_j b'_jk + P * mA mB ]

The integer products are exact: ``backend="float"`` multiplies small non-negative integers in fp32
(every partial sum is an integer below 128 * 255 * 255 < 2^24, so fp32 represents it exactly, whatever
the summation order), ``backend="int"`` multiplies in int64. The column sums of K'/V' come from the
cache (summation elimination); V rows of the newest, incomplete partition stay fp16 (requantization
elimination) and, like the fp16 sink / recent-window rows, multiply unquantized P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ragkv.attention.hack_quant import HackError, Quantized, quantize, unpack_codes, unpack_parts

BACKENDS = ("float", "int")
#: the attention functions' reference backend: Q', K', P', V' dequantized to fp32 and multiplied
ORACLE = "dequant"


@dataclass
class HackLayerView:
    """The live quantized KV of one layer of one sequence.

    Quantized-K rows ``[Tq]``: the first ``nvp * v_part`` of them have their V in quantized partitions,
    the remaining ``Tq - nvp * v_part`` have V in the fp16 ``v_tail`` (same row order). Dense rows
    (attention sinks and the recent window) keep both K and V in fp16. K smoothing: quantized K rows
    are stored as ``(k - k_shift) / q_mul`` and scored against ``q * q_mul``; dense rows are stored raw
    and scored as ``q . (k - k_shift)``, so every score carries the same per-query shift (softmax-invariant).
    """

    bits: int
    k_part: int
    v_part: int
    head_dim: int
    k_packed: Tensor  # uint8 [Tq, Hkv, packed_width(D)]
    k_scale: Tensor  # fp16 [Tq, Hkv, D / k_part]
    k_min: Tensor  # fp16 [Tq, Hkv, D / k_part]
    k_sum: Tensor  # uint8 / int16 [Tq, Hkv, D / k_part]
    k_pos: Tensor  # long [Tq]
    v_packed: Tensor  # uint8 [nvp * v_part, Hkv, packed_width(D)]
    v_scale: Tensor  # fp16 [nvp, Hkv, D]
    v_min: Tensor  # fp16 [nvp, Hkv, D]
    v_sum: Tensor  # uint8 / int16 [nvp, Hkv, D]
    v_tail: Tensor  # fp16 [Tq - nvp * v_part, Hkv, D]
    dense_k: Tensor  # fp16 [Td, Hkv, D]
    dense_v: Tensor  # fp16 [Td, Hkv, D]
    dense_pos: Tensor  # long [Td]
    k_shift: Tensor | None = None  # fp32 [Hkv, D] or None
    q_mul: Tensor | None = None  # fp32 [Hkv, D] or None
    #: RoPE-aware keys (:class:`~ragkv.attention.hack_quant.KeyPlan`): code bits per K partition
    #: of the channels reordered by ``k_order`` [Hkv, D]; None: ``bits`` everywhere, model order
    k_bits: tuple[int, ...] | None = None
    k_order: Tensor | None = None

    @property
    def key_bits(self) -> tuple[int, ...]:
        """Code bits of each K partition."""
        return self.k_bits or (self.bits,) * (self.head_dim // self.k_part)

    @property
    def uniform_keys(self) -> bool:
        """K codes are ``bits`` wide in the model's channel order (the paper's layout)."""
        return self.k_order is None and set(self.key_bits) == {self.bits}

    @property
    def num_kv_heads(self) -> int:
        return self.k_packed.shape[1] if self.k_packed.numel() else self.dense_k.shape[1]

    @property
    def num_quant_k(self) -> int:
        return int(self.k_pos.numel())

    @property
    def num_v_parts(self) -> int:
        return int(self.v_scale.shape[0])

    def k_codes(self) -> Tensor:
        """Unpacked K codes ``[Tq, Hkv, D]`` (uint8), channels in the stored (``k_order``) order."""
        return unpack_parts(self.k_packed, self.key_bits, self.k_part)

    def v_codes(self) -> Tensor:
        """Unpacked V codes ``[nvp * v_part, Hkv, D]`` (uint8)."""
        return unpack_codes(self.v_packed, self.bits, self.head_dim)

    def dequant_k(self) -> Tensor:
        """fp32 K of the quantized rows, ``scale * code + min`` (for the oracle and error measures)."""
        t, h, d = self.k_packed.shape[0], self.k_packed.shape[1], self.head_dim
        q = Quantized(self.k_codes().view(t, h, d // self.k_part, self.k_part), self.k_scale, self.k_min)
        return q.dequantize().view(t, h, d)

    def dequant_v(self) -> Tensor:
        """fp32 V of the quantized partitions ``[nvp * v_part, Hkv, D]``."""
        n, p = self.num_v_parts, self.v_part
        h, d = self.v_scale.shape[1], self.head_dim
        codes = self.v_codes().view(n, p, h, d).permute(0, 2, 3, 1)  # [N, H, D, P]
        x = Quantized(codes, self.v_scale, self.v_min).dequantize()
        return x.permute(0, 3, 1, 2).reshape(n * p, h, d)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise HackError(f"unknown backend {backend!r}; use one of {BACKENDS}")


def _int_matmul(a: Tensor, b: Tensor, backend: str) -> Tensor:
    """Exact product of integer-valued code tensors, returned as fp64 for the corrections."""
    if backend == "int":
        return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(torch.float64)
    if a.is_cuda:  # CUDA matmul may run fp32 as TF32 (inexact on integers); fp64 is exact regardless
        return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.float32)
    return torch.matmul(a.to(torch.float32), b.to(torch.float32))


def quantize_q(q: Tensor, k_part: int, bits: int = 8) -> Quantized:
    """8-bit transient quantization of Q ``[n, Hq, D]`` per row along head_dim -> codes [n, Hq, D/Pk, Pk]."""
    n, hq, d = q.shape
    return quantize(q.float().reshape(n, hq, d // k_part, k_part), bits, fp16_meta=False)


def quantize_p(p: Tensor, v_part: int, bits: int = 8) -> Quantized:
    """8-bit transient quantization of softmax rows ``[n, Hq, N*Pv]`` per partition of Pv keys."""
    n, hq, t = p.shape
    return quantize(p.reshape(n, hq, t // v_part, v_part), bits, fp16_meta=False)


def _eq4(
    aq: Quantized, b_codes: Tensor, b_meta: tuple[Tensor, ...], meta_dims: tuple[int, ...], backend: str
) -> Tensor:
    """Eq. (4) for transient codes ``aq`` (Q' or P': ``[n, Hq, nP, P]``, a scale and min per row and
    partition) times cache codes ``b_codes [Hkv, nP, P, X]``, whose meta ``b_meta`` (scale, min, column
    sums) ``meta_dims`` permutes to ``[Hkv, nP, X]``: ``[n, Hq, X]`` (fp32), GQA by head groups."""
    _check_backend(backend)
    n, hq, nparts, part = aq.codes.shape
    hkv, x = b_codes.shape[0], b_codes.shape[-1]
    g = hq // hkv
    dt = torch.float64 if backend == "int" else torch.float32
    ac = aq.codes.view(n, hkv, g, nparts, part).permute(1, 3, 0, 2, 4).reshape(hkv, nparts, n * g, part)
    dot = _int_matmul(ac, b_codes, backend).to(dt)  # integer term, exact
    ra = ac.to(dt).sum(-1, keepdim=True)  # row sums of the transient codes, on the fly

    def a_meta(t: Tensor) -> Tensor:
        return t.to(dt).view(n, hkv, g, nparts).permute(1, 3, 0, 2).reshape(hkv, nparts, n * g, 1)

    a_s, a_m = a_meta(aq.scale), a_meta(aq.minv)
    b_s, b_m, b_sum = (t.to(dt).permute(*meta_dims).unsqueeze(2) for t in b_meta)
    out = (a_s * b_s * dot + a_s * b_m * ra + a_m * b_s * b_sum + part * a_m * b_m).sum(1)  # [Hkv, nG, X]
    return out.view(hkv, n, g, x).permute(1, 0, 2, 3).reshape(n, hq, x).float()


def homomorphic_scores(qq: Quantized, view: HackLayerView, backend: str = "float") -> Tensor:
    """S = Q'K'^T over the quantized-K rows by Eq. (4): ``[n, Hq, Tq]`` (fp32), GQA by head groups."""
    nkp, pk = qq.codes.shape[2:]
    kc = view.k_codes().view(view.num_quant_k, view.k_scale.shape[1], nkp, pk).permute(1, 2, 3, 0)
    return _eq4(qq, kc, (view.k_scale, view.k_min, view.k_sum), (1, 2, 0), backend)  # K meta [Tq, Hkv, nKp]


def homomorphic_pv(pq: Quantized, view: HackLayerView, backend: str = "float") -> Tensor:
    """O = P'V' over the quantized V partitions by Eq. (4): ``[n, Hq, D]`` (fp32)."""
    nvp, pv = pq.codes.shape[2:]
    vc = view.v_codes().view(nvp, pv, view.v_scale.shape[1], view.head_dim).permute(2, 0, 1, 3)
    return _eq4(pq, vc, (view.v_scale, view.v_min, view.v_sum), (1, 0, 2), backend)  # V meta [nvp, Hkv, D]


def _gqa_scores(q: Tensor, k: Tensor) -> Tensor:
    """fp32 ``q [n, Hq, D] . k [T, Hkv, D]`` -> ``[n, Hq, T]`` with query head h on kv head h // G."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("nhgd,thd->nhgt", q.float().view(n, hkv, hq // hkv, d), k.float())
    return s.reshape(n, hq, -1)


def _gqa_pv(p: Tensor, v: Tensor) -> Tensor:
    """fp32 ``p [n, Hq, T] . v [T, Hkv, D]`` -> ``[n, Hq, D]``."""
    n, hq, t = p.shape
    hkv, d = v.shape[1], v.shape[2]
    o = torch.einsum("nhgt,thd->nhgd", p.float().view(n, hkv, hq // hkv, t), v.float())
    return o.reshape(n, hq, d)


def _mask(q_pos: Tensor, k_pos: Tensor, sliding_window: int | None) -> Tensor:
    """``[n, T]`` keys visible to each query: ``k_pos <= q_pos`` (and inside the sliding window)."""
    m = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        m &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
    return m


def _smoothed_q(q: Tensor, view: HackLayerView) -> Tensor:
    """Q in the stored keys' basis: ``q * q_mul`` (K smoothing), channels reordered as the keys
    (``k_order``); identity without either."""
    if view.q_mul is None and view.k_order is None:
        return q.float()
    n, hq, d = q.shape
    hkv = view.num_kv_heads
    out = q.float().view(n, hkv, hq // hkv, d)
    if view.q_mul is not None:
        out = out * view.q_mul[None, :, None, :]
    if view.k_order is not None:
        out = out.gather(-1, view.k_order[None, :, None, :].expand_as(out))
    return out.reshape(n, hq, d)


@dataclass
class AttentionParts:
    """Intermediate results of one HACK attention call (exposed for tests and error analysis)."""

    scores: Tensor  # [n, Hq, Tq + Td] fp32, scaled, masked (-inf): quantized rows first, then dense
    probs: Tensor  # [n, Hq, Tq + Td] fp32 softmax
    out: Tensor  # [n, Hq, D] fp32


def _attend(
    view: HackLayerView,
    q: Tensor,
    q_pos: Tensor,
    scale: float,
    sliding_window: int | None,
    score_fn,
    pv_fn,
) -> AttentionParts:
    """Shared skeleton of the homomorphic and dequantized paths (they differ only in the two matmuls)."""
    n, hq, d = q.shape
    if hq % view.num_kv_heads != 0:
        raise HackError(f"query heads {hq} are not a multiple of kv heads {view.num_kv_heads}")
    tq = view.num_quant_k
    parts = []
    if tq:
        parts.append(score_fn(_smoothed_q(q, view)) * scale)
    if view.dense_pos.numel():
        dk = view.dense_k.float() if view.k_shift is None else view.dense_k.float() - view.k_shift
        parts.append(_gqa_scores(q, dk) * scale)
    if not parts:
        raise HackError("attend on a layer with no rows written")
    s = torch.cat(parts, dim=-1)
    mask = _mask(q_pos.to(view.k_pos.device), torch.cat([view.k_pos, view.dense_pos]), sliding_window)
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    # A query that sees no key (q_pos before every written row) gets a zero output instead of NaN.
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    nq_v = view.num_v_parts * view.v_part
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    if nq_v:
        out += pv_fn(p[..., :nq_v])
    if tq > nq_v:
        out += _gqa_pv(p[..., nq_v:tq], view.v_tail)  # RQE: newest V rows in fp16, unquantized P
    if view.dense_pos.numel():
        out += _gqa_pv(p[..., tq:], view.dense_v)
    return AttentionParts(s, p, out)


def _products(view: HackLayerView, qp_bits: int, backend: str):
    """:func:`_attend`'s two matmuls (scores, P·V) for ``backend``: homomorphic on the integer codes
    (:data:`BACKENDS`), or the oracle (:data:`ORACLE`) that dequantizes Q', K', P', V' to fp32 and
    multiplies; the same quantization either way."""
    if backend != ORACLE:
        return (
            lambda qs: homomorphic_scores(quantize_q(qs, view.k_part, qp_bits), view, backend),
            lambda p: homomorphic_pv(quantize_p(p, view.v_part, qp_bits), view, backend),
        )
    kd = view.dequant_k() if view.num_quant_k else None
    vd = view.dequant_v() if view.num_v_parts else None

    def scores(qs: Tensor) -> Tensor:
        n, hq, d = qs.shape
        qd = quantize_q(qs, view.k_part, qp_bits).dequantize().view(n, hq, d)
        return _gqa_scores(qd, kd)

    def pv(p: Tensor) -> Tensor:
        n, hq, t = p.shape
        pd = quantize_p(p, view.v_part, qp_bits).dequantize().view(n, hq, t)
        return _gqa_pv(pd, vd)

    return scores, pv


def hack_attention_parts(
    view: HackLayerView,
    q: Tensor,
    q_pos: Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    qp_bits: int = 8,
    backend: str = "float",
) -> AttentionParts:
    """Homomorphic attention of ``q [n, Hq, D]`` (post-RoPE) over ``view``; keys with pos > q_pos masked.

    ``backend``: one of :data:`BACKENDS`, or :data:`ORACLE` (dequantize and multiply), equal to the
    homomorphic backends up to float rounding (Eq. 4 is an algebraic identity).
    """
    return _attend(view, q, q_pos, scale, sliding_window, *_products(view, qp_bits, backend))


def hack_attention(view: HackLayerView, q: Tensor, q_pos: Tensor, scale: float, **options) -> Tensor:
    """HACK attention output ``[n, Hq, D]`` (fp32): :func:`hack_attention_parts`'s ``out`` (same options)."""
    return hack_attention_parts(view, q, q_pos, scale, **options).out
