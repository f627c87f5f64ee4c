"""The ``video`` store codec: quantize, lay out as frames, HEVC-lossless encode; decode frame by frame.

``encode(k, v)`` turns one layer group ``[G, T, Hkv, D]`` into a self-describing segment
(:mod:`.container`); ``decode`` / :meth:`VideoCodec.decode_into` / :meth:`VideoCodec.restore_frames`
restore it frame by frame into preallocated tensors, on the CPU (PyAV) or, when the output lives on
a CUDA device and PyNvVideoCodec is present, on NVDEC. Every frame's integers are checked against the
header's checksum *before* they are written, so a corrupt video raises :class:`CodecError` instead
of ever yielding wrong KV (rows already written by then belong to verified frames).

"Lossless" here means bit-exact to the quantized integers: ``decode(encode(x))`` equals
:meth:`VideoCodec.quantized_reference` ``(x)`` exactly, for every resolution version.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import zstandard

from ragkv.store.codecs.base import CodecError, KVCodec
from ragkv.store.codecs.video import container, hevc_cpu, nvdec
from ragkv.store.codecs.video.container import VideoHeader, frame_checksum
from ragkv.store.codecs.video.hevc_cpu import DEFAULT_PRESET, DEFAULT_X265, HevcError
from ragkv.store.codecs.video.layout import ORDER_MODES, PLANE_MODES, FrameLayout, LayoutError, Tiling, default_tiling
from ragkv.store.codecs.video.order import greedy_chain, pack_orders, packed_size, unpack_orders
from ragkv.store.codecs.video.quantize import QuantConfig, QuantizedTensor, dequantize, quantize

DECODERS = ("auto", "cpu", "nvdec")
#: default resolution versions (token slots per layer per frame); see docs/VIDEO_CODEC.md
DEFAULT_VERSIONS = (4, 16, 64)


class VideoCodec(KVCodec):
    """KV of one layer group as one lossless HEVC video; see the module docstring and docs/VIDEO_CODEC.md."""

    name = "video"
    lossless = False  # lossy vs the float KV (quantization); bit-exact vs the quantized integers

    def __init__(
        self,
        bits: int = 8,
        mode: str = "std",
        k_step: float = 0.5,
        v_step: float = 0.5,
        k_axis: str = "channel",
        v_axis: str = "channel",
        k_bits: int | None = None,
        v_bits: int | None = None,
        planes: str = "yuv444",
        group_layers: int = 3,
        slots: int = 16,
        tiling: Sequence[int] | None = None,
        order: str = "layer",
        preset: str = DEFAULT_PRESET,
        x265_params: str = DEFAULT_X265,
        threads: int = 0,
        decoder: str = "auto",
        fingerprint: str | None = None,
    ) -> None:
        self.k_quant = QuantConfig(bits=int(k_bits or bits), mode=mode, axis=k_axis, step=float(k_step))
        self.v_quant = QuantConfig(bits=int(v_bits or bits), mode=mode, axis=v_axis, step=float(v_step))
        if planes not in PLANE_MODES:
            raise ValueError(f"planes must be one of {PLANE_MODES}, got {planes!r}")
        if order not in ORDER_MODES:
            raise ValueError(f"order must be one of {ORDER_MODES}, got {order!r}")
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        if group_layers < 1 or (planes == "yuv444" and group_layers > 3):
            raise ValueError(f"group_layers must be 1..3 for yuv444 (>= 1 otherwise), got {group_layers}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.bits = int(bits)
        self.mode = mode
        self.planes = planes
        self.group_size = int(group_layers)
        self.slots = int(slots)
        self.tiling = tuple(int(x) for x in tiling) if tiling is not None else None
        if self.tiling is not None and len(self.tiling) != 2:
            raise ValueError(f"tiling must be (a, b), got {tiling!r}")
        self.order = order
        self.preset = preset
        self.x265_params = x265_params
        self.threads = int(threads)
        self.decoder = decoder
        self.fingerprint = fingerprint
        self.depth = _pixel_depth(max(self.k_quant.bits, self.v_quant.bits))

    def params(self) -> dict:
        return {
            "bits": self.bits,
            "mode": self.mode,
            "k_step": self.k_quant.step,
            "v_step": self.v_quant.step,
            "k_axis": self.k_quant.axis,
            "v_axis": self.v_quant.axis,
            "k_bits": self.k_quant.bits,
            "v_bits": self.v_quant.bits,
            "planes": self.planes,
            "group_layers": self.group_size,
            "slots": self.slots,
            "tiling": list(self.tiling) if self.tiling else None,
            "order": self.order,
            "preset": self.preset,
            "x265_params": self.x265_params,
        }

    def with_slots(self, slots: int) -> VideoCodec:
        """The same codec writing another resolution version."""
        kw = self.params() | {"slots": int(slots), "threads": self.threads, "decoder": self.decoder}
        return VideoCodec(**kw, fingerprint=self.fingerprint)

    # -- encode -------------------------------------------------------------------------------------
    def quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The integers the video carries (exposed for benchmarks comparing coders on the same integers)."""
        _check_kv(k, v)
        return quantize(k, self.k_quant), quantize(v, self.v_quant)

    def quantized_reference(
        self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV after quantization alone (no video): what decoding the video must reproduce exactly."""
        qk, qv = self.quantize(k, v)
        out = dtype or k.dtype
        shape = tuple(k.shape)
        return qk.dequantize(out).reshape(shape), qv.dequantize(out).reshape(shape)

    def token_orders(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stored orders ``[n, T]``, expanded ``[2, G, T]``) for integers ``q [2, G, T, C]``."""
        _, g, t, c = q.shape
        if self.order == "none":
            return np.zeros((0, t), np.int64), np.broadcast_to(np.arange(t), (2, g, t))
        if self.order == "group":
            stored = greedy_chain(q.transpose(2, 0, 1, 3).reshape(t, -1))[None]
        elif self.order == "tensor":
            stored = np.stack([greedy_chain(q[s].transpose(1, 0, 2).reshape(t, -1)) for s in range(2)])
        else:
            stored = np.stack([greedy_chain(q[s, layer]) for s in range(2) for layer in range(g)])
        return stored, _expand_orders(stored, self.order, g, t)

    def layout_for(self, g: int, t: int, h: int, d: int, slots: int | None = None) -> FrameLayout:
        tiling = Tiling(*self.tiling) if self.tiling else default_tiling(h, d)
        return FrameLayout(g, t, h, d, tiling, slots or self.slots, self.planes)

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, layer_start: int = 0, token_start: int = 0) -> bytes:
        """``k``, ``v``: ``[G, T, Hkv, D]`` with ``G <= group_size``; returns the segment bytes."""
        return self.encode_versions(k, v, [self.slots], layer_start=layer_start, token_start=token_start)[self.slots]

    def encode_versions(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        versions: Iterable[int] = DEFAULT_VERSIONS,
        *,
        layer_start: int = 0,
        token_start: int = 0,
    ) -> dict[int, bytes]:
        """One segment per resolution version (slots per frame), sharing quantization and token order."""
        _check_kv(k, v)
        g, t, h, d = k.shape
        if g > self.group_size:
            raise ValueError(f"a layer group has at most {self.group_size} layers here, got {g}")
        if k.dtype not in container.DTYPE_CODES:
            raise ValueError(f"video codec supports {list(container.DTYPE_CODES)}, got {k.dtype}")
        hevc_cpu.check_available()
        qk, qv = self.quantize(k, v)
        q = np.stack([qk.q, qv.q])
        stored, orders = self.token_orders(q)
        side_raw = b"".join(
            [qk.scale.tobytes(), qk.offset.tobytes(), qv.scale.tobytes(), qv.offset.tobytes(), pack_orders(stored, t)]
        )
        side = zstandard.ZstdCompressor(level=19).compress(side_raw)
        fill = self.k_quant.zero or (1 << (self.depth - 1))
        out: dict[int, bytes] = {}
        for slots in versions:
            try:
                layout = self.layout_for(g, t, h, d, int(slots))
            except LayoutError as e:
                raise ValueError(str(e)) from e
            frames = layout.pack(q, orders, fill, dtype=np.uint8 if self.depth == 8 else np.uint16)
            try:
                video = hevc_cpu.encode_frames(
                    frames, self.planes, self.depth, self.preset, self.x265_params, self.threads
                )
            except HevcError as e:
                raise CodecError(str(e)) from e
            sums = [frame_checksum(torch.from_numpy(frames[f].astype(np.int32)), f) for f in range(len(frames))]
            fh, fw = layout.frame_shape
            hdr = VideoHeader(
                planes=self.planes, depth=self.depth, order=self.order, dtype=k.dtype,
                tiling=(layout.tiling.a, layout.tiling.b),
                k_quant=_qtuple(self.k_quant), v_quant=_qtuple(self.v_quant),
                layers=g, tokens=t, heads=h, head_dim=d, slots=layout.slots, frames=layout.num_frames,
                frame_h=fh, frame_w=fw, layer_start=layer_start, token_start=token_start,
                fingerprint=self.fingerprint or "", side=side, frame_sums=sums,
            )  # fmt: skip
            out[int(slots)] = container.pack(hdr, video)
        return out

    # -- decode -------------------------------------------------------------------------------------
    def header(self, data: bytes | memoryview) -> VideoHeader:
        """Parsed and verified header; raises :class:`CodecError` on corrupt or foreign bytes."""
        hdr = container.unpack(data)
        if self.fingerprint and hdr.fingerprint and hdr.fingerprint != self.fingerprint:
            raise CodecError(
                f"video segment was encoded for model {hdr.fingerprint[:16]}..., not {self.fingerprint[:16]}..."
            )
        return hdr

    def decode(
        self, data: bytes | memoryview, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hdr = self.header(data)
        shape = (hdr.layers, hdr.tokens, hdr.heads, hdr.head_dim)
        k = torch.empty(shape, dtype=dtype or hdr.dtype, device=device or "cpu")
        v = torch.empty_like(k)
        self.decode_into(data, k, v, header=hdr)
        return k, v

    def decode_into(
        self,
        data: bytes | memoryview,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        start: int = 0,
        stop: int | None = None,
        header: VideoHeader | None = None,
    ) -> None:
        """Restore layers ``[start, stop)`` of the group into preallocated ``out_k``, ``out_v`` (store protocol)."""
        for _ in self.restore_frames(data, out_k, out_v, start, stop, header=header):
            pass

    def restore_frames(
        self,
        data: bytes | memoryview,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        start: int = 0,
        stop: int | None = None,
        header: VideoHeader | None = None,
    ) -> Iterator[int]:
        """Decode frame by frame into ``out_k``/``out_v`` (layers ``[start, stop)``), yielding each frame's index.

        Frame-wise restoration (KVFetcher section 3.3.2): no chunk-sized staging buffer, only one
        decoded frame at a time; rows written by a yielded frame are final. Raises
        :class:`CodecError` at the first frame that fails its checksum, before writing it.
        """
        hdr = header or self.header(data)
        stop = hdr.layers if stop is None else stop
        shape = (stop - start, hdr.tokens, hdr.heads, hdr.head_dim)
        if not 0 <= start < stop <= hdr.layers:
            raise CodecError(f"layers [{start}, {stop}) are not in this {hdr.layers}-layer segment")
        if tuple(out_k.shape) != shape or tuple(out_v.shape) != shape or out_k.device != out_v.device:
            raise CodecError(f"output tensors must both be {shape} on one device")
        try:
            layout = FrameLayout(
                hdr.layers, hdr.tokens, hdr.heads, hdr.head_dim, Tiling(*hdr.tiling), hdr.slots, hdr.planes
            )
        except LayoutError as e:
            raise CodecError(f"video segment header describes an invalid layout: {e}") from e
        if layout.num_frames != hdr.frames or layout.frame_shape != (hdr.frame_h, hdr.frame_w):
            raise CodecError("video segment header geometry is inconsistent")
        stats, orders = self._side(hdr)
        dev = out_k.device
        sel = slice(start, stop)
        idx = torch.as_tensor(layout.tiling.untile_index(hdr.heads, hdr.head_dim), device=dev)
        orders_t = torch.as_tensor(orders[:, sel], device=dev)
        stats_t = [tuple(torch.as_tensor(a[sel].astype(np.float32), device=dev) for a in st) for st in stats]
        quants = (hdr.k_quant, hdr.v_quant)
        zeros = [QuantConfig(bits=q[0], mode=q[1], axis=q[2], step=q[3]).zero for q in quants]
        lay = torch.arange(stop - start, device=dev)[:, None]
        count = 0
        for f, frame in enumerate(self._frames(hdr, data, dev)):
            if f >= hdr.frames:
                raise CodecError("video has more frames than its header")
            if frame_checksum(frame, f) != hdr.frame_sums[f]:
                raise CodecError(f"frame {f} fails its checksum (corrupt video)")
            valid = layout.valid_slots(f)
            pos = torch.as_tensor(layout.chain_positions(f)[valid], device=dev)
            tiles = layout.unpack_frame(frame, idx)[:, sel][:, :, torch.as_tensor(valid, device=dev)]
            for s, out in enumerate((out_k, out_v)):
                tok = orders_t[s][:, pos]  # [G, n] token index of each restored tile
                scale, offset = stats_t[s]
                if quants[s][2] == "token":  # per-token statistics: pick each restored token's
                    scale, offset = scale[lay, tok], offset[lay, tok]
                vals = dequantize(tiles[s], scale, offset, zeros[s], out.dtype)
                out[lay, tok] = vals.reshape(stop - start, -1, hdr.heads, hdr.head_dim)
            count += 1
            yield f
        if count != hdr.frames:
            raise CodecError(f"video ended after {count} of {hdr.frames} frames (truncated)")

    def _frames(self, hdr: VideoHeader, data: bytes | memoryview, dev: torch.device) -> Iterator[torch.Tensor]:
        """Decoded frames as integer tensors on ``dev`` (NVDEC when possible for CUDA outputs)."""
        video = memoryview(data)[hdr.video_offset :]
        n_p = 3 if hdr.planes == "yuv444" else 1
        use_gpu = dev.type == "cuda" and self.decoder != "cpu" and nvdec.supports(hdr.planes, hdr.depth)
        if self.decoder == "nvdec" and not use_gpu:
            raise CodecError(f"NVDEC requested but unavailable for {hdr.planes}/{hdr.depth}-bit on {dev}")
        try:
            if use_gpu:
                gpu = dev.index if dev.index is not None else torch.cuda.current_device()
                yield from nvdec.decode_frames_cuda(video, hdr.planes, n_p, hdr.depth, hdr.frame_h, hdr.frame_w, gpu)
                return
            threads = max(1, self.threads)
            for arr in hevc_cpu.decode_frames(video, n_p, hdr.depth, hdr.frame_h, hdr.frame_w, threads):
                t = torch.from_numpy(arr if arr.dtype == np.uint8 else arr.astype(np.int32))
                yield t.to(dev) if dev.type != "cpu" else t
        except HevcError as e:
            raise CodecError(f"video does not decode: {e}") from e
        except RuntimeError as e:  # NVDEC errors surface as RuntimeError subclasses
            raise CodecError(f"NVDEC decode failed: {e}") from e

    def _side(self, hdr: VideoHeader) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Scales/offsets per tensor and the expanded token orders ``[2, G, T]`` from the side section."""
        g, t, c = hdr.layers, hdr.tokens, hdr.heads * hdr.head_dim
        shapes = [(g, 1, c) if q[2] == "channel" else (g, t, 1) for q in (hdr.k_quant, hdr.v_quant)]
        n_orders = {"none": 0, "group": 1, "tensor": 2, "layer": 2 * g}[hdr.order]
        sizes = [int(np.prod(s)) * 2 for s in shapes for _ in range(2)]
        want = sum(sizes) + packed_size(n_orders, t)
        try:
            raw = zstandard.ZstdDecompressor().decompress(hdr.side, max_output_size=want)
        except zstandard.ZstdError as e:
            raise CodecError(f"video side info does not decompress: {e}") from e
        if len(raw) != want:
            raise CodecError("video side info has the wrong size")
        arrays, pos = [], 0
        for i, n in enumerate(sizes):
            arrays.append(np.frombuffer(raw, dtype=np.float16, count=n // 2, offset=pos).reshape(shapes[i // 2]))
            pos += n
        try:
            stored = unpack_orders(raw[pos:], n_orders, t)
        except ValueError as e:
            raise CodecError(f"video side info: {e}") from e
        stats = [(arrays[0], arrays[1]), (arrays[2], arrays[3])]
        return stats, np.ascontiguousarray(_expand_orders(stored, hdr.order, g, t))


def iter_decode_groups(
    codec: VideoCodec,
    segments: Iterable[bytes | memoryview],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Decode a chunk's segments one layer group at a time: yields ``(layer_start, k, v)`` as each finishes."""
    for data in segments:
        hdr = codec.header(data)
        k, v = codec.decode(data, device=device, dtype=dtype)
        yield hdr.layer_start, k, v


def _expand_orders(stored: np.ndarray, mode: str, g: int, t: int) -> np.ndarray:
    if mode == "none":
        return np.broadcast_to(np.arange(t), (2, g, t))
    if mode == "group":
        return np.broadcast_to(stored[0], (2, g, t))
    if mode == "tensor":
        return np.broadcast_to(stored[:, None, :], (2, g, t))
    return stored.reshape(2, g, t)


def _check_kv(k: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ValueError("k and v must be tensors")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"video codec needs k, v of one shape [G, T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError("video codec needs at least one layer and one token")


def _qtuple(q: QuantConfig) -> tuple[int, str, str, float]:
    return (q.bits, q.mode, q.axis, q.step)


def _pixel_depth(bits: int) -> int:
    """Smallest HEVC-supported pixel bit depth (8, 10, 12) holding ``bits``-bit integers."""
    return 8 if bits <= 8 else 10 if bits <= 10 else 12
