"""Triton decode kernel for HACK homomorphic attention (CUDA), with the CPU reference as its oracle.

One query token per sequence, a batch of sequences of different lengths, K/V addressed through a
block table (paged; a contiguous cache is the identity table). A block is one V partition: ``Pi``
tokens. Per (sequence, kv head, split) program the kernel fuses, as HACK's ``attn_decode`` does:

* 8-bit quantization of the group's query rows (per K partition), re-centred to signed int8 with the
  shift folded into the min (``m_eff = m + 128 s``, digest B.2.7), so ``tl.dot`` runs on int8 codes;
* unpacking of the packed 2/4/8-bit K and V codes in registers (never in global memory);
* S = Q'K'^T by Eq. (4): an int8 x int8 -> int32 ``tl.dot`` per K partition plus the three corrections
  using the cached K code sums (summation elimination);
* online softmax (FlashAttention-2 style, fp32); each block's un-normalized probabilities are quantized
  to 8 bits per row (a block is exactly one V partition, so quantization commutes with the running
  rescale up to rounding) and O += P'V' by Eq. (4) with the cached V sums;
* the newest, incomplete V partition in fp16 (requantization elimination): a plain fp16 ``tl.dot``.

Split-K over blocks (flash-decoding) gives enough programs at batch 1; partial (acc, max, sum) are
merged in PyTorch together with the fp16 sink / recent-window rows of :class:`HackKVCache`.

Status: written against Triton's documented API and checked on CPU with ``TRITON_INTERPRET=1`` (the
interpreter, which does not type-check). Its one GPU run (an H100, 2026-11-27) failed to compile: one
name held the K and the V products, of two shapes. Fixed; not yet rerun on a GPU. The tests in
tests/unit/attention/test_hack.py run it on CUDA when a device exists. Importing this module never fails
without triton: every entry point raises :class:`HackError` instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ragkv.attention.hack_quant import HackError
from ragkv.attention.hack_ref import HackLayerView

try:  # triton is an optional dependency (extra "gpu"); the CPU reference is used without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

KERNEL_BITS = (2, 4, 8)  # byte-aligned code widths the kernel unpacks (3-bit uses the reference)
MIN_DOT = 32  # smallest inner dimension used with int8 tl.dot (conservative for int8 MMA)
LOG2E = 1.4426950408889634


def interpreter_mode() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): kernels run on CPU tensors."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runnable(device: torch.device | str) -> bool:
    """Whether the kernel can run on tensors of ``device`` (CUDA, or CPU under the interpreter)."""
    if not HAS_TRITON:
        return False
    dev = torch.device(device)
    return dev.type == "cuda" or (interpreter_mode() and dev.type == "cpu")


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def triton_supported(view: HackLayerView) -> bool:
    """Whether ``view``'s geometry is one the kernel handles (else the reference is used)."""
    d, pk, pi = view.head_dim, view.k_part, view.v_part
    return (
        HAS_TRITON
        and view.bits in KERNEL_BITS
        and view.uniform_keys  # RoPE-aware keys (mixed widths, reordered) use the reference
        and _pow2(d)
        and _pow2(pk)
        and _pow2(pi)
        and pk >= MIN_DOT
        and pi >= MIN_DOT
        and d <= 256
    )


