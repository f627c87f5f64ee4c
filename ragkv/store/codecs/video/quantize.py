"""Quantization of one layer group's K or V to unsigned integers that fit a pixel bit depth.

The video stage is lossless *relative to these integers*; all precision loss happens here.

Two scale modes (measured on real KV in docs/VIDEO_CODEC.md):

* ``std`` (default): per channel (or per token) the values are centred on their mean and divided by
  ``step * std``, so the step is a fixed fraction of each channel's spread and entropy coding pays
  for the tails instead of outliers stretching the step of everything else. It is outlier-aware:
  if a channel's extreme value would not fit ``bits``, that channel's step is widened just enough,
  so nothing is ever clipped.
* ``minmax``: the classic asymmetric ``[min, max] -> [0, 2**bits - 1]`` quantizer (CacheGen-like
  per-channel scales); the integer range is always fully used.

Scales and offsets are stored as fp16 and the encoder quantizes with exactly the stored values, so
``dequantize(quantize(x))`` on the encoder equals what any decoder restores, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SCALE_MODES = ("std", "minmax")
AXES = ("channel", "token")
MIN_BITS, MAX_BITS = 2, 12
_TINY = np.float16(2.0**-24)  # smallest positive fp16 (subnormal): floor for the step of constant channels


class QuantizeError(ValueError):
    """KV that cannot be quantized (non-finite values, or a range fp16 scales cannot hold)."""


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
        """Integer that stands for the offset (the channel mean in ``std`` mode, the minimum in ``minmax``)."""
        return (1 << (int(self.bits) - 1)) if self.mode == "std" else 0


@dataclass
class QuantizedTensor:
    """Integers ``q [G, T, C]`` (uint16) with ``x ~= (q - zero) * scale + offset``.

    ``scale`` and ``offset`` are fp16, shaped ``[G, 1, C]`` for per-channel statistics and
    ``[G, T, 1]`` for per-token statistics.
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    zero: int
    bits: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reference dequantization of all values (the video decoder restores exactly this)."""
        return dequantize(torch.from_numpy(self.q.astype(np.int32)), self.scale, self.offset, self.zero, dtype)


def dequantize(
    q: torch.Tensor, scale: np.ndarray | torch.Tensor, offset: np.ndarray | torch.Tensor, zero: int, dtype: torch.dtype
) -> torch.Tensor:
    """``(q - zero) * scale + offset`` computed in fp32 (one formula for every decode path)."""
    s = torch.as_tensor(scale).to(device=q.device, dtype=torch.float32)
    o = torch.as_tensor(offset).to(device=q.device, dtype=torch.float32)
    return ((q.to(torch.float32) - float(zero)) * s + o).to(dtype)


def quantize(x: torch.Tensor, cfg: QuantConfig) -> QuantizedTensor:
    """Quantize ``x [G, T, Hkv, D]`` (any float dtype) per ``cfg``."""
    if x.dim() != 4:
        raise ValueError(f"expected [G, T, Hkv, D], got shape {tuple(x.shape)}")
    g, t, h, d = x.shape
    a = x.detach().to("cpu", torch.float32).reshape(g, t, h * d).numpy().astype(np.float64)
    if not np.isfinite(a).all():
        raise QuantizeError("cannot quantize non-finite KV values (nan/inf)")
    axis = 1 if cfg.axis == "channel" else 2
    top = cfg.levels - 1
    with np.errstate(over="ignore"):
        if cfg.mode == "minmax":
            offset = _fp16_down(a.min(axis=axis, keepdims=True))
            span = a.max(axis=axis, keepdims=True) - offset.astype(np.float64)
            scale = _fp16_up(np.maximum(span / top, float(_TINY)))
        else:
            offset = _fp16_near(a.mean(axis=axis, keepdims=True))
            dev = a - offset.astype(np.float64)
            std = np.sqrt((dev**2).mean(axis=axis, keepdims=True))
            # outlier-aware: widen the step of a channel only if its extremes would not fit
            room = float(cfg.zero - 1) if cfg.zero > 1 else 1.0
            need = np.maximum(-dev.min(axis=axis, keepdims=True) / cfg.zero, dev.max(axis=axis, keepdims=True) / room)
            scale = _fp16_up(np.maximum(np.maximum(cfg.step * std, need), float(_TINY)))
    q = np.rint((a - offset.astype(np.float64)) / scale.astype(np.float64)) + cfg.zero
    # clipping only trims fp16 rounding of scale/offset (a fraction of one step at the range ends)
    q = np.clip(q, 0, top).astype(np.uint16)
    return QuantizedTensor(q=q, scale=scale, offset=offset, zero=cfg.zero, bits=int(cfg.bits))


def _check_fp16(x: np.ndarray) -> None:
    if np.abs(x).max(initial=0.0) > float(np.finfo(np.float16).max):
        raise QuantizeError("KV range too large for fp16 scales/offsets")


def _fp16_near(x: np.ndarray) -> np.ndarray:
    _check_fp16(x)
    return x.astype(np.float16)


def _fp16_up(x: np.ndarray) -> np.ndarray:
    """Round to fp16 towards +inf (a step must never shrink: that could clip)."""
    _check_fp16(x)
    h = x.astype(np.float16)
    low = h.astype(np.float64) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _fp16_down(x: np.ndarray) -> np.ndarray:
    """Round to fp16 towards -inf (an offset above the minimum would clip it)."""
    _check_fp16(x)
    h = x.astype(np.float16)
    high = h.astype(np.float64) > x
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h
