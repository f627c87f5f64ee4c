"""Optional GPU decode with NVDEC through PyNvVideoCodec: frames land in CUDA tensors, no host copy.

Import-guarded: ``import PyNvVideoCodec`` raises ``RuntimeError`` (not ``ImportError``) on machines
without the NVIDIA driver, so any exception means "not available". The raw HEVC bitstream is split
into access units with PyAV's demuxer (host side, cheap) and fed to the low-level decoder with
``OutputColorType.NATIVE``: planar YUV 4:4:4 (or NV12/P016 for 4:2:0) with no colour conversion,
which is what bit-exact integers need. 10/12-bit surfaces are 16-bit words with the sample in the
most significant bits (NVDEC's P016 / YUV444_16Bit convention), hence the shift.

Coverage: HEVC 4:4:4 (``yuv444``) needs a Turing or newer NVDEC; 4:2:0 (``yuv420``) works on every
NVDEC; monochrome (``gray``) streams are not decodable by NVDEC, so ``gray`` always decodes on the
CPU. Written against the PyNvVideoCodec 2.x API; it could not be run in this project's GPU-less
sandbox (its test is skipped without CUDA), see docs/VIDEO_CODEC.md.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Iterator

import torch

try:  # any failure (no wheel, no driver: RuntimeError) means NVDEC is not available
    import PyNvVideoCodec as nvc  # type: ignore[import-not-found]

    _NVC_OK = True
except Exception:  # noqa: BLE001 - the wheel raises RuntimeError without a driver
    nvc = None
    _NVC_OK = False

NVDEC_PLANES = ("yuv444", "yuv420")


def available() -> bool:
    """True when CUDA and PyNvVideoCodec (with a driver) are both usable."""
    return _NVC_OK and torch.cuda.is_available()


def supports(planes: str, depth: int) -> bool:
    """Whether a stream of this plane mode and bit depth can be decoded by NVDEC."""
    return available() and planes in NVDEC_PLANES and depth in (8, 10, 12)


def nvenc_possible(planes: str, depth: int) -> bool:
    """Whether trying FFmpeg's ``hevc_nvenc`` makes sense here (CUDA present, 8-bit, not monochrome)."""
    return torch.cuda.is_available() and depth == 8 and planes in NVDEC_PLANES


def decode_frames_cuda(
    data: bytes | memoryview,
    planes: str,
    num_planes: int,
    depth: int,
    height: int,
    width: int,
    gpu_id: int = 0,
) -> Iterator[torch.Tensor]:
    """Decode on NVDEC; yields ``[num_planes, height, width]`` int32 CUDA tensors in display order."""
    if not supports(planes, depth):
        raise RuntimeError(f"NVDEC cannot decode {planes} at {depth} bits here")
    import av

    dec = nvc.CreateDecoder(
        gpuid=gpu_id, codec=nvc.cudaVideoCodec.HEVC, cudacontext=0, cudastream=0,
        usedevicememory=True, outputColorType=nvc.OutputColorType.NATIVE,
    )  # fmt: skip
    shift = 16 - depth if depth > 8 else 0
    keep = []  # the parser copies the bitstream, but keep buffers alive until Decode returns

    def frames_of(packet_data) -> Iterator[torch.Tensor]:
        for frame in list(dec.Decode(packet_data)):
            t = torch.from_dlpack(frame)
            if depth > 8:
                t = t.view(torch.int16).to(torch.int32) & 0xFFFF
                t = t >> shift
            else:
                t = t.to(torch.int32)
            t = t.reshape(-1, t.shape[-1])[:, :width]  # planar rows: plane p = rows [p*H, (p+1)*H)
            yield torch.stack([t[p * height : (p + 1) * height] for p in range(num_planes)])

    with av.open(io.BytesIO(bytes(data)), "r", format="hevc") as cont:
        for pkt in cont.demux(cont.streams.video[0]):
            raw = bytes(pkt)
            if not raw:
                continue
            buf = ctypes.create_string_buffer(raw, len(raw))
            keep[:] = [buf]
            pd = nvc.PacketData()
            pd.bsl_data = ctypes.addressof(buf)
            pd.bsl = len(raw)
            yield from frames_of(pd)
    while True:  # flush: an empty packet returns the frames still held for display
        tail = list(frames_of(nvc.PacketData()))
        if not tail:
            break
        yield from tail