if HAS_TRITON:

    @triton.jit
    def _unpack(ptr, rows, ch, stride_row, row_mask, BITS: tl.constexpr):
        """Load codes [R, D] of packed rows: code c of a row sits at bit BITS*c of its byte stream."""
        byte = (ch * BITS) // 8
        shift = ((ch * BITS) % 8).to(tl.uint8)
        raw = tl.load(ptr + rows[:, None] * stride_row + byte[None, :], mask=row_mask[:, None], other=0)
        return (raw >> shift[None, :]) & ((1 << BITS) - 1)

    @triton.jit
    def _col(x, cols, p):
        """Column ``p`` of a small 2-D tile ``x`` [R, C] as a vector [R]."""
        return tl.sum(tl.where(cols[None, :] == p, x, 0.0), axis=1)

    @triton.jit
    def _hack_decode_kernel(
        Q,
        QMUL,
        BT,
        TQ,
        KC,
        KS,
        KM,
        KSUM,
        VC,
        VS,
        VM,
        VSUM,
        VT,
        ACC,
        MAXS,
        SUMS,
        stride_qb,
        stride_qh,
        stride_mb,
        stride_mh,
        stride_btb,
        stride_kcb,
        stride_kct,
        stride_kch,
        stride_ksb,
        stride_kst,
        stride_ksh,
        stride_kub,
        stride_kut,
        stride_kuh,
        stride_vcb,
        stride_vct,
        stride_vch,
        stride_vsb,
        stride_vsh,
        stride_vub,
        stride_vuh,
        stride_vtb,
        stride_vtt,
        stride_vth,
        blocks_per_split,
        num_splits,
        qk_scale_log2,
        G: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        PK: tl.constexpr,
        NKP: tl.constexpr,
        NKP_PAD: tl.constexpr,
        PI: tl.constexpr,
        BITS: tl.constexpr,
        HAS_QMUL: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        num_kv = tl.num_programs(1)

        g = tl.arange(0, BLOCK_G)
        ch = tl.arange(0, D)
        tok = tl.arange(0, PI)
        pcols = tl.arange(0, NKP_PAD)
        g_ok = g < G

        # ---- 8-bit quantization of the group's query rows, per K partition (fused) ---------------------
        q = tl.load(
            Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + ch[None, :], mask=g_ok[:, None], other=0.0
        )
        q = q.to(tl.float32)
        if HAS_QMUL:
            q = q * tl.load(QMUL + b * stride_mb + h * stride_mh + ch).to(tl.float32)[None, :]
        part_of = ch // PK
        q_s2 = tl.zeros([BLOCK_G, NKP_PAD], dtype=tl.float32)
        q_m2 = tl.zeros([BLOCK_G, NKP_PAD], dtype=tl.float32)
        q_r2 = tl.zeros([BLOCK_G, NKP_PAD], dtype=tl.float32)
        qc = tl.zeros([BLOCK_G, D], dtype=tl.int32)
        for p in tl.static_range(NKP):
            inp = part_of[None, :] == p
            mn = tl.min(tl.where(inp, q, float("inf")), axis=1)
            mx = tl.max(tl.where(inp, q, float("-inf")), axis=1)
            s = (mx - mn) / 255.0
            safe = tl.where(s > 0, s, 1.0)
            code = tl.floor((q - mn[:, None]) / safe[:, None] + 0.5)
            code = tl.minimum(tl.maximum(code, 0.0), 255.0)
            code = tl.where(s[:, None] > 0, code, 0.0) - 128.0  # re-centred to int8 range
            qc = tl.where(inp, code.to(tl.int32), qc)
            rsum = tl.sum(tl.where(inp, code, 0.0), axis=1)
            sel = pcols[None, :] == p
            q_s2 = tl.where(sel, s[:, None], q_s2)
            q_m2 = tl.where(sel, (mn + 128.0 * s)[:, None], q_m2)  # m_eff = m + 128 s
            q_r2 = tl.where(sel, rsum[:, None], q_r2)
        qc8 = qc.to(tl.int8)

        # ---- this split's range of blocks ---------------------------------------------------------------
        tq = tl.load(TQ + b)
        n_blocks = tl.cdiv(tq, PI)
        nvp = tq // PI  # full V partitions; block nvp (if any) holds the fp16 V tail
        blk_lo = split * blocks_per_split
        blk_hi = tl.minimum(blk_lo + blocks_per_split, n_blocks)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)

        for j in range(blk_lo, blk_hi):
            phys = tl.load(BT + b * stride_btb + j).to(tl.int64)
            t_ok = (j * PI + tok) < tq
            # -- S = Q'K'^T by Eq. (4), per K partition -----------------------------------------------------
            kc = _unpack(KC + phys * stride_kcb + h * stride_kch, tok, ch, stride_kct, t_ok, BITS)
            if BITS == 8:
                kc8 = (kc.to(tl.int32) - 128).to(tl.int8)
            else:
                kc8 = kc.to(tl.int8)
            kc8_t = tl.trans(kc8)  # [D, PI]
            meta = phys * stride_ksb + tok * stride_kst + h * stride_ksh
            smeta = phys * stride_kub + tok * stride_kut + h * stride_kuh  # sums: own dtype, own strides
            sc = tl.zeros([BLOCK_G, PI], dtype=tl.float32)
            for p in tl.static_range(NKP):
                qcp = tl.where(part_of[None, :] == p, qc8, 0).to(tl.int8)
                # a name of its own: Triton types a name once per scope, and the V branch's product
                # below has another shape ([BLOCK_G, D], not [BLOCK_G, PI]): one name failed to compile
                qk = tl.dot(qcp, kc8_t, out_dtype=tl.int32).to(tl.float32)
                ks = tl.load(KS + meta + p, mask=t_ok, other=0.0).to(tl.float32)
                km = tl.load(KM + meta + p, mask=t_ok, other=0.0).to(tl.float32)
                ksum = tl.load(KSUM + smeta + p, mask=t_ok, other=0).to(tl.float32)
                if BITS == 8:  # K codes re-centred too: fold the shift into K's min and sum
                    km = km + 128.0 * ks
                    ksum = ksum - 128.0 * PK
                qs = _col(q_s2, pcols, p)
                qm = _col(q_m2, pcols, p)
                qr = _col(q_r2, pcols, p)
                sc += qs[:, None] * ks[None, :] * qk
                sc += qs[:, None] * km[None, :] * qr[:, None]
                sc += qm[:, None] * ks[None, :] * ksum[None, :]
                sc += PK * qm[:, None] * km[None, :]
            sc = sc * qk_scale_log2
            sc = tl.where(t_ok[None, :], sc, float("-inf"))
            # -- online softmax ---------------------------------------------------------------------------
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(sc - m_new[:, None])  # [BLOCK_G, PI], un-normalized
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None]
            m_i = m_new
            if j < nvp:
                # -- O += P'V' by Eq. (4) on a full V partition -------------------------------------------
                p_mn = tl.min(pr, axis=1)
                p_mx = tl.max(pr, axis=1)
                ps = (p_mx - p_mn) / 255.0
                psafe = tl.where(ps > 0, ps, 1.0)
                pcode = tl.floor((pr - p_mn[:, None]) / psafe[:, None] + 0.5)
                pcode = tl.minimum(tl.maximum(pcode, 0.0), 255.0)
                pcode = tl.where(ps[:, None] > 0, pcode, 0.0) - 128.0
                pr_sum = tl.sum(pcode, axis=1)
                pm = p_mn + 128.0 * ps
                vc = _unpack(VC + phys * stride_vcb + h * stride_vch, tok, ch, stride_vct, t_ok, BITS)
                if BITS == 8:
                    vc8 = (vc.to(tl.int32) - 128).to(tl.int8)
                else:
                    vc8 = vc.to(tl.int8)
                pv = tl.dot(pcode.to(tl.int8), vc8, out_dtype=tl.int32).to(tl.float32)  # [BLOCK_G, D]
                vmeta = phys * stride_vsb + h * stride_vsh + ch
                vs = tl.load(VS + vmeta).to(tl.float32)
                vm = tl.load(VM + vmeta).to(tl.float32)
                vsum = tl.load(VSUM + phys * stride_vub + h * stride_vuh + ch).to(tl.float32)
                if BITS == 8:
                    vm = vm + 128.0 * vs
                    vsum = vsum - 128.0 * PI
                acc += ps[:, None] * vs[None, :] * pv
                acc += ps[:, None] * vm[None, :] * pr_sum[:, None]
                acc += pm[:, None] * vs[None, :] * vsum[None, :]
                acc += PI * pm[:, None] * vm[None, :]
            else:
                # -- requantization elimination: the newest V rows stay fp16 ------------------------------
                vt = tl.load(
                    VT + b * stride_vtb + tok[:, None] * stride_vtt + h * stride_vth + ch[None, :],
                    mask=t_ok[:, None],
                    other=0.0,
                )
                acc += tl.dot(pr.to(tl.float16), vt.to(tl.float16), out_dtype=tl.float32)

        base = ((b * num_kv + h) * num_splits + split) * BLOCK_G
        tl.store(ACC + (base + g)[:, None] * D + ch[None, :], acc)
        tl.store(MAXS + base + g, m_i)
        tl.store(SUMS + base + g, l_i)


