"""Decode weights: the GGUF file's own low-bit blocks, repacked once for the decode kernel.

A decode step reads every weight once per token, so its time is the bytes of the weights: float32
weights of the 135M default model are ~540 MB, its Q4_1 blocks ~85 MB. This module turns a GGUF
tensor's blocks into the kernel's formats (:mod:`ragkv.model.lowbit_kernel`) and runs them:

==========  ===================================================  ===========================
GGUF type   one block of the file                                kernel format (per block)
==========  ===================================================  ===========================
Q4_0        32 values: fp16 ``d``, 4-bit ``q``; ``d * (q - 8)``   ``u4``: ``s = d, m = -8 d``
Q4_1        32 values: fp16 ``d, m``, 4-bit ``q``; ``d q + m``    ``u4``: ``s = d, m = m``
Q4_K        256 values: fp16 ``d, dmin``, eight 6-bit            ``u4`` per 32: ``s = d sc``,
            ``sc, mn``; ``d sc q - dmin mn``                      ``m = -dmin mn``
Q5_0/Q5_1   32 values, 5-bit ``q``                                ``i8g32``
Q5_K        256 values, 5-bit ``q``, 6-bit ``sc, mn`` per 32     ``i8g32``
Q8_0        32 values: fp16 ``d``, int8 ``q``; ``d q``            ``i8g32``: ``s = d, m = 0``
Q6_K        256 values: fp16 ``d``, int8 ``sc`` per 16, 6-bit    ``i8g16``: ``s = d sc``
==========  ===================================================  ===========================

**Exactness.** Every scale and offset is carried exactly: an fp16 ``d`` is exact in float32, and so
is its product with a 6- or 8-bit sub-block scale (at most 19 significant bits of float32's 24), and
``-8 d``. The integers ``q`` are the file's. What differs from float32 decode (``F.linear`` over the
float32 weights that :func:`ragkv.model.gguf.dequantized_weights` made of the same blocks) is only
rounding: the kernel forms each weight as one fused multiply-add ``s * q + m`` (the float32 weights
were rounded twice, ``d * q`` then ``+ m``: at most one unit in the last place apart) and sums the
products in another order. No weight, scale or activation changes precision (activations stay
float32); stock kernels would: ``_weight_int4pack_mm_for_cpu`` keeps scales and offsets in bfloat16
(8 significant bits: an fp16 ``d`` loses 3) and is fast only on bfloat16 activations, see
docs/DECISIONS.md. K-quants with 2 or 3 bits (Q2_K, Q3_K), the IQ types and float tensors keep
float32 weights in decode (per tensor: :func:`pack_gguf_tensor` returns None).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ragkv.model import lowbit_kernel

#: decode weights settings: ``"float32"`` (the float32 weights every pass uses), ``"gguf"`` (the GGUF
#: file's blocks in single-token decode steps), ``"auto"`` (``"gguf"`` where the model came from a
#: GGUF file and the kernel is available, else ``"float32"``)
DECODE_WEIGHTS = ("auto", "gguf", "float32")
DEFAULT_DECODE_WEIGHTS = "auto"
#: version of the packed layout kept beside a converted checkpoint (bump when packing changes)
PACK_VERSION = 2

_FP16_ONE = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)


class LowBitTensor:
    """One weight ``[N, K]`` in a kernel format: ``packed`` uint8 ``[N, bytes per row]``."""

    __slots__ = ("fmt", "packed", "n", "k", "source")

    def __init__(self, fmt: str, packed: torch.Tensor, n: int, k: int, source: str = ""):
        self.fmt, self.packed, self.n, self.k, self.source = fmt, packed.contiguous(), n, k, source

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def rows(self, idx) -> LowBitTensor:
        """Rows ``idx`` (a permutation or slice of the output rows)."""
        p = self.packed[idx]
        return LowBitTensor(self.fmt, p, int(p.shape[0]), self.k, self.source)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the kernel computes with (``s * q + m`` per value, one rounding)."""
        q, s, m = unpack(self)
        g = q.shape[1] // s.shape[1]
        return torch.addcmul(m.repeat_interleave(g, 1), q.float(), s.repeat_interleave(g, 1))


