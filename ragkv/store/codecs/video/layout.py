"""Codec-friendly layout: quantized KV integers of one layer group <-> a sequence of video frames.

Geometry (KVFetcher section 3.2, with the deviations noted):

* **Intra-frame tiling.** One token's ``(Hkv, D)`` vector of one layer is a 2-D tile: heads on an
  ``(a, Hkv/a)`` grid, each head an ``(b, D/b)`` block (row-major, heads never mixed, head order and
  the order inside a head kept: the paper's rules i-iii). ``a``, ``b`` are powers of two; the best
  pair is searched offline by encoded size (:mod:`.search`).
* **Slots and frames.** A frame holds ``slots`` tiles per layer for K and as many for V, K on the
  left half and V on the right. A layer group of ``T`` tokens becomes ``F = ceil(T / slots)``
  frames; slot ``j`` of frame ``f`` holds chain position ``j * F + f``, so each slot shows ``F``
  consecutive chain tokens in consecutive frames (the paper's inter-frame layout). ``slots`` sets
  the frame resolution: several versions of a chunk differ only in it.
* **Token order (deviation).** The paper relies on consecutive tokens being similar (SSIM 0.87 on
  7B-70B models). On the small trained models measured here they are not (the delta to the previous
  token has *higher* entropy than the values), so the chain is a similarity order: a greedy
  nearest-neighbour path over the tokens' quantized vectors, stored as a permutation. ``order``
  picks what shares one permutation: ``none`` (token order), ``group`` (all layers, K and V),
  ``tensor`` (K and V each), ``layer`` (every layer of K and of V).
* **Planes.** ``yuv444``: the (up to) 3 layers of a group go to the 3 planes (the paper's mapping).
  ``gray`` and ``yuv420``: one plane carries the layers as horizontal bands; ``yuv420`` leaves its
  chroma planes flat so the stream is HEVC Main/Main10, which every NVDEC decodes.

Padding (chain positions ``>= T`` and frame borders) repeats the last chain token or the zero
level, so it costs almost nothing and is never restored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

PLANE_MODES = ("yuv444", "gray", "yuv420")
ORDER_MODES = ("none", "group", "tensor", "layer")
MIN_FRAME = 16  # libx265 refuses frames smaller than 16x16 (measured)
MAX_FRAME = 8192  # HEVC level 6.2 / NVDEC's largest coded size: bounds what a header may ask for


class LayoutError(ValueError):
    """Inconsistent layout parameters (a tiling that does not divide the heads, too many layers ...)."""


@dataclass(frozen=True)
class Tiling:
    """Head grid ``(a, Hkv/a)`` of head blocks ``(b, D/b)``: tile shape ``(a*b, (Hkv/a)*(D/b))``."""

    a: int
    b: int

    def check(self, heads: int, head_dim: int) -> None:
        if self.a < 1 or self.b < 1 or heads % self.a or head_dim % self.b:
            raise LayoutError(
                f"tiling ({self.a},{self.b}) does not divide heads={heads}, head_dim={head_dim}"
            )

    def shape(self, heads: int, head_dim: int) -> tuple[int, int]:
        self.check(heads, head_dim)
        return self.a * self.b, (heads // self.a) * (head_dim // self.b)

    def tile(self, x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
        """``[..., Hkv*D]`` -> ``[..., th, tw]``."""
        a, b = self.a, self.b
        lead = x.shape[:-1]
        y = x.reshape(*lead, a, heads // a, b, head_dim // b)
        n = len(lead)
        y = y.transpose(*range(n), n, n + 2, n + 1, n + 3)
        return y.reshape(*lead, a * b, (heads // a) * (head_dim // b))

    def untile_index(self, heads: int, head_dim: int) -> np.ndarray:
        """Flat tile position of each channel ``c = h*D + e`` (so ``channels = tile.flat[index]``)."""
        idx = self.tile(np.arange(heads * head_dim), heads, head_dim).reshape(-1)
        inv = np.empty_like(idx)
        inv[idx] = np.arange(idx.size)
        return inv


def _pow2_divisors(n: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(n)) + 1) if n % (1 << i) == 0]


def candidate_tilings(heads: int, head_dim: int) -> list[Tiling]:
    """All power-of-two tilings (the paper's ``log H x log D`` search space)."""
    return [Tiling(a, b) for a in _pow2_divisors(heads) for b in _pow2_divisors(head_dim)]


def default_tiling(heads: int, head_dim: int) -> Tiling:
    """The candidate whose tile is closest to square (wider on ties): a reasonable unsearched choice."""

    def key(t: Tiling) -> tuple[float, int]:
        th, tw = t.shape(heads, head_dim)
        return abs(math.log(tw / th)), -tw

    return min(candidate_tilings(heads, head_dim), key=key)


def slot_grid(slots: int) -> tuple[int, int]:
    """Rows x columns of the slot grid of one band (near square, columns >= rows)."""
    if slots < 1:
        raise LayoutError(f"slots must be >= 1, got {slots}")
    rows = int(math.isqrt(slots))
    while slots % rows:
        rows -= 1
    return rows, slots // rows


@dataclass(frozen=True)
class FrameLayout:
    """Where every (tensor, layer, token) integer tile sits in which frame; see the module docstring."""

    layers: int
    tokens: int
    heads: int
    head_dim: int
    tiling: Tiling
    slots: int
    planes: str = "yuv444"
    #: smallest frame ``(height, width)``: libx265's 16x16 by default; NVDEC's minimum when frames are
    #: padded for it (``VideoCodec(small_frames="pad")``). The padding is flat and never restored.
    min_frame: tuple[int, int] = (16, 16)

    def __post_init__(self) -> None:
        if self.planes not in PLANE_MODES:
            raise LayoutError(f"planes must be one of {PLANE_MODES}, got {self.planes!r}")
        if self.layers < 1 or self.tokens < 1:
            raise LayoutError("a layer group needs at least one layer and one token")
        if self.planes == "yuv444" and self.layers > 3:
            raise LayoutError(f"yuv444 carries at most 3 layers per frame, got {self.layers}")
        self.tiling.check(self.heads, self.head_dim)
        slot_grid(self.slots)
        if len(self.min_frame) != 2 or not all(16 <= int(x) <= MAX_FRAME for x in self.min_frame):
            raise LayoutError(f"min_frame must be two sizes in [16, {MAX_FRAME}], got {self.min_frame!r}")

    # -- derived geometry ---------------------------------------------------------------------------
    @property
    def tile_shape(self) -> tuple[int, int]:
        return self.tiling.shape(self.heads, self.head_dim)

    @property
    def grid(self) -> tuple[int, int]:
        return slot_grid(self.slots)

    @property
    def num_frames(self) -> int:
        return -(-self.tokens // self.slots)

    @property
    def num_planes(self) -> int:
        return 3 if self.planes == "yuv444" else 1

    @property
    def band_shape(self) -> tuple[int, int]:
        """One layer's K|V band: ``rows*th`` x ``2*cols*tw``."""
        (th, tw), (r, c) = self.tile_shape, self.grid
        return r * th, 2 * c * tw

    @property
    def frame_shape(self) -> tuple[int, int]:
        """Frame height x width: at least ``min_frame`` (16 each by default), even (chroma subsampling needs it)."""
        bh, bw = self.band_shape
        h = bh if self.planes == "yuv444" else bh * self.layers
        return _even(max(h, MIN_FRAME, self.min_frame[0])), _even(max(bw, MIN_FRAME, self.min_frame[1]))

    def place(self, tensor: int, layer: int) -> tuple[int, int, int]:
        """(plane, row offset, column offset) of a tensor's (0=K, 1=V) band of ``layer``."""
        bh, bw = self.band_shape
        plane, row = (layer, 0) if self.planes == "yuv444" else (0, layer * bh)
        return plane, row, tensor * (bw // 2)

    def chain_positions(self, frame: int) -> np.ndarray:
        """Chain positions shown by the slots of ``frame`` (clamped to the last token: padding repeats it)."""
        p = np.arange(self.slots) * self.num_frames + frame
        return np.minimum(p, self.tokens - 1)

    def valid_slots(self, frame: int) -> np.ndarray:
        """Mask of slots of ``frame`` that show a real chain position (not padding)."""
        return np.arange(self.slots) * self.num_frames + frame < self.tokens

    # -- packing ------------------------------------------------------------------------------------
    def pack(self, q: np.ndarray, orders: np.ndarray, fill: int, dtype=np.uint8) -> np.ndarray:
        """Integers ``q [2, G, T, C]`` (K, V) -> frames ``[F, P, H, W]``.

        ``orders [2, G, T]``: chain position -> token index for every tensor and layer.
        """
        two, g, t, c = q.shape
        if (two, g, t, c) != (2, self.layers, self.tokens, self.heads * self.head_dim):
            raise LayoutError(f"cannot pack integers of shape {q.shape} into {self}")
        (th, tw), (r, cols) = self.tile_shape, self.grid
        n_f = self.num_frames
        fh, fw = self.frame_shape
        frames = np.full((n_f, self.num_planes, fh, fw), fill, dtype=dtype)
        # chain position of slot j in frame f is j*F + f -> [slots, F]
        pos = np.minimum(np.arange(self.slots)[:, None] * n_f + np.arange(n_f)[None, :], t - 1)
        for s in range(2):
            for layer in range(g):
                tiles = self.tiling.tile(q[s, layer][orders[s, layer][pos]], self.heads, self.head_dim)
                # [r*cols, F, th, tw] -> [F, r*th, cols*tw]
                img = (
                    tiles.reshape(r, cols, n_f, th, tw)
                    .transpose(2, 0, 3, 1, 4)
                    .reshape(n_f, r * th, cols * tw)
                )
                plane, row, col = self.place(s, layer)
                frames[:, plane, row : row + r * th, col : col + cols * tw] = img
        return frames

    def unpack_frame(self, frame, untile_index):
        """One frame ``[P, H, W]`` -> slot tiles ``[2, G, slots, C]`` in channel order.

        Works on numpy arrays (CPU restore) and torch tensors (CUDA restore) alike;
        ``untile_index`` is :meth:`Tiling.untile_index` as the same kind of array.
        """
        (th, tw), (r, cols) = self.tile_shape, self.grid
        is_np = isinstance(frame, np.ndarray)
        parts = []
        for s in range(2):
            for layer in range(self.layers):
                plane, row, col = self.place(s, layer)
                img = frame[plane, row : row + r * th, col : col + cols * tw].reshape(r, th, cols, tw)
                img = img.transpose(0, 2, 1, 3) if is_np else img.permute(0, 2, 1, 3)
                parts.append(img.reshape(self.slots, th * tw)[:, untile_index])
        out = np.stack(parts) if is_np else torch.stack(parts)
        return out.reshape(2, self.layers, self.slots, self.heads * self.head_dim)


def _even(n: int) -> int:
    return n + (n & 1)