@dataclass
class HackBatch:
    """A batch of sequences' quantized KV for one layer, addressed by a block table (paged layout).

    Block ``j`` of sequence ``b`` holds tokens ``[j*Pi, (j+1)*Pi)`` of its quantized-K rows: K rows at
    ``k_*[block_table[b, j], t]`` and, for full partitions, V codes at ``v_packed[block_table[b, j], t]``
    with per-channel meta ``v_*[block_table[b, j]]``; the fp16 V tail of sequence b is ``v_tail[b]``.
    Dense fp16 rows (sinks/recent window) are padded per sequence (``dense_len``).
    """

    bits: int
    k_part: int
    v_part: int
    head_dim: int
    block_table: Tensor  # int32 [B, max_blocks]
    tq: Tensor  # int32 [B]: quantized-K rows per sequence
    k_packed: Tensor  # uint8 [NB, Pi, Hkv, PW] pool, or [T, Hkv, PW] contiguous rows (one sequence)
    k_scale: Tensor  # fp16 [NB, Pi, Hkv, nKp] (or [T, Hkv, nKp])
    k_min: Tensor
    k_sum: Tensor
    v_packed: Tensor  # uint8 [NB, Pi, Hkv, PW] (or [nvp * Pi, Hkv, PW])
    v_scale: Tensor  # fp16 [NB, Hkv, D]
    v_min: Tensor
    v_sum: Tensor
    v_tail: Tensor  # fp16 [B, Pi, Hkv, D]
    dense_k: Tensor  # fp16 [B, Tdmax, Hkv, D]
    dense_v: Tensor
    dense_len: Tensor  # long [B]
    k_shift: Tensor | None  # fp32 [B, Hkv, D]
    q_mul: Tensor | None  # fp32 [B, Hkv, D]

    @property
    def batch(self) -> int:
        return int(self.tq.numel())

    @property
    def num_kv_heads(self) -> int:
        return int(self.dense_k.shape[2])  # [B, Td, Hkv, D] in every layout


