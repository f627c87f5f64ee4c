"""Self-describing byte format of one video-coded layer group, and the per-frame integer checksum.

Layout (little-endian)::

    fixed header   _FIXED (magic "RKVV", version, geometry, quantization, layout, sizes)
    fingerprint    fp_len bytes (UTF-8; empty when the encoder was not given one)
    side info      side_len bytes: zstd( K scale | K offset | V scale | V offset | token orders )
    frame sums     F x u32: checksum of each frame's integers (see :func:`frame_checksum`)
    header crc     u32 crc32 of everything above
    video          video_len bytes: raw HEVC Annex-B bitstream; its crc32 is in the fixed header

The frame checksum is a position-weighted sum modulo ``2**31 - 1`` rather than a crc32 so that the
GPU decode path can verify a frame on the device with two tensor ops (no copy back to the host);
any single changed integer always changes it (weights are non-zero mod a prime larger than any
difference of two integers), and the frame index enters the weights, so swapped frames are caught
(with high probability).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ragkv.store.codecs.base import DTYPE_CODES, CodecError

MAGIC = b"RKVV"
VERSION = 1
PLANE_CODES = {"yuv444": 0, "gray": 1, "yuv420": 2}
ORDER_CODES = {"none": 0, "group": 1, "tensor": 2, "layer": 3}
MODE_CODES = {"std": 0, "minmax": 1}
AXIS_CODES = {"channel": 0, "token": 1}
_INV = {
    "planes": {v: k for k, v in PLANE_CODES.items()},
    "order": {v: k for k, v in ORDER_CODES.items()},
    "mode": {v: k for k, v in MODE_CODES.items()},
    "axis": {v: k for k, v in AXIS_CODES.items()},
    "dtype": {v: k for k, v in DTYPE_CODES.items()},
}
# magic, version, planes, depth, order, dtype, tiling a, tiling b,
# K bits/mode/axis/step, V bits/mode/axis/step, G, T, H, D, slots, F, frame h, frame w,
# layer_start, token_start, fp_len, side_len, video_len, video_crc
_FIXED = struct.Struct("<4sBBBBBHH" + "BBBf" * 2 + "HIHHIIHH" + "IIBIII")
_U32 = struct.Struct("<I")
_MOD = 2147483647  # 2**31 - 1 (prime)


@dataclass
class VideoHeader:
    """Everything needed to restore a layer group from its video (no defaults: always read from bytes)."""

    planes: str
    depth: int
    order: str
    dtype: torch.dtype
    tiling: tuple[int, int]
    k_quant: tuple[int, str, str, float]  # bits, mode, axis, step
    v_quant: tuple[int, str, str, float]
    layers: int
    tokens: int
    heads: int
    head_dim: int
    slots: int
    frames: int
    frame_h: int
    frame_w: int
    layer_start: int
    token_start: int
    fingerprint: str
    side: bytes
    frame_sums: list[int]
    video_crc: int = 0
    video_offset: int = 0
    video_len: int = 0


def pack(hdr: VideoHeader, video: bytes) -> bytes:
    """Serialize ``hdr`` (side info already compressed) followed by the bitstream."""
    fp = hdr.fingerprint.encode()
    if len(fp) > 255:
        raise ValueError("model fingerprint longer than 255 bytes")
    if len(hdr.frame_sums) != hdr.frames:
        raise ValueError("one checksum per frame required")
    fixed = _FIXED.pack(
        MAGIC, VERSION, PLANE_CODES[hdr.planes], hdr.depth, ORDER_CODES[hdr.order], DTYPE_CODES[hdr.dtype],
        hdr.tiling[0], hdr.tiling[1],
        hdr.k_quant[0], MODE_CODES[hdr.k_quant[1]], AXIS_CODES[hdr.k_quant[2]], hdr.k_quant[3],
        hdr.v_quant[0], MODE_CODES[hdr.v_quant[1]], AXIS_CODES[hdr.v_quant[2]], hdr.v_quant[3],
        hdr.layers, hdr.tokens, hdr.heads, hdr.head_dim, hdr.slots, hdr.frames, hdr.frame_h, hdr.frame_w,
        hdr.layer_start, hdr.token_start, len(fp), len(hdr.side), len(video), zlib.crc32(video),
    )  # fmt: skip
    sums = struct.pack(f"<{hdr.frames}I", *hdr.frame_sums)
    head = fixed + fp + hdr.side + sums
    return b"".join([head, _U32.pack(zlib.crc32(head)), video])


def unpack(data: bytes | memoryview) -> VideoHeader:
    """Parse and verify the header (crc of the header and of the bitstream); :class:`CodecError` if bad."""
    mv = memoryview(data)
    if len(mv) < _FIXED.size + 4:
        raise CodecError(f"video segment truncated: {len(mv)} bytes")
    try:
        f = _FIXED.unpack_from(mv, 0)
    except struct.error as e:  # pragma: no cover - guarded by the length check
        raise CodecError(f"video segment header unreadable: {e}") from e
    if f[0] != MAGIC:
        raise CodecError("not a ragkv video segment (bad magic)")
    if f[1] != VERSION:
        raise CodecError(f"unsupported video segment version {f[1]} (this ragkv reads v{VERSION})")
    fp_len, side_len, video_len, video_crc = f[26], f[27], f[28], f[29]
    frames = f[21]
    pos = _FIXED.size
    end_head = pos + fp_len + side_len + 4 * frames
    if len(mv) != end_head + 4 + video_len:
        raise CodecError(
            f"video segment has {len(mv)} bytes, its header describes {end_head + 4 + video_len}"
        )
    if zlib.crc32(mv[:end_head]) != _U32.unpack_from(mv, end_head)[0]:
        raise CodecError("video segment header checksum mismatch")
    video = mv[end_head + 4 :]
    if zlib.crc32(video) != video_crc:
        raise CodecError("video bitstream checksum mismatch (corrupt video)")
    try:
        hdr = VideoHeader(
            planes=_INV["planes"][f[2]], depth=f[3], order=_INV["order"][f[4]], dtype=_INV["dtype"][f[5]],
            tiling=(f[6], f[7]),
            k_quant=(f[8], _INV["mode"][f[9]], _INV["axis"][f[10]], f[11]),
            v_quant=(f[12], _INV["mode"][f[13]], _INV["axis"][f[14]], f[15]),
            layers=f[16], tokens=f[17], heads=f[18], head_dim=f[19], slots=f[20], frames=frames,
            frame_h=f[22], frame_w=f[23], layer_start=f[24], token_start=f[25],
            fingerprint=bytes(mv[pos : pos + fp_len]).decode(),
            side=bytes(mv[pos + fp_len : pos + fp_len + side_len]),
            frame_sums=list(struct.unpack_from(f"<{frames}I", mv, pos + fp_len + side_len)),
            video_crc=video_crc, video_offset=end_head + 4, video_len=video_len,
        )  # fmt: skip
    except (KeyError, UnicodeDecodeError) as e:
        raise CodecError(f"video segment header has an invalid field: {e!r}") from e
    if hdr.depth not in (8, 10, 12):
        raise CodecError(f"invalid pixel bit depth {hdr.depth}")
    return hdr


def frame_checksum(frame: torch.Tensor | np.ndarray, index: int) -> int:
    """Position-weighted sum of a frame's integers mod ``2**31 - 1`` (exact integer arithmetic, so the
    numpy (CPU) and torch (GPU) computations agree)."""
    if isinstance(frame, np.ndarray):
        x = frame.reshape(-1).astype(np.int64)
        w = (np.arange(x.size, dtype=np.int64) + index * 7919) % 65521 + 1
        return int((x * w).sum() % _MOD)
    x = frame.reshape(-1).to(torch.int64)
    w = (torch.arange(x.numel(), device=x.device, dtype=torch.int64) + index * 7919) % 65521 + 1
    return int((x * w).sum().remainder(_MOD))
