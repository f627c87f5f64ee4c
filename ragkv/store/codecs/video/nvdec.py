"""Optional GPU decode with NVDEC through PyNvVideoCodec: frames land in CUDA tensors, no host copy.

Import-guarded: ``import PyNvVideoCodec`` raises ``RuntimeError`` (not ``ImportError``) on machines
without the NVIDIA driver, so any exception means "not available". The raw HEVC bitstream is split
into access units with PyAV's demuxer (host side, cheap) and fed to the low-level decoder with
``OutputColorType.NATIVE``: planar YUV 4:4:4 (or NV12/P016 for 4:2:0) with no colour conversion,
which is what bit-exact integers need. 10/12-bit surfaces are 16-bit words with the sample in the
most significant bits (NVDEC's P016 / YUV444_16Bit convention), hence the shift.

Coverage: HEVC 4:4:4 (``yuv444``) needs a Turing or newer NVDEC; 4:2:0 (``yuv420``) works on every
NVDEC; monochrome (``gray``) streams are not decodable by NVDEC, so ``gray`` always decodes on the
CPU. 10/12-bit surfaces need PyNvVideoCodec >= 2.2.4 (earlier 2.x report 16-bit strides in samples,
not bytes). NVDEC has a minimum coded size per codec (``nMinWidth``/``nMinHeight`` of
``cuvidGetDecoderCaps``, read through ``GetDecoderCaps`` when a GPU is present; 144x144 for HEVC in
NVIDIA's decoder programming guide, the value used without one): smaller streams go to the CPU decoder
under ``decoder="auto"``, or can be encoded padded up to it (``VideoCodec(small_frames="pad")``).

NVENC (the optional encoder, :func:`nvenc_status`) is absent from data-centre GPUs such as A100, H100
and H200: FFmpeg's ``hevc_nvenc`` then fails to open, which is probed once per process and reported
in one clear message; ``encoder="auto"`` encodes with libx265 there.

Written against the PyNvVideoCodec 2.x API; see docs/VIDEO_CODEC.md and docs/GPU.md for what has run
on a GPU.
"""

from __future__ import annotations

import ctypes
import io
import logging
import re
import threading
from collections.abc import Iterator

import numpy as np
import torch

from ragkv.store.codecs.video.backends import DecoderRefused, HardwareDecoder, register_decoder

log = logging.getLogger("ragkv.store.video")

try:  # any failure (no wheel, no driver: RuntimeError) means NVDEC is not available
    import PyNvVideoCodec as nvc  # type: ignore[import-not-found]

    _NVC_OK = True
    IMPORT_ERROR = ""
except Exception as _e:  # noqa: BLE001 - the wheel raises RuntimeError without a driver
    nvc = None
    _NVC_OK = False
    IMPORT_ERROR = f"{type(_e).__name__}: {str(_e).splitlines()[0] if str(_e) else ''}"

NVDEC_PLANES = ("yuv444", "yuv420")
#: NVIDIA's documented minimum HEVC coded size (decoder programming guide, "Hardware Video Decoder
#: Capabilities"); the GPU's own caps replace it when they can be read
HEVC_MIN_SIZE = (144, 144)
#: PyNvVideoCodec release with the 16-bit surface stride fix that 10/12-bit frames need
MIN_VERSION_HIGH_DEPTH = (2, 2, 4)
_CHROMA = {"yuv420": "420", "yuv444": "444"}


def parse_version(text: str) -> tuple[int, ...]:
    """``"2.2.4"`` -> ``(2, 2, 4)`` (non-numeric tails such as ``rc1`` are dropped)."""
    out = []
    for part in str(text).split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
    return tuple(out)


def depth_ok_for_version(version: str, depth: int) -> bool:
    """Whether a PyNvVideoCodec ``version`` returns ``depth``-bit surfaces correctly (8-bit: any 2.x)."""
    return depth == 8 or parse_version(version) >= MIN_VERSION_HIGH_DEPTH


def available() -> bool:
    """True when CUDA and PyNvVideoCodec (with a driver) are both usable."""
    return _NVC_OK and torch.cuda.is_available()


def version() -> str:
    return str(getattr(nvc, "__version__", "")) if _NVC_OK else ""


def supports(planes: str, depth: int) -> bool:
    """Whether a stream of this plane mode and bit depth can be decoded by NVDEC (frame size aside)."""
    return (
        available()
        and planes in NVDEC_PLANES
        and depth in (8, 10, 12)
        and depth_ok_for_version(version(), depth)
    )


_CAPS: dict[tuple[int, str, int], dict] = {}
_CAPS_LOCK = threading.Lock()


def decoder_caps(planes: str, depth: int, gpu: int = 0) -> dict:
    """``GetDecoderCaps`` of this GPU for HEVC in this format (cached); ``{}`` when they cannot be read."""
    if not supports(planes, depth):
        return {}
    key = (gpu, planes, depth)
    with _CAPS_LOCK:
        if key not in _CAPS:
            try:
                caps = nvc.GetDecoderCaps(
                    gpuid=gpu, codec=nvc.cudaVideoCodec.HEVC,
                    chromaformat=getattr(nvc.cudaVideoChromaFormat, _CHROMA[planes]), bitdepth=depth,
                )  # fmt: skip
                _CAPS[key] = dict(caps)
            except Exception as e:  # noqa: BLE001 - older bindings, no caps entry point
                log.debug("GetDecoderCaps failed (%s); using the documented HEVC minimum", e)
                _CAPS[key] = {}
        return _CAPS[key]