#: HackBatch's quantized K/V codes and their meta, named alike in HackLayerView and the paged pool's views
PACKED_TENSORS = ("k_packed", "k_scale", "k_min", "k_sum", "v_packed", "v_scale", "v_min", "v_sum")


def packed_tensors(src) -> dict[str, Tensor]:
    """``src``'s quantized K/V tensors by name (a layer view or page views), as HackBatch takes them."""
    return {name: getattr(src, name) for name in PACKED_TENSORS}


def _require_triton(device: torch.device) -> None:
    if not HAS_TRITON:
        raise HackError("the HACK Triton kernel needs the 'triton' package (extra 'gpu'); use the reference")
    if not triton_runnable(device):
        raise HackError(
            f"the HACK Triton kernel runs on CUDA tensors (or CPU with TRITON_INTERPRET=1), got {device}"
        )


def _nonempty(t: Tensor) -> Tensor:
    """The tensor itself, or a one-element stand-in (a valid pointer the kernel never reads)."""
    if t.numel():
        return t
    return torch.zeros((1,) * t.dim(), dtype=t.dtype, device=t.device)


def _block_strides(t: Tensor, pi: int) -> tuple[int, int, int]:
    """(block, token, head) element strides of a pool ``[NB, Pi, H, X]`` or of rows ``[T, H, X]``.

    Rows of a contiguous cache are blocks of ``Pi`` consecutive tokens, so no copy is needed; the
    kernel masks tokens past the sequence's length.
    """
    if t.dim() == 4:
        return t.stride(0), t.stride(1), t.stride(2)
    if t.dim() == 3:
        return pi * t.stride(0), t.stride(0), t.stride(1)
    raise HackError(f"expected a [NB, Pi, H, X] pool or [T, H, X] rows, got shape {tuple(t.shape)}")


