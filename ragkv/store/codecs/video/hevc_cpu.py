"""HEVC lossless encode/decode on the CPU with PyAV (libx265 encoder, FFmpeg's hevc decoder).

Frames are integer arrays ``[P, H, W]`` (uint8 for 8-bit, uint16 for 10/12-bit) written straight into
the planes of an ``av.VideoFrame`` and read straight back from the decoded frame's planes: never
through ``to_ndarray(format=...)``/swscale, whose range conversions are not exact.

The bitstream is raw Annex-B HEVC (no container: a container adds bytes and nothing we need, the
blob header carries the geometry). Encoder settings follow the paper where it is specific
(``lossless=1``, P-frames only, at most 3 reference frames) and are otherwise chosen for small
streams: no encoder-info SEI, no AUD, no picture-hash SEI (our own per-frame checksums are in the
blob header), a single I-frame (no scene cuts, keyint past the last frame).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np

try:  # PyAV is the ``video`` extra
    import av

    HAVE_PYAV = True
except ImportError:  # pragma: no cover - exercised only without the extra
    av = None
    HAVE_PYAV = False

DEFAULT_PRESET = "medium"
DEFAULT_X265 = "bframes=0:ref=3:subme=0:me=dia:scenecut=0:info=0:aud=0:hash=0:log-level=error"


class HevcError(RuntimeError):
    """The encoder or decoder failed (missing libx265, corrupt bitstream ...)."""


def pixel_format(planes: str, depth: int) -> str:
    """FFmpeg pixel format for a plane mode and bit depth (8, 10 or 12)."""
    base = {"yuv444": "yuv444p", "gray": "gray", "yuv420": "yuv420p"}[planes]
    return base if depth == 8 else f"{base}{depth}le"


def check_available() -> None:
    """Raise :class:`HevcError` unless PyAV with libx265 and the hevc decoder is installed."""
    if not HAVE_PYAV:
        raise HevcError("the video codec needs PyAV: pip install 'ragkv[video]' (av)")
    have = av.codecs_available
    if "libx265" not in have or "hevc" not in have:
        raise HevcError("this PyAV build lacks libx265 or the hevc decoder")


def encode_frames(
    frames: np.ndarray,
    planes: str,
    depth: int,
    preset: str = DEFAULT_PRESET,
    x265_params: str = DEFAULT_X265,
    threads: int = 0,
    encoder: str = "libx265",
) -> bytes:
    """Encode ``frames [F, P, H, W]`` losslessly; returns the raw HEVC bitstream.

    ``encoder="nvenc"`` uses FFmpeg's ``hevc_nvenc`` with ``tune=lossless`` (8-bit ``yuv444`` /
    ``yuv420`` only: NVENC takes >8-bit samples MSB-aligned, which this path does not do). It needs
    an NVIDIA driver at run time and could not be exercised here; callers verify every stream by
    decoding it back, so a non-lossless result is never stored.
    """
    check_available()
    n_f, n_p, h, w = frames.shape
    pix = pixel_format(planes, depth)
    if encoder == "nvenc":
        if depth != 8 or planes == "gray":
            raise HevcError("the NVENC path encodes 8-bit yuv444 or yuv420 only")
        codec_name = "hevc_nvenc"
        options = {"tune": "lossless", "preset": "p4", "bf": "0", "g": str(n_f + 1), "refs": "3"}
        if planes == "yuv444":
            options["profile"] = "rext"
    elif encoder == "libx265":
        codec_name = "libx265"
        params = f"lossless=1:keyint={n_f + 1}:min-keyint={n_f + 1}" + (
            f":{x265_params}" if x265_params else ""
        )
        if threads:
            params += f":pools={threads}:frame-threads=1"
        options = {"preset": preset, "x265-params": params}
    else:
        raise HevcError(f"unknown HEVC encoder {encoder!r} (libx265 or nvenc)")
    buf = io.BytesIO()
    try:
        with av.open(buf, "w", format="hevc") as out:
            stream = out.add_stream(codec_name, rate=25)
            stream.width, stream.height, stream.pix_fmt = w, h, pix
            stream.options = options
            fill = 1 << (depth - 1)
            for f in range(n_f):
                vf = av.VideoFrame(w, h, pix)
                for p, plane in enumerate(vf.planes):
                    arr = _plane_view(plane, depth)
                    if p < n_p:
                        arr[:, :w] = frames[f, p]
                    else:  # chroma of yuv420: flat, never read back
                        arr[...] = fill
                vf.pts = f
                for pkt in stream.encode(vf):
                    out.mux(pkt)
            for pkt in stream.encode(None):
                out.mux(pkt)
    except (av.FFmpegError, OSError) as e:  # no driver: PermissionError from avcodec_open2
        raise HevcError(f"{codec_name} encode failed: {e}") from e
    return buf.getvalue()


def decode_frames(
    data: bytes | memoryview, planes: int, depth: int, height: int, width: int, threads: int = 1
) -> Iterator[np.ndarray]:
    """Decode a raw HEVC bitstream; yields each frame's first ``planes`` planes ``[P, H, W]`` in display order.

    Raises :class:`HevcError` for a bitstream FFmpeg cannot decode or frames of the wrong geometry.
    """
    check_available()
    try:
        with av.open(io.BytesIO(bytes(data)), "r", format="hevc") as cont:
            stream = cont.streams.video[0]
            stream.codec_context.thread_count = threads
            for frame in cont.decode(stream):
                if frame.width != width or frame.height != height:
                    raise HevcError(
                        f"decoded a {frame.width}x{frame.height} frame, expected {width}x{height}"
                    )
                out = np.empty((planes, height, width), dtype=np.uint8 if depth == 8 else np.uint16)
                for p in range(planes):
                    out[p] = _plane_view(frame.planes[p], depth)[:, :width]
                yield out
    except av.FFmpegError as e:
        raise HevcError(f"hevc decode failed: {e}") from e


def _plane_view(plane, depth: int) -> np.ndarray:
    """Writable 2-D view of a plane's pixels ``[height, line_size / bytes_per_sample]``."""
    dtype = np.uint8 if depth == 8 else np.dtype("<u2")
    arr = np.frombuffer(plane, dtype=dtype)
    return arr.reshape(plane.height, plane.line_size // arr.itemsize)
