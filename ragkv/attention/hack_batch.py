"""Batched HACK decode attention over paged 2/4/8-bit KV plus fp16 rows: one call for a whole batch.

The serving engine's decode path (CPU and any torch device; no per-sequence loop). Each query row
``b`` attends to three kinds of keys, selected by masks the caller builds:

* **page rows**: blocks ``table[b, :]`` of the pages (:mod:`ragkv.attention.hack_paged`'s layout):
  quantized K scored homomorphically (Eq. 4 with 8-bit Q), quantized V of sealed blocks multiplied
  homomorphically with 8-bit P, one P partition per block (HACK's Pi = block size);
* **open rows**: fp16 rows of the blocks not sealed yet (the newest block(s) of each sequence: the
  recent window and the V tail), K used where ``open_k`` says so, V always;
* **sink rows**: the first tokens kept in fp16 (attention sinks).

K smoothing: page K is stored as ``(k - shift) / q_mul`` and scored against ``q * q_mul``; the
constant ``q . shift`` is added back, so every score is the true ``q . k`` (fp16 rows are raw) and
fusion norms may multiply scores per block. Fusion norms: ``k_norm[b, j]`` multiplies the scores of
block ``j``'s keys, ``v_norm[b, j]`` its P partition (BFF's norm-aware attention, digest A.2.4).

Same arithmetic as :func:`ragkv.attention.hack_ref.hack_attention` on one sequence's view, up to
float summation order (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ragkv.attention.hack_paged import PagedLayout, PageViews, page_views
from ragkv.attention.hack_quant import packed_width, unpack_codes_float
from ragkv.attention.hack_ref import quantize_p, quantize_q


@dataclass
class HackDecodeBatch:
    """Inputs of :func:`hack_decode` for ``B`` query rows (shapes in the comments)."""

    table: Tensor  # long [B, NB]: page ids of blocks 0..NB-1 (padding: any valid page)
    page_mask: Tensor  # bool [B, NB * bs]: page rows whose quantized K is attended
    sealed: Tensor  # bool [B, NB]: blocks whose V is quantized in the page
    open_k: Tensor  # fp16 [B, NO, bs, H, D]: rows of open blocks (K)
    open_v: Tensor  # fp16 [B, NO, bs, H, D]: rows of open blocks (V)
    open_block: Tensor  # long [B, NO]: table index of each open block (clamped to NB - 1)
    open_kmask: Tensor  # bool [B, NO * bs]: open rows attended with their fp16 K
    open_pmask: Tensor  # bool [B, NO * bs]: open rows whose K is in the page (score from page rows)
    sink_k: Tensor  # fp16 [B, S, H, D]
    sink_v: Tensor  # fp16 [B, S, H, D]
    sink_mask: Tensor  # bool [B, S]
    k_norm: Tensor | None = None  # fp32 [B, NB]
    v_norm: Tensor | None = None  # fp32 [B, NB]
    k_shift: Tensor | None = None  # fp32 [H, D]
    q_mul: Tensor | None = None  # fp32 [H, D]
    k_order: Tensor | None = None  # long [H, D]: page K channels in a KeyPlan's order (RoPE-aware bits)


def _gqa(x: Tensor, h: int) -> Tensor:
    """``[B, Hq, ...]`` -> ``[B, H, G, ...]`` (query head ``i`` on kv head ``i // G``)."""
    return x.view(x.shape[0], h, x.shape[1] // h, *x.shape[2:])


def _gather(pages: Tensor, lay: PagedLayout, table: Tensor) -> PageViews:
    """Field views ``[B, NB, ...]`` of the pages ``table [B, NB]`` (one gather of whole pages)."""
    b, nb = table.shape
    g = page_views(pages[table.reshape(-1)], lay)

    def split(x: Tensor) -> Tensor:
        return x.view(b, nb, *x.shape[1:]) if x.is_contiguous() else x.unflatten(0, (b, nb))

    return PageViews(*(split(getattr(g, f)) for f in PageViews.__dataclass_fields__))


def _codes(packed: Tensor, lay: PagedLayout) -> Tensor:
    """Gathered packed rows ``[B, NB, bs, H, PW]`` -> fp32 codes ``[B, H, NB * bs, D]`` (bytes moved first)."""
    b, nb, bs, h, pw = packed.shape
    return unpack_codes_float(
        packed.permute(0, 3, 1, 2, 4).reshape(b, h, nb * bs, pw), lay.bits, lay.head_dim
    )


def _key_dots(qc: Tensor, packed: Tensor, lay: PagedLayout) -> Tensor:
    """Integer products ``Q' K'^T`` per K partition: Q codes ``[B, H, G, nkp, Pk]`` with the gathered
    packed K rows ``[B, NB, bs, H, KPW]`` -> ``[B, H, G, nkp, NB * bs]``. Each partition's codes (its
    own width) are unpacked and multiplied on their own, so only the small products are stacked."""
    b, nb, bs, h, pw = packed.shape
    rows = packed.permute(0, 3, 1, 2, 4).reshape(b, h, nb * bs, pw)
    pk, dots, at = lay.k_partition, [], 0
    for i, w in enumerate(lay.key_bits):
        n = packed_width(pk, w)
        kc = unpack_codes_float(rows[..., at : at + n], w, pk)  # [B, H, T, Pk]
        dots.append(torch.matmul(qc[:, :, :, i], kc.transpose(-1, -2)))  # [B, H, G, T]
        at += n
    return torch.stack(dots, 3)


def _page_scores(
    q: Tensor, views: PageViews, lay: PagedLayout, batch: HackDecodeBatch, qp_bits: int
) -> Tensor:
    """True ``q . k`` of every page row ``[B, H, G, NB * bs]`` (homomorphic, 8-bit Q)."""
    b, hq, d = q.shape
    h, pk, nkp = lay.num_kv_heads, lay.k_partition, lay.num_k_parts
    g = hq // h
    tab = batch.table
    t = tab.shape[1] * lay.block_size
    qs = q.float()
    if batch.q_mul is not None:
        qs = (_gqa(qs, h) * batch.q_mul[None, :, None, :]).view(b, hq, d)
    if batch.k_order is not None:  # Q's channels in the page keys' order
        qs = _gqa(qs, h).gather(-1, batch.k_order[None, :, None, :].expand(b, h, g, d)).reshape(b, hq, d)
    qq = quantize_q(qs, pk, qp_bits)  # codes [B, Hq, nkp, pk], scale/min [B, Hq, nkp]
    qc = _gqa(qq.codes.float(), h)  # [B, H, G, nkp, pk]
    dot = _key_dots(qc, views.k_packed, lay)  # [B, H, G, nkp, T]

    def k_meta(x: Tensor) -> Tensor:  # [B, NB, bs, H, nkp] -> [B, H, 1, nkp, T]
        return x.float().reshape(b, t, h, nkp).permute(0, 2, 3, 1).unsqueeze(2)

    ks, km, ksum = k_meta(views.k_scale), k_meta(views.k_min), k_meta(views.k_sum)
    qs_, qm = _gqa(qq.scale.float(), h).unsqueeze(-1), _gqa(qq.minv.float(), h).unsqueeze(-1)
    rq = qc.sum(-1, keepdim=True)
    s = (qs_ * (ks * dot + km * rq) + qm * (ks * ksum + pk * km)).sum(3)  # [B, H, G, T]
    if batch.k_shift is not None:
        s = s + torch.einsum("bhgd,hd->bhg", _gqa(q.float(), h), batch.k_shift).unsqueeze(-1)
    if batch.k_norm is not None:
        s = s * batch.k_norm.repeat_interleave(lay.block_size, 1)[:, None, None, :]
    return s


def _fp16_scores(q: Tensor, k: Tensor, h: int) -> Tensor:
    """``q [B, Hq, D] . k [B, T, H, D]`` -> ``[B, H, G, T]`` in fp32."""
    return torch.einsum("bhgd,bthd->bhgt", _gqa(q.float(), h), k.float())


def _page_pv(p: Tensor, views: PageViews, lay: PagedLayout, batch: HackDecodeBatch, qp_bits: int) -> Tensor:
    """``P' V'`` over the sealed page blocks (homomorphic, 8-bit P per block): ``[B, H, G, D]``."""
    b, h, g, t = p.shape
    bs, d = lay.block_size, lay.head_dim
    tab = batch.table
    nb = tab.shape[1]
    p = p.view(b, h, g, nb, bs) * batch.sealed[:, None, None, :, None]
    if batch.v_norm is not None:
        p = p * batch.v_norm[:, None, None, :, None]
    pq = quantize_p(p.reshape(b, h * g, t), bs, qp_bits)  # codes [B, Hq, NB, bs], scale/min [B, Hq, NB]
    pc = _gqa(pq.codes.float(), h).transpose(2, 3)  # [B, H, NB, G, bs]
    vc = _codes(views.v_packed, lay).view(b, h, nb, bs, d)
    dot = torch.matmul(pc, vc)  # [B, H, NB, G, D]: integer products per block

    def v_meta(x: Tensor) -> Tensor:  # [B, NB, H, D] -> [B, H, NB, 1, D]
        return x.float().permute(0, 2, 1, 3).unsqueeze(3)

    vs, vm, vsum = v_meta(views.v_scale), v_meta(views.v_min), v_meta(views.v_sum)
    ps = _gqa(pq.scale.float(), h).transpose(2, 3).unsqueeze(-1)  # [B, H, NB, G, 1]
    pm = _gqa(pq.minv.float(), h).transpose(2, 3).unsqueeze(-1)
    rp = pc.sum(-1, keepdim=True)
    return (ps * (vs * dot + vm * rp) + pm * (vs * vsum + bs * vm)).sum(2)


def hack_decode(
    q: Tensor, pages: Tensor, lay: PagedLayout, batch: HackDecodeBatch, scale: float, qp_bits: int = 8
) -> Tensor:
    """HACK attention of one query row per batch entry ``q [B, Hq, D]`` (post-RoPE); fp32 ``[B, Hq, D]``.

    ``pages``: a layer cache in :class:`PagedLayout` (uint8 ``[num_blocks, Hkv, bs, token_bytes]``).
    A row that sees no key gets a zero output (as the reference).
    """
    views = _gather(pages, lay, batch.table) if batch.table.shape[1] else None
    b, hq, d = q.shape
    h, bs = lay.num_kv_heads, lay.block_size
    no = batch.open_block.shape[1]
    parts, masks = [], []
    if batch.table.shape[1]:
        parts.append(_page_scores(q, views, lay, batch, qp_bits))
        masks.append(batch.page_mask)
    if no:
        parts.append(_fp16_scores(q, batch.open_k.reshape(b, no * bs, h, d), h))
        masks.append(batch.open_kmask)
    if batch.sink_k.shape[1]:
        parts.append(_fp16_scores(q, batch.sink_k, h))
        masks.append(batch.sink_mask)
    s = torch.cat(parts, -1) * scale
    mask = torch.cat(masks, -1)[:, None, None, :]
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, float("-inf")), -1), nan=0.0)
    out = torch.zeros(b, h, hq // h, d, dtype=torch.float32, device=q.device)
    at = 0
    if batch.table.shape[1]:
        t = batch.table.shape[1] * bs
        pp = p[..., :t]
        out += _page_pv(pp, views, lay, batch, qp_bits)
        at = t
        if no:  # open rows whose K is quantized: their P sits at the page rows of their block
            idx = batch.open_block[:, None, None, :, None].expand(b, h, hq // h, no, bs)
            p_open_q = pp.reshape(b, h, hq // h, -1, bs).gather(3, idx).reshape(b, h, hq // h, no * bs)
            p_open_q = p_open_q * batch.open_pmask[:, None, None, :]
    if no:
        p_open = p[..., at : at + no * bs]
        if batch.table.shape[1]:
            p_open = p_open + p_open_q
        out += torch.einsum("bhgt,bthd->bhgd", p_open, batch.open_v.reshape(b, no * bs, h, d).float())
        at += no * bs
    if batch.sink_k.shape[1]:
        out += torch.einsum("bhgt,bthd->bhgd", p[..., at:], batch.sink_v.float())
    return out.reshape(b, hq, d)
