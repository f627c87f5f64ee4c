"""The ``video`` store codec: quantize, lay out as frames, HEVC-lossless encode; decode frame by frame.

``encode(k, v)`` turns one layer group ``[G, T, Hkv, D]`` into a self-describing segment
(:mod:`.container`); ``decode`` / :meth:`VideoCodec.decode_into` / :meth:`VideoCodec.restore_frames`
restore it frame by frame into preallocated tensors, on the CPU (PyAV) or, when the output lives on
a CUDA device and PyNvVideoCodec is present, on NVDEC (any hardware decoder registered in
:mod:`.backends`). Every frame's integers are checked against the header's checksum *before* they
are written, so a corrupt video raises :class:`CodecError` instead of ever yielding wrong KV (rows
already written by then belong to verified frames). With ``decoder="auto"`` a hardware decoder that
refuses a stream, or returns a frame failing its checksum, hands the stream to the CPU decoder (with
a warning), which resumes after the frames already restored.

"Lossless" here means bit-exact to the quantized integers: ``decode(encode(x))`` equals
:meth:`VideoCodec.quantized_reference` ``(x)`` exactly, for every resolution version.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import zstandard

from ragkv.store.codecs.base import CodecError, KVCodec, log_once
from ragkv.store.codecs.video import backends, container, hevc_cpu, nvdec
from ragkv.store.codecs.video.container import VideoHeader, frame_checksum
from ragkv.store.codecs.video.hevc_cpu import DEFAULT_PRESET, DEFAULT_X265, HevcError
from ragkv.store.codecs.video.layout import (
    ORDER_MODES,
    PLANE_MODES,
    FrameLayout,
    LayoutError,
    Tiling,
    default_tiling,
)
from ragkv.store.codecs.video.order import greedy_chain, pack_orders, packed_size, unpack_orders
from ragkv.store.codecs.video.quantize import (
    QuantConfig,
    QuantizedTensor,
    dequantize,
    quantize,
    scale_of,
)

log = logging.getLogger("ragkv.store.video")

DECODERS = ("auto", "cpu", "nvdec")  # plus any other name registered in .backends
ENCODERS = ("libx265", "nvenc", "auto")  # auto: NVENC when it works here, else libx265
#: ``small_frames``: frames below NVDEC's minimum size are decoded on the CPU ("route") or encoded
#: padded up to it ("pad": flat padding; costs bytes and CPU decode time, measured in docs/GPU.md)
SMALL_FRAMES = ("route", "pad")
#: safer encoder settings tried when a stream fails the encode-time lossless check
_FALLBACKS = (
    ("ultrafast", DEFAULT_X265),
    ("ultrafast", DEFAULT_X265 + ":keyint=1:min-keyint=1"),  # intra only: no inter prediction at all
)
#: ``order="auto"``: per-tensor token orders from this many channels per layer, one per group below
AUTO_ORDER_MIN_CHANNELS = 128
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
        k_step: float = 0.35,
        v_step: float = 0.5,
        k_axis: str = "channel",
        v_axis: str = "channel",
        k_bits: int | None = None,
        v_bits: int | None = None,
        planes: str = "yuv420",
        group_layers: int = 3,
        slots: int = 16,
        tiling: Sequence[int] | None = None,
        order: str = "auto",
        preset: str = DEFAULT_PRESET,
        x265_params: str = DEFAULT_X265,
        threads: int = 0,
        decoder: str = "auto",
        fingerprint: str | None = None,
        verify: bool = True,
        encoder: str = "libx265",
        k_layer_steps: Sequence[float] | None = None,
        v_layer_steps: Sequence[float] | None = None,
        small_frames: str = "route",
    ) -> None:
        self.k_quant = QuantConfig(bits=int(k_bits or bits), mode=mode, axis=k_axis, step=float(k_step))
        self.v_quant = QuantConfig(bits=int(v_bits or bits), mode=mode, axis=v_axis, step=float(v_step))
        if planes not in PLANE_MODES:
            raise ValueError(f"planes must be one of {PLANE_MODES}, got {planes!r}")
        if order not in (*ORDER_MODES, "auto"):
            raise ValueError(f"order must be 'auto' or one of {ORDER_MODES}, got {order!r}")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
        if decoder not in (*DECODERS, *backends.registered()):
            raise ValueError(
                f"decoder must be 'auto', 'cpu' or a registered hardware decoder, got {decoder!r}"
            )
        if small_frames not in SMALL_FRAMES:
            raise ValueError(f"small_frames must be one of {SMALL_FRAMES}, got {small_frames!r}")
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
        self.verify = bool(verify)
        self.encoder = encoder
        self.small_frames = small_frames
        #: which decoder restored each segment ("cpu", "nvdec", "cpu-fallback") and which encoder wrote
        #: each stream: what actually ran, for benchmarks and tests
        self.decoded_by: Counter = Counter()
        self.encoded_by: Counter = Counter()
        self._count_lock = threading.Lock()
        #: how frames are restored into CPU outputs: "numpy" (default, fast) or "torch" (the GPU code
        #: path, selectable on the CPU so that its bit-exactness can be tested without a GPU)
        self.restore_backend = "numpy"
        self.layer_steps = [
            None if x is None else tuple(float(a) for a in x) for x in (k_layer_steps, v_layer_steps)
        ]
        for steps in self.layer_steps:
            if steps is not None and not all(a > 0 for a in steps):
                raise ValueError("per-layer step multipliers must be positive")
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
            "encoder": self.encoder,
            "small_frames": self.small_frames,
            "k_layer_steps": list(self.layer_steps[0]) if self.layer_steps[0] else None,
            "v_layer_steps": list(self.layer_steps[1]) if self.layer_steps[1] else None,
        }

    def with_slots(self, slots: int) -> VideoCodec:
        """The same codec writing another resolution version."""
        runtime = {"threads": self.threads, "decoder": self.decoder, "verify": self.verify}
        return VideoCodec(**(self.params() | {"slots": int(slots)}), **runtime, fingerprint=self.fingerprint)

    # -- encode -------------------------------------------------------------------------------------
    def _steps(self, which: int, layer_start: int | None, g: int) -> np.ndarray | None:
        steps = self.layer_steps[which]
        if steps is None:
            return None
        if layer_start is None:
            raise ValueError("this video codec allocates steps per layer: pass encode(..., layer_start=...)")
        if layer_start + g > len(steps):
            raise ValueError(
                f"per-layer steps cover {len(steps)} layers, group ends at layer {layer_start + g}"
            )
        return np.asarray(steps[layer_start : layer_start + g])

    def quantize(
        self, k: torch.Tensor, v: torch.Tensor, layer_start: int | None = None
    ) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The integers the video carries (exposed for benchmarks comparing coders on the same integers)."""
        _check_kv(k, v)
        g = k.shape[0]
        return (
            quantize(k, self.k_quant, self._steps(0, layer_start, g)),
            quantize(v, self.v_quant, self._steps(1, layer_start, g)),
        )

    def quantized_reference(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        dtype: torch.dtype | None = None,
        layer_start: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """KV after quantization alone (no video): what decoding the video must reproduce exactly."""
        qk, qv = self.quantize(k, v, layer_start)
        out = dtype or k.dtype
        shape = tuple(k.shape)
        return qk.dequantize(out).reshape(shape), qv.dequantize(out).reshape(shape)

    def order_mode(self, channels: int) -> str:
        """The token-order mode used for layers of ``channels`` (= Hkv * D) channels.

        ``auto``: one permutation per tensor (K, V) when a token row is wide enough that its
        ``log2 T`` bits are negligible (>= 128 channels), else one per layer group (measured in
        docs/VIDEO_CODEC.md: per-layer orders cost more than they save on narrow models).
        """
        if self.order != "auto":
            return self.order
        return "tensor" if channels >= AUTO_ORDER_MIN_CHANNELS else "group"

    def token_orders(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stored orders ``[n, T]``, expanded ``[2, G, T]``) for integers ``q [2, G, T, C]``."""
        _, g, t, c = q.shape
        mode = self.order_mode(c)
        if mode == "none":
            stored = np.zeros((0, t), np.int64)
        elif mode == "group":
            stored = greedy_chain(q.transpose(2, 0, 1, 3).reshape(t, -1))[None]
        elif mode == "tensor":
            stored = np.stack([greedy_chain(q[s].transpose(1, 0, 2).reshape(t, -1)) for s in range(2)])
        else:
            stored = np.stack([greedy_chain(q[s, layer]) for s in range(2) for layer in range(g)])
        return stored, _expand_orders(stored, mode, g, t)

    def layout_for(self, g: int, t: int, h: int, d: int, slots: int | None = None) -> FrameLayout:
        tiling = Tiling(*self.tiling) if self.tiling else default_tiling(h, d)
        return FrameLayout(g, t, h, d, tiling, slots or self.slots, self.planes, self.min_frame())

    def min_frame(self) -> tuple[int, int]:
        """Smallest frame this codec writes: NVDEC's documented HEVC minimum with ``small_frames="pad"``.

        The documented constant, not this machine's caps, so that a blob encoded on any machine
        decodes on every NVDEC (a GPU reporting a smaller minimum also takes the larger frames).
        """
        if self.small_frames == "pad" and self.planes in nvdec.NVDEC_PLANES:
            return nvdec.HEVC_MIN_SIZE
        return (16, 16)

    def _count(self, counter: Counter, name: str) -> None:
        with self._count_lock:
            counter[name] += 1

    def encode(
        self, k: torch.Tensor, v: torch.Tensor, *, layer_start: int | None = None, token_start: int = 0
    ) -> bytes:
        """``k``, ``v``: ``[G, T, Hkv, D]`` with ``G <= group_size``; returns the segment bytes.

        ``layer_start`` (the group's first layer in the chunk) is recorded in the header and is
        required when per-layer steps are configured; ``token_start`` is recorded only.
        """
        segs = self.encode_versions(k, v, [self.slots], layer_start=layer_start, token_start=token_start)
        return segs[self.slots]

    def encode_versions(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        versions: Iterable[int] = DEFAULT_VERSIONS,
        *,
        layer_start: int | None = None,
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
        qk, qv = self.quantize(k, v, layer_start)
        q = np.stack([qk.q, qv.q])
        stored, orders = self.token_orders(q)
        stats = [a.tobytes() for qt in (qk, qv) for a in (qt.code, qt.offset)]
        side = zstandard.ZstdCompressor(level=19).compress(b"".join([*stats, pack_orders(stored, t)]))
        fill = self.k_quant.zero or (1 << (self.depth - 1))
        out: dict[int, bytes] = {}
        for slots in versions:
            try:
                layout = self.layout_for(g, t, h, d, int(slots))
            except LayoutError as e:
                raise ValueError(str(e)) from e
            frames = layout.pack(q, orders, fill, dtype=np.uint8 if self.depth == 8 else np.uint16)
            video = self._encode_verified(frames)
            sums = [frame_checksum(frames[f], f) for f in range(len(frames))]
            fh, fw = layout.frame_shape
            hdr = VideoHeader(
                planes=self.planes, depth=self.depth, order=self.order_mode(h * d), dtype=k.dtype,
                tiling=(layout.tiling.a, layout.tiling.b),
                k_quant=_qtuple(self.k_quant), v_quant=_qtuple(self.v_quant),
                layers=g, tokens=t, heads=h, head_dim=d, slots=layout.slots, frames=layout.num_frames,
                frame_h=fh, frame_w=fw, layer_start=layer_start or 0, token_start=token_start,
                fingerprint=self.fingerprint or "", side=side, frame_sums=sums,
            )  # fmt: skip
            out[int(slots)] = container.pack(hdr, video)
        return out

    def _encode_verified(self, frames: np.ndarray) -> bytes:
        """Encode and, with ``verify``, decode back and compare; retry with safer x265 settings on a mismatch.

        libx265 "lossless" is not always lossless: with sub-pixel motion estimation on these tiny
        frames it sometimes (nondeterministically, ~30% of encodes of one measured group) emitted
        streams that decode to a few wrong pixels. ``subme=0`` removed it in 100+ trials (KV has no
        sub-pixel motion to find anyway), and this check makes sure no such stream is ever stored.
        """
        attempts: list[tuple[str, str, str]] = []
        if self.encoder in ("nvenc", "auto"):
            fmt = f"{self.planes}/{self.depth}-bit"
            ok, reason = False, f"the NVENC path encodes 8-bit yuv444/yuv420 only, not {fmt}"
            if self.depth == 8 and self.planes in nvdec.NVDEC_PLANES:
                ok, reason = nvdec.nvenc_status()
            if ok:
                attempts.append(("nvenc", self.preset, self.x265_params))
            elif self.encoder == "nvenc":
                raise CodecError(
                    f"NVENC requested but unavailable: {reason}; use encoder='libx265' or 'auto'"
                )
            else:  # said once per process (a warning when a GPU is present)
                level = logging.INFO if reason == "no CUDA device" else logging.WARNING
                log_once(
                    log, level, ("nvenc", reason), "NVENC unavailable (%s): encoding with libx265", reason
                )
        if self.encoder in ("libx265", "auto"):
            attempts.append(("libx265", self.preset, self.x265_params))
            attempts += [
                ("libx265", p, x) for p, x in _FALLBACKS if (p, x) != (self.preset, self.x265_params)
            ]
        n_f, n_p, fh, fw = frames.shape
        for encoder, preset, params in attempts:
            try:
                video = hevc_cpu.encode_frames(
                    frames, self.planes, self.depth, preset, params, self.threads, encoder
                )
            except HevcError as e:
                if encoder == "nvenc" and len(attempts) > 1:
                    log.warning("NVENC encode failed (%s); falling back to libx265", e)
                    continue
                raise CodecError(str(e)) from e
            if not self.verify:
                self._count(self.encoded_by, encoder)
                return video
            try:
                got = list(hevc_cpu.decode_frames(video, n_p, self.depth, fh, fw))
            except HevcError:
                got = []
            if len(got) == n_f and all(np.array_equal(a, b) for a, b in zip(got, frames, strict=True)):
                self._count(self.encoded_by, encoder)
                return video
            log.warning(
                "%s output did not decode losslessly (preset=%s %s); retrying", encoder, preset, params
            )
        raise CodecError("could not produce a lossless HEVC stream for this layer group")

    # -- decode -------------------------------------------------------------------------------------
    def peek_shape(self, data: bytes | memoryview) -> tuple[int, int, int, int]:
        hdr = container.unpack(data)
        return (hdr.layers, hdr.tokens, hdr.heads, hdr.head_dim)

    def header(self, data: bytes | memoryview) -> VideoHeader:
        """Parsed and verified header; raises :class:`CodecError` on corrupt or foreign bytes."""
        hdr = container.unpack(data)
        if self.fingerprint and hdr.fingerprint and hdr.fingerprint != self.fingerprint:
            raise CodecError(
                f"video segment was encoded for model {hdr.fingerprint[:16]}..., not {self.fingerprint[:16]}..."
            )
        return hdr

    def decode(
        self,
        data: bytes | memoryview,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hdr = self.header(data)
        shape = (hdr.layers, hdr.tokens, hdr.heads, hdr.head_dim)
        k = torch.empty(shape, dtype=dtype or hdr.dtype, device=device or "cpu")
        v = torch.empty_like(k)
        self.decode_into(data, k, v, header=hdr)
        return k, v

    def decode_into(self, data, out_k, out_v, start=0, stop=None, header=None) -> None:
        """Restore layers ``[start, stop)`` of the group into preallocated ``out_k``, ``out_v`` (store
        protocol): :meth:`restore_frames` run to the end."""
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
                hdr.layers, hdr.tokens, hdr.heads, hdr.head_dim, Tiling(*hdr.tiling), hdr.slots, hdr.planes,
                min_frame=(hdr.frame_h, hdr.frame_w),  # frames may be padded (small_frames="pad")
            )  # fmt: skip
        except LayoutError as e:
            raise CodecError(f"video segment header describes an invalid layout: {e}") from e
        if layout.num_frames != hdr.frames or layout.frame_shape != (hdr.frame_h, hdr.frame_w):
            raise CodecError("video segment header geometry is inconsistent")
        stats, orders = self._side(hdr)
        dev = out_k.device
        sel = slice(start, stop)
        g = stop - start
        quants = (hdr.k_quant, hdr.v_quant)
        zeros = [QuantConfig(bits=q[0], mode=q[1], axis=q[2], step=q[3]).zero for q in quants]
        per_token = [q[2] == "token" for q in quants]
        idx = layout.tiling.untile_index(hdr.heads, hdr.head_dim)
        scales = [(scale_of(code[sel]), np.array(off[sel], dtype=np.int32)) for code, off in stats]
        orders = np.ascontiguousarray(orders[:, sel])
        lay = np.arange(g)[:, None]
        use_numpy = dev.type == "cpu" and self.restore_backend != "torch"
        if use_numpy:
            # numpy on the CPU: single-threaded, no per-op dispatch; torch's intra-op thread pool made
            # these small per-frame ops 100x slower on a loaded 2-core machine (measured)
            writers = [_numpy_writer(out_k), _numpy_writer(out_v)]
        else:
            idx = torch.as_tensor(idx, device=dev)
            scales = [(torch.as_tensor(a, device=dev), torch.as_tensor(b, device=dev)) for a, b in scales]
            orders = torch.as_tensor(orders, device=dev)
            lay = torch.as_tensor(lay, device=dev)
            writers = [_torch_writer(out_k), _torch_writer(out_v)]
        count = 0
        for f, frame in enumerate(self._frames(hdr, data, dev, as_numpy=use_numpy)):
            valid = layout.valid_slots(f)
            pos = layout.chain_positions(f)[valid]
            if not use_numpy:
                valid, pos = torch.as_tensor(valid, device=dev), torch.as_tensor(pos, device=dev)
            tiles = layout.unpack_frame(frame, idx)[:, sel][:, :, valid]
            for s in range(2):
                tok = orders[s][:, pos]  # [G, n] token index of each restored tile
                scale, offset = scales[s]
                if per_token[s]:  # per-token statistics: each restored token's own
                    scale, offset = scale[lay, tok], offset[lay, tok]
                vals = dequantize(tiles[s], scale, offset, zeros[s])
                writers[s](lay, tok, vals.reshape(g, -1, hdr.heads, hdr.head_dim))
            count += 1
            yield f
        if count != hdr.frames:
            raise CodecError(f"video ended after {count} of {hdr.frames} frames (truncated)")

    def _frames(
        self, hdr: VideoHeader, data: bytes | memoryview, dev: torch.device, as_numpy: bool
    ) -> Iterator:
        """Decoded frames, each verified against its checksum: numpy arrays for numpy restores, integer
        tensors on ``dev`` otherwise. A hardware decoder (NVDEC) is used when one serves ``dev`` and
        accepts the stream; under ``auto`` its refusal or a frame failing its checksum hands the rest
        of the stream to the CPU decoder, which skips the frames already yielded."""
        video = memoryview(data)[hdr.video_offset :]
        n_p = 3 if hdr.planes == "yuv444" else 1
        geometry = (hdr.planes, hdr.depth, hdr.frame_h, hdr.frame_w)
        hw, why = backends.select_decoder(self.decoder, *geometry, dev)
        if hw is None and self.decoder not in ("auto", "cpu"):
            raise CodecError(f"{self.decoder} requested but cannot decode this stream on {dev}: {why}")
        done = 0
        if hw is not None:
            try:
                for t in hw.decode_frames(video, hdr.planes, n_p, hdr.depth, hdr.frame_h, hdr.frame_w, dev):
                    if done >= hdr.frames:
                        raise CodecError("video has more frames than its header")
                    if tuple(t.shape) != (n_p, hdr.frame_h, hdr.frame_w):
                        raise backends.DecoderRefused(f"{hw.name} returned a frame of shape {tuple(t.shape)}")
                    if frame_checksum(t, done) != hdr.frame_sums[done]:
                        raise backends.DecoderRefused(f"{hw.name} frame {done} fails its checksum")
                    yield _as_numpy(t, hdr.depth) if as_numpy else t
                    done += 1
                if done == hdr.frames:
                    self._count(self.decoded_by, hw.name)
                    return
                raise backends.DecoderRefused(f"{hw.name} stopped after {done} of {hdr.frames} frames")
            except CodecError:
                raise
            except RuntimeError as e:  # DecoderRefused, and NVDEC's own errors (RuntimeError subclasses)
                if self.decoder != "auto":
                    raise CodecError(f"{hw.name} decode failed: {e}") from e
                backends.note_refusal(hw.name, *geometry)
                log.warning(
                    "%s refused a %dx%d %s/%d-bit stream after %d of %d frames (%s); decoding it on the CPU",
                    hw.name, hdr.frame_w, hdr.frame_h, hdr.planes, hdr.depth, done, hdr.frames, e,
                )  # fmt: skip
        try:
            threads = max(1, self.threads)
            f = -1
            for f, arr in enumerate(
                hevc_cpu.decode_frames(video, n_p, hdr.depth, hdr.frame_h, hdr.frame_w, threads)
            ):
                if f >= hdr.frames:
                    raise CodecError("video has more frames than its header")
                if f < done:  # restored already from the hardware decoder's verified frames
                    continue
                if frame_checksum(arr, f) != hdr.frame_sums[f]:
                    raise CodecError(f"frame {f} fails its checksum (corrupt video)")
                if as_numpy:
                    yield arr
                else:  # CPU decode, restore with torch on the device
                    yield torch.from_numpy(arr.astype(np.int32)).to(dev)
        except HevcError as e:
            raise CodecError(f"video does not decode: {e}") from e
        if f + 1 < done:
            raise CodecError("the CPU decoder found fewer frames than the hardware decoder")
        self._count(self.decoded_by, "cpu-fallback" if hw is not None else "cpu")

    def _side(self, hdr: VideoHeader) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Scale codes and offsets per tensor, and the expanded token orders ``[2, G, T]``, from the side section."""
        g, t, c = hdr.layers, hdr.tokens, hdr.heads * hdr.head_dim
        shapes = [(g, 1, c) if q[2] == "channel" else (g, t, 1) for q in (hdr.k_quant, hdr.v_quant)]
        n_orders = {"none": 0, "group": 1, "tensor": 2, "layer": 2 * g}[hdr.order]
        parts = [(shape, dt) for shape in shapes for dt in (np.int8, np.int32)]
        want = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in parts)
        want += packed_size(n_orders, t)
        try:
            raw = zstandard.ZstdDecompressor().decompress(hdr.side, max_output_size=want)
        except zstandard.ZstdError as e:
            raise CodecError(f"video side info does not decompress: {e}") from e
        if len(raw) != want:
            raise CodecError("video side info has the wrong size")
        arrays, pos = [], 0
        for shape, dt in parts:
            n = int(np.prod(shape))
            arrays.append(np.frombuffer(raw, dtype=dt, count=n, offset=pos).reshape(shape))
            pos += n * np.dtype(dt).itemsize
        try:
            stored = unpack_orders(raw[pos:], n_orders, t)
        except ValueError as e:
            raise CodecError(f"video side info: {e}") from e
        stats = [(arrays[0], arrays[1]), (arrays[2], arrays[3])]
        return stats, np.ascontiguousarray(_expand_orders(stored, hdr.order, g, t))


def _as_numpy(frame: torch.Tensor, depth: int) -> np.ndarray:
    """A hardware decoder's integer frame as the CPU decoder's array type (uint8 / uint16)."""
    return frame.cpu().numpy().astype(np.uint8 if depth == 8 else np.uint16)


def _numpy_writer(out: torch.Tensor):
    """``write(lay, tok, vals_f32)`` into a CPU tensor through numpy, rounding like torch (RNE)."""
    if out.dtype in (torch.float16, torch.float32, torch.float64):
        arr = out.numpy()

        def write(lay, tok, vals):
            arr[lay, tok] = vals  # numpy's float32 -> float16 cast rounds to nearest even, as torch does

        return write
    if out.dtype == torch.bfloat16:
        bits = out.view(torch.int16).numpy()

        def write_bf16(lay, tok, vals):
            b = np.ascontiguousarray(vals, dtype=np.float32).view(np.uint32)
            bits[lay, tok] = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).view(np.int16)

        return write_bf16
    raise CodecError(f"cannot restore KV into a {out.dtype} tensor")


def _torch_writer(out: torch.Tensor):
    def write(lay, tok, vals):
        out[lay, tok] = vals.to(out.dtype)

    return write


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
        raise ValueError(
            f"video codec needs k, v of one shape [G, T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError("video codec needs at least one layer and one token")


def _qtuple(q: QuantConfig) -> tuple[int, str, str, float]:
    return (q.bits, q.mode, q.axis, q.step)


def _pixel_depth(bits: int) -> int:
    """Smallest HEVC-supported pixel bit depth (8, 10, 12) holding ``bits``-bit integers."""
    return 8 if bits <= 8 else 10 if bits <= 10 else 12