def cat_rows(parts: list[LowBitTensor]) -> LowBitTensor:
    """Weights of one format stacked along their output rows (q/k/v into one, gate/up into one)."""
    fmt, k = parts[0].fmt, parts[0].k
    if any(p.fmt != fmt or p.k != k for p in parts):
        raise ValueError("cat_rows needs one format and one input width")
    packed = torch.cat([p.packed for p in parts])
    return LowBitTensor(
        fmt, packed, int(packed.shape[0]), k, "+".join(dict.fromkeys(p.source for p in parts))
    )


class LowBitLinear:
    """A linear layer on low-bit weights: one kernel call per run of parts of the same format."""

    def __init__(self, parts: list[LowBitTensor]):
        groups: list[list[LowBitTensor]] = []
        for p in parts:
            if groups and groups[-1][0].fmt == p.fmt:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.parts = [cat_rows(g) if len(g) > 1 else g[0] for g in groups]
        self.n = sum(p.n for p in self.parts)
        self.k = self.parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        mod = lowbit_kernel.kernel()
        x2 = x.reshape(-1, self.k).float()
        outs = [mod.lowbit_mm(x2, p.packed, p.n, p.k, lowbit_kernel.FORMATS[p.fmt]) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.n)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @property
    def single(self) -> tuple[torch.Tensor, int, int] | None:
        """``(packed, N, format code)`` of a linear of one part (what the fused decode ops take)."""
        if len(self.parts) != 1:
            return None
        p = self.parts[0]
        return p.packed, p.n, lowbit_kernel.FORMATS[p.fmt]


def fused_qkv(
    h: torch.Tensor, norm_w: torch.Tensor, eps: float, lin: LowBitLinear, bias
) -> torch.Tensor | None:
    """RMSNorm and the q/k/v projection of float32 decode rows in one kernel call (None: not fusable)."""
    one = lin.single
    if one is None or h.dtype != torch.float32 or norm_w.dtype != torch.float32:
        return None
    return lowbit_kernel.kernel().decode_qkv(h, norm_w, eps, one[0], one[1], one[2], bias)


def fused_finish(
    h, attn, o: LowBitLinear, o_b, norm_w, eps: float, gate_up: LowBitLinear, down: LowBitLinear
):
    """The rest of a decode layer in one kernel call: ``h + o(attn)``, then the MLP of its RMSNorm
    added (None: not fusable)."""
    parts = (o.single, gate_up.single, down.single)
    if any(p is None for p in parts) or h.dtype != torch.float32 or norm_w.dtype != torch.float32:
        return None
    (ow, _, of), (gw, gn, gf), (dw, _, df) = parts
    return lowbit_kernel.kernel().decode_finish(h, attn, ow, of, o_b, norm_w, eps, gw, gf, dw, df, gn // 2)


# ---- packing ----------------------------------------------------------------------------------------
def _base(fmt: str) -> tuple[str, bool]:
    """``(format without the float16 mark, whether scales/offsets are float16)``."""
    return (fmt[:-1], True) if fmt.endswith("h") else (fmt, False)


def _group(fmt: str) -> int:
    return 16 if _base(fmt)[0] == "i8g16" else 32


def _rows_bytes(q: np.ndarray, s: np.ndarray, m: np.ndarray, fmt: str) -> np.ndarray:
    """Kernel rows ``[N, nb * block bytes]`` of integers ``q [N, K]`` and per-block ``s, m [N, nb]``."""
    n, k = q.shape
    nb = s.shape[1]
    g = k // nb
    base, half = _base(fmt)
    dt = np.float16 if half else np.float32
    sm = np.stack([s.astype(dt), m.astype(dt)], -1).view(np.uint8).reshape(n, nb, 4 if half else 8)
    if base == "u4":
        qb = q.reshape(n, nb, 2, 16).astype(np.uint8)
        body = qb[:, :, 0] | (qb[:, :, 1] << np.uint8(4))
    else:
        body = q.reshape(n, nb, g).astype(np.int8).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([sm, body], -1).reshape(n, -1))