def _num_splits(batch: int, hkv: int, max_blocks: int, device: torch.device) -> int:
    """Split-K factor: enough programs to fill the device, at least one block per split."""
    if device.type != "cuda":
        return max(1, min(2, max_blocks))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, (2 * sms) // max(1, batch * hkv))
    return max(1, min(want, max_blocks, 64))


def quantized_partials(q: Tensor, batch: HackBatch, scale: float, num_splits: int | None = None):
    """Run the kernel: per-split partial (acc [B,Hkv,S,BG,D], max [B,Hkv,S,BG], sum), log2-domain max."""
    dev = q.device
    _require_triton(dev)
    bsz, hq, d = q.shape
    hkv = batch.num_kv_heads
    if d != batch.head_dim or hq % hkv or bsz != batch.batch:
        raise HackError(
            f"q {tuple(q.shape)} does not match the batch (B={batch.batch}, Hkv={hkv}, D={batch.head_dim})"
        )
    g = hq // hkv
    block_g = max(16, triton.next_power_of_2(g))
    max_blocks = int(batch.block_table.shape[1])
    splits = num_splits or _num_splits(bsz, hkv, max_blocks, dev)
    per_split = math.ceil(max_blocks / splits)
    q = q.contiguous()
    acc = torch.empty(bsz, hkv, splits, block_g, d, dtype=torch.float32, device=dev)
    mx = torch.empty(bsz, hkv, splits, block_g, dtype=torch.float32, device=dev)
    sm = torch.empty_like(mx)
    pi = batch.v_part
    kc, ks, km, ksum = (_nonempty(t) for t in (batch.k_packed, batch.k_scale, batch.k_min, batch.k_sum))
    vc, vs, vm, vsum = (_nonempty(t) for t in (batch.v_packed, batch.v_scale, batch.v_min, batch.v_sum))
    vt = _nonempty(batch.v_tail)
    if not (ks.stride() == km.stride() and vs.stride() == vm.stride()):
        raise HackError("K (and V) scale and min tensors must share one layout")
    if ksum.stride(-1) != 1 or vsum.stride(-1) != 1 or ks.stride(-1) != 1 or vs.stride(-1) != 1:
        raise HackError("the last dim of scale, min and sum tensors must be contiguous")
    qmul = batch.q_mul.contiguous() if batch.q_mul is not None else q  # dummy pointer when unused
    kc_st, ks_st, vc_st = _block_strides(kc, pi), _block_strides(ks, pi), _block_strides(vc, pi)
    ku_st = _block_strides(ksum, pi)  # sums may differ in dtype (paged layout: strides in their own units)
    nkp = d // batch.k_part
    _hack_decode_kernel[(bsz, hkv, splits)](
        q,
        qmul,
        batch.block_table,
        batch.tq,
        kc,
        ks,
        km,
        ksum,
        vc,
        vs,
        vm,
        vsum,
        vt,
        acc,
        mx,
        sm,
        q.stride(0),
        q.stride(1),
        qmul.stride(0),
        qmul.stride(1),
        batch.block_table.stride(0),
        *kc_st,
        *ks_st,
        *ku_st,
        *vc_st,
        vs.stride(0),
        vs.stride(1),
        vsum.stride(0),
        vsum.stride(1),
        vt.stride(0),
        vt.stride(1),
        vt.stride(2),
        per_split,
        splits,
        scale * LOG2E,
        G=g,
        BLOCK_G=block_g,
        D=d,
        PK=batch.k_part,
        NKP=nkp,
        NKP_PAD=triton.next_power_of_2(nkp),
        PI=batch.v_part,
        BITS=batch.bits,
        HAS_QMUL=batch.q_mul is not None,
    )
    return acc[:, :, :, :g], mx[:, :, :, :g], sm[:, :, :, :g]


