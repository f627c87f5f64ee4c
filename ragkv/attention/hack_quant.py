"""HACK quantizer: asymmetric min/max per partition, bit packing and cached code sums.

Implements the quantization scheme of HACK (Zhang et al., arXiv 2502.03589), Sec. 4 as reconstructed in
the project digest (part B.2.2): per partition of ``P`` elements along a matmul's inner dimension,
``m = min``, ``s = (max - m) / (2^b - 1)``, ``x' = round((x - m) / s)``, so ``x ~ s * x' + m``.
Stored operands (K, V) keep ``s`` and ``m`` in fp16; transient operands (Q, softmax P) are 8-bit with
fp32 metadata (they never leave the attention step, so their metadata dtype costs no memory).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_PARTITIONS = (16, 32, 64, 128)
FP16_MAX = 65504.0
# MSE-searched clipping (``clip_search``): candidate shrink factors of each partition's [min, max] range.
DEFAULT_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


class HackError(ValueError):
    """Base class of HACK attention errors (bad configuration, bad input, inconsistent state)."""


class HackConfigError(HackError):
    """A HACK setting is unsupported or inconsistent with the tensor geometry."""


class HackQuantError(HackError):
    """A tensor cannot be quantized as asked (non-finite values, out of fp16 range, bad shape)."""


@dataclass(frozen=True)
class Quantized:
    """Unpacked integer codes of partitions with their per-partition scale and min."""

    codes: Tensor  # uint8 [..., G, P]: one code per element, partitions along the last dim
    scale: Tensor  # [..., G]
    minv: Tensor  # [..., G]

    def dequantize(self) -> Tensor:
        """Return ``scale * code + min`` in fp32 (the value the homomorphic product approximates)."""
        return self.codes.float() * self.scale.float().unsqueeze(-1) + self.minv.float().unsqueeze(-1)


def check_kv_rows(k: Tensor, v: Tensor, heads: int, head_dim: int, error: type[HackError]) -> None:
    """Rows written to a HACK cache: ``k``, ``v`` both ``[n, heads, head_dim]`` (else ``error``), floating
    point, finite and within the fp16 range the cache keeps (else :class:`HackQuantError`)."""
    if k.dim() != 3 or tuple(k.shape[1:]) != (heads, head_dim) or k.shape != v.shape:
        raise error(
            f"k and v must both be [n, {heads}, {head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    for name, x in (("k", k), ("v", v)):
        if not x.dtype.is_floating_point:
            raise error(f"{name} must be floating point, got {x.dtype}")
        top = float(x.abs().amax()) if x.numel() else 0.0  # nan/inf propagate through amax
        if not math.isfinite(top):
            raise HackQuantError(f"{name} has non-finite values")
        if top > FP16_MAX / 2:
            raise HackQuantError(f"{name} has values outside the fp16 range kept by the cache")


def check_bits(bits: int) -> int:
    """Validate a code bit width."""
    if bits not in SUPPORTED_BITS:
        raise HackConfigError(f"unsupported bit width {bits}; supported: {SUPPORTED_BITS}")
    return bits


def check_partition(partition: int) -> int:
    """Validate a partition size (a multiple of 16, as the paper requires)."""
    if partition not in SUPPORTED_PARTITIONS:
        raise HackConfigError(f"unsupported partition size {partition}; supported: {SUPPORTED_PARTITIONS}")
    return partition


def k_partition_size(head_dim: int, partition: int) -> int:
    """Partition along head_dim for K (and Q): ``min(partition, head_dim)``; head_dim must split evenly."""
    if head_dim <= 0:
        raise HackConfigError(f"head_dim must be positive, got {head_dim}")
    pk = min(partition, head_dim)
    if head_dim % pk != 0:
        raise HackConfigError(f"head_dim {head_dim} is not a multiple of the K partition size {pk}")
    return pk


def sum_dtype(bits: int, partition: int) -> torch.dtype:
    """Dtype of cached code sums: uint8 when ``P * (2^b - 1) <= 255``, else int16 (paper Sec. 4.2)."""
    top = partition * ((1 << bits) - 1)
    if top <= 255:
        return torch.uint8
    if top <= 32767:
        return torch.int16
    raise HackConfigError(f"code sums of {partition} x {bits}-bit codes overflow int16")


def code_sums(codes: Tensor, bits: int, partition: int) -> Tensor:
    """Per-partition integer sums of codes over the last dim (the SE cache), in :func:`sum_dtype`."""
    return codes.to(torch.int32).sum(dim=-1).to(sum_dtype(bits, partition))


def _round_down_fp16(x: Tensor) -> Tensor:
    """Round fp32 values to the nearest fp16 value that is <= x (so that codes stay >= 0)."""
    h = x.to(torch.float16)
    low = h.float() > x
    if bool(low.any()):
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, -float("inf"))), h)
    return h


def _round_up_fp16(x: Tensor) -> Tensor:
    """Round non-negative fp32 values to the nearest fp16 value that is >= x (so codes stay <= 2^b-1)."""
    h = x.to(torch.float16)
    high = h.float() < x
    if bool(high.any()):
        h = torch.where(high, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h


def _check_values(x: Tensor, fp16_meta: bool) -> None:
    """Raise HackQuantError for non-finite input or (with fp16 metadata) values outside fp16 range."""
    if not x.numel():
        return
    top = float(x.abs().amax())  # nan/inf propagate, so one reduction checks both
    if not math.isfinite(top):
        raise HackQuantError("cannot quantize non-finite values (nan/inf)")
    if fp16_meta and top > FP16_MAX / 2:
        raise HackQuantError("values exceed the fp16 range that the stored scale/min can represent")


def _codes_for(
    x: Tensor, lo: Tensor, scale: Tensor, levels: int, stochastic: bool, generator: torch.Generator | None
) -> Tensor:
    """Codes of x for per-partition (lo, scale), nearest or stochastic rounding, clamped to [0, levels]."""
    s = scale.unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    t = torch.where(s > 0, (x - lo.unsqueeze(-1)) / safe, torch.zeros_like(x))
    if stochastic:
        u = torch.rand(t.shape, generator=generator, dtype=torch.float32, device="cpu").to(t.device)
        c = torch.floor(t + u)
    else:
        c = torch.round(t)
    return c.clamp_(0, levels)


def _meta(lo: Tensor, hi: Tensor, levels: int, fp16_meta: bool) -> tuple[Tensor, Tensor]:
    """Min and scale for ranges [lo, hi]: fp16 rounded outward when stored, fp32 when transient."""
    if not fp16_meta:
        return lo, (hi - lo) / levels
    lo16 = _round_down_fp16(lo)
    s16 = _round_up_fp16(((hi - lo16.float()) / levels).clamp_min(0.0))
    return lo16, s16


def quantize(
    x: Tensor,
    bits: int,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    fp16_meta: bool = True,
    clip_ratios: tuple[float, ...] | None = None,
) -> Quantized:
    """Asymmetric min/max quantization of partitions laid out along the last dim of ``x`` [..., G, P].

    ``fp16_meta`` stores min/scale in fp16 (K, V) or keeps fp32 (transient Q, P). ``clip_ratios`` enables
    an MSE search over shrunken ranges per partition (outlier-aware scales; not in the paper).
    """
    levels = (1 << check_bits(bits)) - 1
    if x.dim() < 2:
        raise HackQuantError(
            f"expected partitions along the last dim [..., G, P], got shape {tuple(x.shape)}"
        )
    xf = x.float()
    _check_values(xf, fp16_meta)
    mn = xf.amin(dim=-1)
    mx = xf.amax(dim=-1)
    if not clip_ratios or tuple(clip_ratios) == (1.0,):
        lo, scale = _meta(mn, mx, levels, fp16_meta)
        codes = _codes_for(xf, lo.float(), scale.float(), levels, stochastic, generator)
        return Quantized(codes.to(torch.uint8), scale, lo)
    # MSE-optimal clipping: shrink [mn, mx] around its centre by each ratio; keep the best per partition
    # (the first on ties). Only the per-partition error, scale and min are carried across ratios; the
    # codes are rounded once more for the winner (cheaper than selecting whole code tensors per ratio).
    centre = (mn + mx) / 2
    half = (mx - mn) / 2
    best_err = best_scale = best_lo = None
    for r in clip_ratios:
        lo, scale = _meta(centre - half * r, centre + half * r, levels, fp16_meta)
        codes = _codes_for(xf, lo.float(), scale.float(), levels, False, None)
        err = ((codes * scale.float().unsqueeze(-1) + lo.float().unsqueeze(-1)) - xf).square().sum(dim=-1)
        if best_err is None:
            best_err, best_scale, best_lo = err, scale, lo
            continue
        take = err < best_err
        best_err = torch.where(take, err, best_err)
        best_scale = torch.where(take, scale, best_scale)
        best_lo = torch.where(take, lo, best_lo)
    codes = _codes_for(xf, best_lo.float(), best_scale.float(), levels, stochastic, generator)
    return Quantized(codes.to(torch.uint8), best_scale, best_lo)


def packed_width(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits (groups of 8 codes take ``bits`` bytes; 8-bit: n)."""
    if bits == 8:
        return n
    return ((n + 7) // 8) * bits


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes along the last dim: code i sits at bit offset ``bits * i`` of a little-endian stream.

    For 2 bits this is 4 codes per byte, code ``4j + r`` in bits ``2r..2r+1`` of byte j (what the Triton
    kernel unpacks); 4 bits is 2 per byte; 3 bits packs 8 codes into 3 bytes.
    """
    check_bits(bits)
    if codes.dtype != torch.uint8:
        raise HackQuantError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    n = codes.shape[-1]
    if 8 % bits == 0:  # 2 and 4 bits: byte-aligned fast path with uint8 shifts
        per = 8 // bits
        c = codes if n % per == 0 else torch.nn.functional.pad(codes, (0, (-n) % per))
        c = c.reshape(*c.shape[:-1], -1, per)
        out = c[..., 0].clone()
        for r in range(1, per):
            out |= c[..., r] << (bits * r)
        if out.shape[-1] != packed_width(n, bits):  # groups of 8 codes: pad to whole groups
            out = torch.nn.functional.pad(out, (0, packed_width(n, bits) - out.shape[-1]))
        return out
    pad = (-n) % 8
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(dim=-1)  # [..., n/8], at most 64 bits used (8 * 8)
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_codes`: return ``n`` uint8 codes along the last dim."""
    check_bits(bits)
    if packed.dtype != torch.uint8:
        raise HackQuantError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.shape[-1] != packed_width(n, bits):
        raise HackQuantError(
            f"packed width {packed.shape[-1]} does not hold {n} codes of {bits} bits "
            f"(expected {packed_width(n, bits)})"
        )
    if bits == 8:
        return packed.contiguous()
    if 8 % bits == 0:  # 2 and 4 bits: byte-aligned, unpack with uint8 shifts (fast path)
        per = 8 // bits
        out = torch.empty(*packed.shape, per, dtype=torch.uint8, device=packed.device)
        for r in range(per):
            torch.bitwise_and(packed >> (bits * r), (1 << bits) - 1, out=out[..., r])
        return out.reshape(*packed.shape[:-1], -1)[..., :n]
    p = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, bits)
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    word = (p << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


def unpack_codes_float(packed: Tensor, bits: int, n: int) -> Tensor:
    """:func:`unpack_codes` straight to fp32 codes; 2 and 4 bits shift whole int32 words.

    The batched decode's hot path: 4 packed bytes are one little-endian int32 word whose codes sit
    at bit offsets ``bits * i`` in order, so one broadcast shift unpacks them (measured on CPU: 0.4 ms
    vs 0.9 ms shifting bytes, for a 3.4 MB result).
    """
    if bits not in (2, 4) or packed.dtype != torch.uint8:
        return unpack_codes(packed, bits, n).float()
    if packed.shape[-1] != packed_width(n, bits):
        raise HackQuantError(f"packed width {packed.shape[-1]} does not hold {n} codes of {bits} bits")
    mask = (1 << bits) - 1
    if sys.byteorder == "little" and packed.shape[-1] % 4 == 0:
        words = packed.contiguous().view(torch.int32)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        out = ((words.unsqueeze(-1) >> shifts) & mask).float()
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        out = ((packed.unsqueeze(-1) >> shifts) & mask).float()
    return out.reshape(*packed.shape[:-1], -1)[..., :n]


@dataclass(frozen=True)
class KeyPlan:
    """RoPE-aware key bits of one layer: a channel order per KV head and code bits per K partition.

    Block-GTQ's idea (RoPE frequency blocks differ by orders of magnitude in how much a key error
    moves a logit) fitted to HACK's homomorphic product, which needs one scale/min per partition of
    the inner dimension: channels are reordered per KV head so that the highest-energy RoPE blocks
    (channel pairs ``j, j + D/2``) come first, and each partition of the reordered channels gets its
    own bit width. Reordering the channels of Q and K alike leaves ``q . k`` unchanged.
    Deviation from the paper: bits per partition of ``D / len(bits)`` channels (not per block), the
    same for every KV head of a layer (one tensor layout), min/max codes instead of TurboQuant.
    """

    order: Tensor  # long [Hkv, D]: stored channel i of head h is model channel order[h, i]
    bits: tuple[int, ...]  # code bits of each K partition of the reordered channels

    def __post_init__(self):
        for b in self.bits:
            check_bits(b)
        if self.order.dim() != 2 or self.order.shape[1] % len(self.bits):
            raise HackConfigError(
                f"key plan order {tuple(self.order.shape)} does not split into {len(self.bits)} partitions"
            )
        every = torch.arange(self.order.shape[1], device=self.order.device).expand_as(self.order)
        if not torch.equal(self.order.sort(-1).values, every):  # a lost or repeated channel: wrong q . k
            raise HackConfigError("a key plan's order must be a permutation of each head's channels")

    @property
    def mean_bits(self) -> float:
        return sum(self.bits) / len(self.bits)


def parts_width(bits: tuple[int, ...], part: int) -> int:
    """Bytes of one row of K codes packed partition by partition (:func:`pack_parts`)."""
    return sum(packed_width(part, b) for b in bits)


def pack_parts(codes: Tensor, bits: tuple[int, ...], part: int) -> Tensor:
    """Pack codes ``[..., len(bits) * part]`` partition by partition, each with its own bit width.

    With equal widths this is byte for byte :func:`pack_codes` of the whole row (partitions are
    multiples of 8 codes).
    """
    if len(set(bits)) == 1:
        return pack_codes(codes, bits[0])
    return torch.cat([pack_codes(codes[..., i * part : (i + 1) * part], b) for i, b in enumerate(bits)], -1)


def unpack_parts(packed: Tensor, bits: tuple[int, ...], part: int, to_float: bool = False) -> Tensor:
    """Inverse of :func:`pack_parts`: codes ``[..., len(bits) * part]``, uint8 (or fp32 with
    ``to_float``, through :func:`unpack_codes_float`)."""
    unpack = unpack_codes_float if to_float else unpack_codes
    if len(set(bits)) == 1:
        return unpack(packed, bits[0], part * len(bits))
    out, at = [], 0
    for b in bits:
        w = packed_width(part, b)
        out.append(unpack(packed[..., at : at + w], b, part))
        at += w
    return torch.cat(out, -1)


def quantize_k_rows(
    k: Tensor,
    bits: int | tuple[int, ...],
    part: int,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    clip_ratios: tuple[float, ...] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantize K rows [T, H, D] per token along head_dim: (packed codes, scale, min, sums).

    ``bits``: one width, or one per partition (a :class:`KeyPlan`'s, channels already reordered).
    Shapes: packed [T, H, parts_width], scale/min fp16 [T, H, D/part], sums [T, H, D/part].
    """
    t, h, d = k.shape
    widths = (bits,) * (d // part) if isinstance(bits, int) else tuple(bits)
    if len(widths) != d // part:
        raise HackConfigError(f"{len(widths)} partition bit widths for {d // part} K partitions")
    x = k.reshape(t, h, d // part, part)
    opts = {"stochastic": stochastic, "generator": generator, "clip_ratios": clip_ratios}
    if len(set(widths)) == 1:
        q = quantize(x, widths[0], **opts)
    else:  # partitions of different widths quantized apart, codes/meta reassembled in order
        qs = [quantize(x[:, :, i : i + 1], b, **opts) for i, b in enumerate(widths)]
        q = Quantized(*(torch.cat([getattr(p, f) for p in qs], 2) for f in ("codes", "scale", "minv")))
    codes = q.codes.reshape(t, h, d)
    return pack_parts(codes, widths, part), q.scale, q.minv, code_sums(q.codes, max(widths), part)


def quantize_v_partitions(
    v: Tensor,
    bits: int,
    part: int,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    clip_ratios: tuple[float, ...] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantize V rows [N*part, H, D] as N partitions of ``part`` tokens per channel: (packed, scale, min, sums).

    Codes are packed along channels per token ([N*part, H, packed_width(D)]) so K and V share one layout;
    scale/min fp16 and sums are per (partition, head, channel): [N, H, D].
    """
    rows, h, d = v.shape
    if rows == 0 or rows % part != 0:
        raise HackQuantError(f"V rows ({rows}) must be a positive multiple of the partition size {part}")
    n = rows // part
    # [N, P, H, D] -> [N, H, D, P]: partitions of P tokens along the last dim, one per (head, channel).
    x = v.reshape(n, part, h, d).permute(0, 2, 3, 1)
    q = quantize(x, bits, stochastic=stochastic, generator=generator, clip_ratios=clip_ratios)
    codes = q.codes.permute(0, 3, 1, 2).reshape(rows, h, d)
    return pack_codes(codes.contiguous(), bits), q.scale, q.minv, code_sums(q.codes, bits, part)