def _exact_in_f16(x: np.ndarray) -> bool:
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(x.astype(np.float16).astype(np.float32), x))


def pack(q, s, m, fmt: str, source: str = "") -> LowBitTensor:
    """A :class:`LowBitTensor` of integers ``q [N, K]`` and block scales/offsets ``s, m [N, K / G]``
    (``fmt``: ``u4``, ``i8g16`` or ``i8g32``; stored with float16 scales and offsets, the ``h``
    variant, where every one of them is exact in float16, else float32: exact either way)."""
    q, s, m = (np.asarray(t) for t in (q, s, m))
    g = {"u4": 32, "i8g32": 32, "i8g16": 16}[fmt]
    if q.shape[1] % g or s.shape != (q.shape[0], q.shape[1] // g) or s.shape != m.shape:
        raise ValueError(f"{fmt}: q {q.shape} does not fit scales {s.shape} / offsets {m.shape}")
    if _exact_in_f16(s) and _exact_in_f16(m):
        fmt += "h"
    rows = _rows_bytes(q, s, m, fmt)
    return LowBitTensor(fmt, torch.from_numpy(rows), int(q.shape[0]), int(q.shape[1]), source)


def unpack(t: LowBitTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [N, K] int, s [N, nb], m [N, nb])`` of a packed weight (the inverse of :func:`pack`)."""
    base, half = _base(t.fmt)
    g = _group(t.fmt)
    nb = t.k // g
    body = g // 2 if base == "u4" else g
    head = 4 if half else 8
    blocks = t.packed.reshape(t.n, nb, head + body)
    sm = blocks[..., :head].contiguous().view(torch.float16 if half else torch.float32).float()
    b = blocks[..., head:]
    if base == "u4":
        q = torch.stack([b & 15, b >> 4], 2).reshape(t.n, t.k).to(torch.int16)
    else:
        q = b.contiguous().view(torch.int8).reshape(t.n, t.k).to(torch.int16)
    return q, sm[..., 0], sm[..., 1]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _with_unit(blocks: np.ndarray, ones: tuple[int, ...], zeros: tuple[int, ...] = ()) -> np.ndarray:
    """Blocks with the fp16 fields at byte offsets ``ones`` set to 1 and ``zeros`` to 0 (dequantizing
    them then gives the integers, times any sub-block scale)."""
    b = blocks.copy()
    for o in ones:
        b[:, o : o + 2] = _FP16_ONE
    for o in zeros:
        b[:, o : o + 2] = 0
    return b


def _ints(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``values / scale`` where the scale is not 0 (0 where it is: the block's integers do not matter)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale != 0, values / np.where(scale != 0, scale, 1), 0)
    return np.rint(q).astype(np.int16)


def gguf_blocks_to_ints(raw: np.ndarray, qtype: str, k: int):
    """``(fmt, q [N, K], s [N, nb], m [N, nb])`` of a GGUF tensor's rows ``raw [N, bytes]``, or None
    where the type has no kernel format here."""
    from gguf import quants

    n = raw.shape[0]
    if qtype in ("Q4_0", "Q4_1"):
        bb = 18 if qtype == "Q4_0" else 20
        b = raw.reshape(n, k // 32, bb)
        d = _f16(b[..., 0:2])
        m = -8 * d if qtype == "Q4_0" else _f16(b[..., 2:4])
        qs = b[..., bb - 16 :]
        q = np.stack([qs & 15, qs >> 4], 2).reshape(n, k)
        return "u4", q, d, m
    if qtype == "Q8_0":
        b = raw.reshape(n, k // 32, 34)
        d = _f16(b[..., 0:2])
        q = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return "i8g32", q, d, np.zeros_like(d)
    if qtype in ("Q5_0", "Q5_1"):
        bb = 22 if qtype == "Q5_0" else 24
        blocks = raw.reshape(-1, bb)
        d = _f16(blocks[:, 0:2]).reshape(n, -1)
        if qtype == "Q5_0":
            vals = quants.Q5_0.dequantize_blocks(_with_unit(blocks, (0,)))
            m = np.zeros_like(d)
        else:
            vals = quants.Q5_1.dequantize_blocks(_with_unit(blocks, (0,), (2,)))
            m = _f16(blocks[:, 2:4]).reshape(n, -1)
        return "i8g32", np.rint(vals).astype(np.int16).reshape(n, k), d, m
    if qtype in ("Q4_K", "Q5_K"):
        bb = 144 if qtype == "Q4_K" else 176
        blocks = raw.reshape(-1, bb)
        d = _f16(blocks[:, 0:2])[:, None]
        dmin = _f16(blocks[:, 2:4])[:, None]
        sc, mn = quants.Q4_K.get_scale_min(blocks[:, 4:16])
        sc, mn = sc.astype(np.float32), mn.astype(np.float32)
        cls = quants.Q4_K if qtype == "Q4_K" else quants.Q5_K
        vals = cls.dequantize_blocks(_with_unit(blocks, (0,), (2,))).reshape(-1, 8, 32)
        q = _ints(vals, sc[..., None]).reshape(n, k)
        s, m = (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)
        return ("u4" if qtype == "Q4_K" else "i8g32"), q, s, m
    if qtype == "Q6_K":
        blocks = raw.reshape(-1, 210)
        d = _f16(blocks[:, 208:210])[:, None]
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        vals = quants.Q6_K.dequantize_blocks(_with_unit(blocks, (208,))).reshape(-1, 16, 16)
        q = _ints(vals, sc[..., None]).reshape(n, k)
        return "i8g16", q, (d * sc).reshape(n, -1), np.zeros((n, k // 16), np.float32)
    return None


#: the GGUF tensor types with a kernel format (the others keep float32 weights in decode)
PACKED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def pack_gguf_tensor(raw: np.ndarray, qtype: str, k: int, source: str = "") -> LowBitTensor | None:
    """A GGUF tensor's rows ``raw [N, bytes]`` (type ``qtype``, ``K`` values per row) in a kernel
    format; None where the type has none (float tensors, Q2_K, Q3_K, IQ types)."""
    if qtype not in PACKED_TYPES:
        return None
    got = gguf_blocks_to_ints(np.asarray(raw, dtype=np.uint8), qtype, k)
    if got is None:
        return None
    fmt, q, s, m = got
    return pack(q, s, m, fmt, source=source or qtype)


def gguf_lowbit_weights(path: str | os.PathLike) -> dict:
    """The GGUF file's 2-D low-bit tensors in the decode kernel's formats, by Hugging Face name
    (:func:`ragkv.model.lowbit.pack_gguf_tensor`; rows in the order :func:`dequantized_weights` gives
    them, llama's q/k un-permuted). Tensors of a type without a kernel format are left out."""
    from ragkv.model.gguf import _hf_name, _unpermute, open_reader

    path = Path(path)
    reader, arch, n_head, n_kv = open_reader(path)
    out = {}
    for t in reader.tensors:
        if len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        name, part = _hf_name(t, arch, path)
        raw = np.asarray(t.data)
        if raw.ndim != 2:
            continue
        if arch == "llama" and part in ("attn_q", "attn_k"):
            raw = _unpermute(raw, n_head if part == "attn_q" else n_kv)
        packed = pack_gguf_tensor(raw, t.tensor_type.name, int(t.shape[0]), source=t.tensor_type.name)
        if packed is not None:
            out[name] = packed
    return out


def quantize_to_gguf(w: torch.Tensor, qtype: str) -> np.ndarray:
    """``w [N, K]`` quantized into GGUF blocks ``[N, bytes]`` by the ``gguf`` library (tests, and
    checkpoints without a GGUF file: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)."""
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(w.detach().float().cpu().numpy(), GGMLQuantizationType[qtype])


def dequantize_gguf(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """The float32 weights the ``gguf`` library makes of GGUF rows (float32 decode's weights)."""
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(np.array(quants.dequantize(raw, GGMLQuantizationType[qtype]), dtype=np.float32))