def min_size(planes: str, depth: int, gpu: int = 0) -> tuple[int, int]:
    """NVDEC's minimum coded ``(height, width)`` for HEVC in this format: the GPU's caps, else 144x144."""
    caps = decoder_caps(planes, depth, gpu)
    h, w = int(caps.get("height_min", 0) or 0), int(caps.get("width_min", 0) or 0)
    return (h, w) if h > 0 and w > 0 else HEVC_MIN_SIZE


# -- NVENC -------------------------------------------------------------------------------------------
_NVENC: tuple[bool, str] | None = None
_NVENC_LOCK = threading.Lock()
NVENC_ABSENT_HINT = "data-centre GPUs such as A100, H100 and H200 have no NVENC engine"


def nvenc_status(refresh: bool = False, require_cuda: bool = True) -> tuple[bool, str]:
    """``(usable, reason)`` for FFmpeg's ``hevc_nvenc`` here, probed once per process by a real encode.

    ``require_cuda=False`` probes even without a CUDA device (FFmpeg then refuses for real): the
    refusal path is what an NVENC-less GPU takes, and it can be exercised on any machine this way.
    """
    global _NVENC
    with _NVENC_LOCK:
        if _NVENC is not None and not refresh:
            return _NVENC
        _NVENC = _probe_nvenc(require_cuda)
        return _NVENC


def _probe_nvenc(require_cuda: bool) -> tuple[bool, str]:
    from ragkv.store.codecs.video import hevc_cpu

    if require_cuda and not torch.cuda.is_available():
        return False, "no CUDA device"
    if not hevc_cpu.HAVE_PYAV or "hevc_nvenc" not in hevc_cpu.av.codecs_available:
        return False, "this FFmpeg (PyAV) build has no hevc_nvenc encoder"
    frames = np.full((1, 1, 256, 256), 128, dtype=np.uint8)
    try:
        hevc_cpu.encode_frames(frames, "yuv420", 8, encoder="nvenc")
    except hevc_cpu.HevcError as e:
        return False, f"hevc_nvenc does not open here ({NVENC_ABSENT_HINT}): {e}"
    return True, "hevc_nvenc encodes here"


class NvdecDecoder(HardwareDecoder):
    """NVDEC via PyNvVideoCodec, registered as ``"nvdec"`` (the codec's ``auto`` tries it for CUDA outputs)."""

    name = "nvdec"
    device_types = ("cuda",)

    def available(self) -> bool:
        return available()

    def supports_format(self, planes: str, depth: int) -> bool:
        return supports(planes, depth)

    def min_size(self, planes: str, depth: int) -> tuple[int, int]:
        return min_size(planes, depth, _gpu_index(None))

    def refusal(self, planes: str, depth: int, height: int, width: int) -> str | None:
        if not available():
            return f"NVDEC is not available here ({IMPORT_ERROR or 'no CUDA device'})"
        if planes in NVDEC_PLANES and not depth_ok_for_version(version(), depth):
            return f"{depth}-bit NVDEC frames need PyNvVideoCodec >= 2.2.4, found {version()}"
        return super().refusal(planes, depth, height, width)

    def decode_frames(self, data, planes, num_planes, depth, height, width, device) -> Iterator[torch.Tensor]:
        """Yields ``[num_planes, height, width]`` int32 CUDA tensors in display order; raises
        :class:`DecoderRefused` when NVDEC cannot take the stream (format, version, frame size, or the
        driver refusing the session): the codec's ``auto`` mode then decodes it on the CPU."""
        gpu_id = _gpu_index(device)
        if not supports(planes, depth):
            raise DecoderRefused(f"NVDEC cannot decode {planes} at {depth} bits here")
        mh, mw = min_size(planes, depth, gpu_id)
        if height < mh or width < mw:
            raise DecoderRefused(f"a {width}x{height} frame is below NVDEC's HEVC minimum of {mw}x{mh}")
        import av

        try:
            dec = nvc.CreateDecoder(
                gpuid=gpu_id, codec=nvc.cudaVideoCodec.HEVC, cudacontext=0, cudastream=0,
                usedevicememory=True, outputColorType=nvc.OutputColorType.NATIVE,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the bindings raise plain RuntimeError / ValueError
            raise DecoderRefused(f"NVDEC session could not be created: {e}") from e
        shift = 16 - depth if depth > 8 else 0
        keep = []  # the parser copies the bitstream, but keep buffers alive until Decode returns

        def frames_of(packet_data) -> Iterator[torch.Tensor]:
            try:
                decoded = list(dec.Decode(packet_data))
            except Exception as e:  # noqa: BLE001
                raise DecoderRefused(f"NVDEC refused the stream: {e}") from e
            for frame in decoded:
                t = torch.from_dlpack(frame)
                if depth > 8:
                    t = t.view(torch.int16).to(torch.int32) & 0xFFFF
                    t = t >> shift
                else:
                    t = t.to(torch.int32)
                t = t.reshape(-1, t.shape[-1])[:, :width]  # planar rows: plane p = rows [p*H, (p+1)*H)
                if t.shape[0] < num_planes * height:
                    raise DecoderRefused(
                        f"NVDEC returned a {tuple(t.shape)} surface for {height}x{width} frames"
                    )
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


def _gpu_index(device: torch.device | None) -> int:
    if device is not None and device.index is not None:
        return int(device.index)
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


register_decoder(NvdecDecoder())
