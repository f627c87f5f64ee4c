"""Quantization of one layer group's K or V to unsigned integers that fit a pixel bit depth.

The video stage is lossless *relative to these integers*; all precision loss happens here.

Two scale modes (measured on real KV in docs/VIDEO_CODEC.md):

* ``std`` (default): per channel (or per token) the values are centred on their mean and divided by
  ``step * std``, so the step is a fixed fraction of each channel's spread and entropy coding pays
  for the tails instead of outliers stretching the step of everything else. It is outlier-aware:
  if a channel's extreme values would not fit ``bits``, that channel's step is widened just enough,
  so nothing is ever clipped.
* ``minmax``: the classic asymmetric ``[min, max] -> [0, 2**bits - 1]`` quantizer (CacheGen-like
  per-channel scales).

Side information is compact and exactly reproducible on any device: a scale is ``2**(e/8)`` with
``e`` an int8 code (built from a fixed float32 table and an exact power of two), an offset is an
integer number of scales, and a value is restored with a single fp32 multiply,
``x = float32(q - zero + offset) * scale`` (no add, so no fused multiply-add can change the
rounding on a GPU). The encoder quantizes against exactly these values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ragkv.store.codecs.base import code_for_scale, scale_of

SCALE_MODES = ("std", "minmax")
AXES = ("channel", "token")
MIN_BITS, MAX_BITS = 2, 12
CODE_MIN, CODE_MAX = -128, 127  # scale codes: 2**-16 .. 2**15.875
_MAX_OFFSET = 1 << 22  # |q - zero + offset| stays below 2**24, so it is exact in float32


class QuantizeError(ValueError):
    """KV that cannot be quantized (non-finite values, or a range the scale codes cannot cover)."""


@dataclass(frozen=True)
class QuantConfig:
    """How one tensor (K or V) of a layer group is turned into integers."""

    bits: int = 8
    mode: str = "std"
    axis: str = "channel"
    step: float = 0.5

    def __post_init__(self) -> None:
        if not MIN_BITS <= int(self.bits) <= MAX_BITS:
            raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.bits}")
        if self.mode not in SCALE_MODES:
            raise ValueError(f"quantization mode must be one of {SCALE_MODES}, got {self.mode!r}")
        if self.axis not in AXES:
            raise ValueError(f"quantization axis must be one of {AXES}, got {self.axis!r}")
        if not (self.step > 0 and np.isfinite(self.step)):
            raise ValueError(f"step must be a positive number, got {self.step}")

    @property
    def levels(self) -> int:
        return 1 << int(self.bits)

    @property
    def zero(self) -> int:
        """Integer standing for ``offset`` (mid-range in ``std`` mode, 0 in ``minmax``)."""
        return (1 << (int(self.bits) - 1)) if self.mode == "std" else 0


@dataclass
class QuantizedTensor:
    """Integers ``q [G, T, C]`` (uint16) with ``x ~= float32(q - zero + offset) * scale(code)``.

    ``code`` (int8) and ``offset`` (int32) are shaped ``[G, 1, C]`` for per-channel statistics and
    ``[G, T, 1]`` for per-token statistics.
    """

    q: np.ndarray
    code: np.ndarray
    offset: np.ndarray
    zero: int
    bits: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reference dequantization of all values (every video decode path restores exactly this)."""
        vals = dequantize(
            torch.from_numpy(self.q.astype(np.int32)),
            torch.from_numpy(scale_of(self.code)),
            torch.from_numpy(self.offset.astype(np.int32)),
            self.zero,
        )
        return vals.to(dtype)


def dequantize(q, scale, offset, zero: int):
    """``float32(q - zero + offset) * scale``: integers exact in fp32, then one IEEE rounding.

    Takes numpy arrays or torch tensors (same result bit for bit: a single float32 multiply, no
    add after it that a GPU could fuse into an FMA); returns float32 of the same kind.
    """
    if isinstance(q, np.ndarray):
        n = q.astype(np.int32) - np.int32(zero) + np.asarray(offset, dtype=np.int32)
        return n.astype(np.float32) * np.asarray(scale, dtype=np.float32)
    n = q.to(torch.int32) - zero + offset.to(device=q.device, dtype=torch.int32)
    return n.to(torch.float32) * scale.to(device=q.device, dtype=torch.float32)


def quantize(x: torch.Tensor, cfg: QuantConfig, layer_steps: np.ndarray | None = None) -> QuantizedTensor:
    """Quantize ``x [G, T, Hkv, D]`` (any float dtype) per ``cfg``.

    ``layer_steps [G]`` (``std`` mode) multiplies ``cfg.step`` per layer: per-layer bit allocation.
    """
    if x.dim() != 4:
        raise ValueError(f"expected [G, T, Hkv, D], got shape {tuple(x.shape)}")
    g, t, h, d = x.shape
    a = x.detach().to("cpu", torch.float64).reshape(g, t, h * d).numpy()
    if not np.isfinite(a).all():
        raise QuantizeError("cannot quantize non-finite KV values (nan/inf)")
    axis = 1 if cfg.axis == "channel" else 2
    top = cfg.levels - 1
    lo, hi = a.min(axis=axis, keepdims=True), a.max(axis=axis, keepdims=True)
    if cfg.mode == "minmax":
        # one spare level absorbs the rounding of the offset down to a whole number of steps
        code = code_for_scale((hi - lo) / max(top - 1, 1), CODE_MIN, CODE_MAX)
    else:
        mean = a.mean(axis=axis, keepdims=True)
        std = np.sqrt(((a - mean) ** 2).mean(axis=axis, keepdims=True))
        # outlier-aware: widen a channel's step only if its extremes would not fit (+1 level of slack
        # for the rounding of the offset to a whole number of steps)
        room = max(cfg.zero - 2, 1)
        step = cfg.step * (np.ones(g) if layer_steps is None else np.asarray(layer_steps, dtype=np.float64))
        if step.shape != (g,) or not (step > 0).all():
            raise ValueError(f"layer_steps must be {g} positive multipliers, got {layer_steps!r}")
        code = code_for_scale(
            np.maximum(step[:, None, None] * std, np.maximum(mean - lo, hi - mean) / room), CODE_MIN, CODE_MAX
        )
    for _ in range(64):  # grow the step of any channel that still does not fit (rarely more than once)
        s = scale_of(code).astype(np.float64)
        off = np.floor(lo / s) if cfg.mode == "minmax" else np.rint(a.mean(axis=axis, keepdims=True) / s)
        qlo, qhi = np.rint(lo / s) - off + cfg.zero, np.rint(hi / s) - off + cfg.zero
        bad = (qlo < 0) | (qhi > top) | (np.abs(off) > _MAX_OFFSET)
        if not bad.any():
            break
        if (code[bad] >= CODE_MAX).any():
            raise QuantizeError("KV range too large for the video codec's scale codes")
        code = np.where(bad, code + 1, code)
    else:  # pragma: no cover - 64 doublings of the step always fit
        raise QuantizeError("could not fit the KV range into the integer range")
    q = np.rint(a / s) - off + cfg.zero
    q = np.clip(q, 0, top).astype(np.uint16)  # a no-op: every channel was checked to fit
    return QuantizedTensor(
        q=q, code=code.astype(np.int8), offset=off.astype(np.int32), zero=cfg.zero, bits=int(cfg.bits)
    )