def _dense_partials(q: Tensor, batch: HackBatch, scale: float):
    """fp16-row partials (sinks / recent window) in the kernel's log2 domain: (acc, max, sum)."""
    bsz, hq, d = q.shape
    hkv = batch.num_kv_heads
    g = hq // hkv
    k = batch.dense_k.float()
    if batch.k_shift is not None:
        k = k - batch.k_shift[:, None]
    qg = q.float().view(bsz, hkv, g, d)
    s = torch.einsum("bhgd,bthd->bhgt", qg, k) * (scale * LOG2E)
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < batch.dense_len[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = s.amax(-1)
    w = torch.exp2(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None])
    w = torch.where(valid[:, None, None, :], w, torch.zeros_like(w))
    acc = torch.einsum("bhgt,bthd->bhgd", w, batch.dense_v.float())
    return acc[:, :, None], m[:, :, None], w.sum(-1)[:, :, None]


def merge_partials(parts: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """Combine split-softmax partials (acc, log2 max, sum) over their split dim -> ``[B, Hkv, G, D]``."""
    acc = torch.cat([p[0] for p in parts], dim=2)
    mx = torch.cat([p[1] for p in parts], dim=2)
    sm = torch.cat([p[2] for p in parts], dim=2)
    top = mx.amax(dim=2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp2(mx - top)  # exp2(-inf) = 0 for empty splits
    num = (acc * w[..., None]).sum(2)
    den = (sm * w).sum(2)
    return num / torch.where(den > 0, den, torch.ones_like(den))[..., None]


def hack_decode_batch(q: Tensor, batch: HackBatch, scale: float, num_splits: int | None = None) -> Tensor:
    """HACK decode attention of one query token per sequence ``q [B, Hq, D]`` -> ``[B, Hq, D]`` (fp32).

    Every row of every sequence is visible (decode); masking by position is the reference's job.
    """
    acc, mx, sm = quantized_partials(q, batch, scale, num_splits)
    parts = [(acc, mx, sm)]
    if int(batch.dense_len.max()) > 0:
        parts.append(_dense_partials(q, batch, scale))
    out = merge_partials(parts)  # [B, Hkv, G, D]
    return out.reshape(q.shape[0], q.shape[1], q.shape[2])


def hack_decode_view(q: Tensor, view: HackLayerView, scale: float, qp_bits: int = 8) -> Tensor:
    """Single-sequence decode through the kernel: ``q [1, Hq, D]`` -> ``[1, Hq, D]`` (fp32).

    The cache's contiguous buffers are addressed in place (block table = identity), without copies.
    """
    if qp_bits != 8:
        raise HackError("the Triton kernel quantizes Q and P to 8 bits only")
    _require_triton(q.device)
    if not triton_supported(view):
        raise HackError("this HACK geometry is not supported by the Triton kernel; use the reference")
    dev = q.device
    pi, d, hkv = view.v_part, view.head_dim, view.num_kv_heads
    tq = view.num_quant_k
    nblk = max(1, math.ceil(tq / pi))
    nd = int(view.dense_pos.numel())
    batch = HackBatch(
        bits=view.bits,
        k_part=view.k_part,
        v_part=pi,
        head_dim=d,
        block_table=torch.arange(nblk, dtype=torch.int32, device=dev)[None],
        tq=torch.tensor([tq], dtype=torch.int32, device=dev),
        **packed_tensors(view),  # k rows [T, Hkv, PW] addressed in place (see _block_strides)
        v_tail=view.v_tail[None],
        dense_k=view.dense_k[None] if nd else torch.zeros(1, 1, hkv, d, dtype=torch.float16, device=dev),
        dense_v=view.dense_v[None] if nd else torch.zeros(1, 1, hkv, d, dtype=torch.float16, device=dev),
        dense_len=torch.tensor([nd], device=dev),
        k_shift=view.k_shift[None] if view.k_shift is not None else None,
        q_mul=view.q_mul[None] if view.q_mul is not None else None,
    )
    if tq == 0:
        return merge_partials([_dense_partials(q, batch, scale)]).reshape(q.shape)
    return hack_decode_batch(q, batch, scale)
