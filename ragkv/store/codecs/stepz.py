"""``stepz``: std-step quantization + zstd, per-layer steps and RoPE-aware key steps (compact default).

Per layer, K and V (``[T, Hkv, D]``) are quantized per (head, channel) over the chunk's tokens with
a step that is a fraction of the channel's standard deviation, ``step = s_layer * m * std`` (the
video codec's ``std`` mode, without the video stage), the integers are int8 and the segment is
zstd-compressed. Fixed-width int8/int4 spend the same bits on every value; step quantization plus
an entropy coder pays for what the values actually carry (docs/BENCHMARKS.md, "Compact stored KV").

The steps come from a :class:`StepProfile`, calibrated once per model (:mod:`.calibrate`) and kept
in ``$RAGKV_CACHE_DIR/stepz/<fingerprint>.json``:

* ``k_steps[l]``, ``v_steps[l]``: per-layer steps; by default uniform (:data:`FALLBACK`'s), or
  allocated from measured blend sensitivity (``calibrate(..., sensitivity=...)``; measured to keep
  the KL but change more answers on the default model, so off by default);
* ``k_bits[l][h][j]``: integer bits per RoPE frequency block ``j`` of key head ``h`` (Block-GTQ's
  idea, :func:`ragkv.model.rope_energy.allocate_block_bits`); block ``j`` gets the step multiplier
  ``m = 2 ** (base_bits - bits)``. Deviation from Block-GTQ: the paper allocates bit widths of a
  TurboQuant-MSE quantizer of post-RoPE keys; here keys are stored pre-RoPE (the chunk convention)
  and coded with a step quantizer plus an entropy coder, so a "bit" is a halving of the block's
  step (RoPE rotates within each block, so a block's error energy is the same before and after it).

Decoding needs no profile: every segment carries its own per-channel steps and offsets. A chunk of
a model without a calibration is encoded with :data:`FALLBACK` (uniform, conservative steps).

Segment layout (little-endian)::

    head   "STZ1" | orig dtype u8 | pad 3 | G u32 | T u32 | Hkv u32 | D u32
    body   zstd( K codes i16[G,H,D] | K offsets i32[G,H,D] | V codes | V offsets | K q i8[G,T,H,D] | V q )

A value is restored as ``float32(q + offset) * 2**(code/8)`` (one exact power-of-two scale table,
one multiply): the encoder quantizes against exactly these values, so the error is at most half a
step everywhere (a step is widened where a channel's range would not fit int8: nothing is clipped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard

from ragkv.model.gguf import fingerprint_file, write_json_atomic
from ragkv.store.codecs.base import (
    CODE_DTYPES,
    CodecError,
    KVCodec,
    check_kv,
    code_for_scale,
    log_once,
    register_codec,
    scale_of,
    unpack_head,
)

log = logging.getLogger("ragkv.store")

_MAGIC = b"STZ1"
_HEAD = struct.Struct("<4sB3xIIII")
_QMAX = 127
_CODE_MIN, _CODE_MAX = -8 * 100, 8 * 100  # scales 2**-100 .. 2**100
_MAX_OFFSET = 1 << 23  # |q + offset| < 2**24: exact in float32
PROFILE_VERSION = 1


# ---- profiles -----------------------------------------------------------------------------------
@dataclass
class StepProfile:
    """Quantization steps of one model (see the module docstring)."""

    k_steps: list[float]
    v_steps: list[float]
    #: ``[L][Hkv][D/2]`` integer bits per RoPE block of K, or None (uniform within a layer)
    k_bits: list | None = None
    base_bits: int = 4
    fingerprint: str = ""
    meta: dict = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def steps(self, layer: int, num_kv_heads: int, head_dim: int, is_k: bool) -> np.ndarray:
        """Step multipliers of std ``[Hkv, D]`` for ``layer``."""
        s = self.k_steps if is_k else self.v_steps
        base = float(s[min(layer, len(s) - 1)]) if s else 0.35
        out = np.full((num_kv_heads, head_dim), base, dtype=np.float64)
        if is_k and self.k_bits is not None and layer < len(self.k_bits):
            bits = np.asarray(self.k_bits[layer], dtype=np.float64)
            if bits.shape == (num_kv_heads, head_dim // 2):
                m = 2.0 ** (self.base_bits - bits)
                out = out * np.concatenate([m, m], axis=1)  # block j = channels (j, j + D/2)
        return out

    def ident(self) -> str:
        """Short content id (recorded in blob headers, to trace which steps wrote a blob)."""
        body = json.dumps([self.k_steps, self.v_steps, self.k_bits, self.base_bits], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> StepProfile:
        if not isinstance(obj, dict) or obj.get("version") != PROFILE_VERSION:
            raise ValueError("not a stepz profile of this version")
        p = cls(
            k_steps=[float(x) for x in obj["k_steps"]],
            v_steps=[float(x) for x in obj["v_steps"]],
            k_bits=obj.get("k_bits"),
            base_bits=int(obj.get("base_bits", 4)),
            fingerprint=str(obj.get("fingerprint", "")),
            meta=dict(obj.get("meta") or {}),
        )
        steps = p.k_steps + p.v_steps
        if (
            not steps
            or len(p.k_steps) != len(p.v_steps)
            or not all(0 < s < 100 and math.isfinite(s) for s in steps)
        ):
            raise ValueError("stepz profile has invalid steps")
        if p.k_bits is not None:
            arr = np.asarray(p.k_bits)
            if arr.ndim != 3 or arr.shape[0] != len(p.k_steps) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError("stepz profile has malformed k_bits")
            if arr.min() < 0 or arr.max() > 16:
                raise ValueError("stepz profile k_bits out of range")
        return p


#: the default steps (x std), K 0.12 / V 0.2: on the real default model the coarsest measured that
#: kept >= 95% identical greedy answers (docs/BENCHMARKS.md, "Compact stored KV"). A calibrated
#: profile uses them with RoPE-aware key bits; a model without a calibration uses them as they are
FALLBACK = StepProfile(k_steps=[0.12], v_steps=[0.2], meta={"fallback": True})


def profile_path(fingerprint: str, directory: Path | None = None) -> Path:
    """Where a model's calibration lives: ``directory``, default ``$RAGKV_CACHE_DIR/stepz``."""
    return fingerprint_file("stepz", fingerprint, directory)


def load_profile(fingerprint: str, directory: Path | None = None) -> StepProfile | None:
    """The stored profile of model ``fingerprint``; None when missing, unreadable, corrupt or foreign."""
    path = profile_path(fingerprint, directory)
    try:
        p = StepProfile.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("stepz calibration %s is unusable (%s); it will be recomputed", path, e)
        return None
    if p.fingerprint != fingerprint:
        log.warning("stepz calibration %s belongs to another model; it will be recomputed", path)
        return None
    return p


def save_profile(profile: StepProfile, directory: Path | None = None) -> Path:
    """Write atomically, so a crash never leaves a half-written calibration."""
    path = profile_path(profile.fingerprint, directory)
    write_json_atomic(path, profile.to_json())
    return path


_PROFILES: dict[str, StepProfile] = {}
_PLOCK = threading.Lock()


def register_profile(profile: StepProfile) -> None:
    """Use ``profile`` for chunks of its model in this process (calibration calls this)."""
    with _PLOCK:
        _PROFILES[profile.fingerprint] = profile


def profile_for(fingerprint: str) -> StepProfile | None:
    """This process's profile of the model, else the stored one, else None."""
    with _PLOCK:
        p = _PROFILES.get(fingerprint)
    if p is None:
        p = load_profile(fingerprint)
        if p is not None:
            register_profile(p)
    return p


# ---- codec --------------------------------------------------------------------------------------
class StepZCodec(KVCodec):
    """Std-step int8 quantization per (head, channel), zstd entropy coding; one layer per segment."""

    name = "stepz"
    group_size = 1
    lossless = False
    #: zstd can shrink constant data almost without bound, so a forged header could ask for huge
    #: tensors: readers refuse segments declaring more than 64 decoded bytes per stored byte (real KV
    #: at the default steps: ~7x for fp32; 64x = 0.5 bit per fp32 value). Such a blob is a miss
    #: (recomputed), never a crash
    max_expansion = 64.0

    def __init__(
        self,
        profile: StepProfile | str | None = None,
        level: int = 3,
        k_step: float | None = None,
        v_step: float | None = None,
    ) -> None:
        # ``profile`` as a string is the id a blob header recorded: decoding needs no steps
        if isinstance(profile, StepProfile):
            self.profile: StepProfile | None = profile
        elif k_step is not None or v_step is not None:
            self.profile = StepProfile(k_steps=[float(k_step or 0.35)], v_steps=[float(v_step or 0.5)])
        else:
            self.profile = None
        self._profile_id = profile if isinstance(profile, str) else None
        self.level = int(level)
        if not 1 <= self.level <= 22:
            raise ValueError(f"stepz zstd level must be in [1, 22], got {level}")

    def params(self) -> dict:
        p = self.profile
        return {"profile": self._profile_id or (p.ident() if p else "fallback"), "level": self.level}

    def for_fingerprint(self, fingerprint: str) -> StepZCodec:
        """This codec with the calibrated steps of model ``fingerprint`` (the store calls it per chunk);
        a codec built with explicit steps keeps them."""
        if self.profile is not None:
            return self
        p = profile_for(fingerprint)
        if p is None:
            log_once(
                log, logging.INFO, ("stepz", fingerprint),
                "stepz: no calibration for model %s; storing its KV with the uniform fallback steps "
                "(ragkv.store.codecs.calibrate.ensure_profile(model) calibrates once per model)",
                fingerprint[:16],
            )  # fmt: skip
            p = FALLBACK
        return StepZCodec(profile=p, level=self.level)

    # -- encode ---------------------------------------------------------------------------------
    def quantize(
        self, x: torch.Tensor, layer_start: int, is_k: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes i16 [G,H,D], offsets i32 [G,H,D], q i8 [G,T,H,D]) of ``x [G,T,H,D]``."""
        p = self.profile or FALLBACK
        a = x.detach().to("cpu", torch.float32).numpy()
        if not np.isfinite(a).all():
            raise ValueError("stepz codec cannot encode non-finite KV values (nan/inf)")
        g, t, h, d = a.shape
        mult = np.stack([p.steps(layer_start + i, h, d, is_k) for i in range(g)])  # [G,H,D]
        mean = a.mean(axis=1, dtype=np.float64)
        std = a.std(axis=1, dtype=np.float64)
        lo, hi = a.min(axis=1).astype(np.float64), a.max(axis=1).astype(np.float64)
        spread = np.maximum(std, 1e-6 * np.maximum(np.abs(mean), 1.0))
        step = mult * spread
        # outlier-aware: widen a channel's step until its whole range fits int8 around the offset
        step = np.maximum(step, (hi - lo) / (2 * _QMAX - 2))
        step = np.maximum(step, np.abs(mean) / _MAX_OFFSET)
        codes = code_for_scale(step, _CODE_MIN, _CODE_MAX)
        mid = (hi + lo) / 2
        while True:
            scale = scale_of(codes)
            # centred on the mean (every channel's integers then share one distribution, which the
            # entropy coder likes); a channel whose range does not fit that way is centred on its
            # mid-range, and if even that fails (rounding at the edges) its step grows one code
            off = np.round(mean / scale)
            fits = np.maximum(hi / scale - off, off - lo / scale) <= _QMAX - 0.5
            off = np.where(fits, off, np.round(mid / scale)).astype(np.int64)
            q = np.round(a / scale[:, None] - off[:, None])
            bad = (np.abs(q) > _QMAX).any(axis=1)
            if not bad.any():
                break
            codes = np.where(bad, codes + 1, codes)
        return codes.astype(np.int16), off.astype(np.int32), q.astype(np.int8)

    def encode(self, k: torch.Tensor, v: torch.Tensor, *, layer_start: int | None = None) -> bytes:
        code = check_kv("stepz", k, v)
        start = int(layer_start or 0)
        ck, ok, qk = self.quantize(k, start, True)
        cv, ov, qv = self.quantize(v, start, False)
        body = b"".join(np.ascontiguousarray(a).tobytes() for a in (ck, ok, cv, ov, qk, qv))
        head = _HEAD.pack(_MAGIC, code, *k.shape)
        return head + zstandard.ZstdCompressor(level=self.level).compress(body)

    def reference(
        self, k: torch.Tensor, v: torch.Tensor, layer_start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode of :meth:`encode` returns, without the zstd stage (benchmarks, calibration)."""
        out = []
        for x, is_k in ((k, True), (v, False)):
            c, o, q = self.quantize(x, layer_start, is_k)
            out.append(torch.from_numpy(_restore(c, o, q)).to(x.dtype))
        return out[0], out[1]

    # -- decode ---------------------------------------------------------------------------------
    def peek_shape(self, data: bytes | memoryview) -> tuple[int, int, int, int]:
        return unpack_head(data, _HEAD, _MAGIC, "stepz")[1:]

    def decode(
        self, data: bytes, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        code, g, t, h, d = unpack_head(data, _HEAD, _MAGIC, "stepz")
        if code not in CODE_DTYPES:
            raise CodecError("not a stepz segment")
        nc, n = g * h * d, g * t * h * d
        want = 2 * (nc * 6) + 2 * n
        try:
            body = zstandard.ZstdDecompressor().decompress(
                bytes(memoryview(data)[_HEAD.size :]), max_output_size=want
            )
        except zstandard.ZstdError as e:
            raise CodecError(f"stepz segment does not decompress: {e}") from e
        if len(body) != want:
            raise CodecError(f"stepz segment holds {len(body)} bytes, expected {want}")
        buf = memoryview(body)
        pos = 0

        def take(count: int, dt) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos)
            pos += count * np.dtype(dt).itemsize
            return arr

        ck, ok = take(nc, np.int16).reshape(g, h, d), take(nc, np.int32).reshape(g, h, d)
        cv, ov = take(nc, np.int16).reshape(g, h, d), take(nc, np.int32).reshape(g, h, d)
        qk, qv = take(n, np.int8).reshape(g, t, h, d), take(n, np.int8).reshape(g, t, h, d)
        out_dtype = dtype or CODE_DTYPES[code]
        out = []
        for c, o, q in ((ck, ok, qk), (cv, ov, qv)):
            if c.min(initial=0) < _CODE_MIN or c.max(initial=0) > _CODE_MAX:
                raise CodecError("stepz segment has out-of-range scale codes")
            x = torch.from_numpy(_restore(c, o, q))
            out.append(x.to(device=device, dtype=out_dtype))
        return out[0], out[1]


def _restore(codes: np.ndarray, off: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``float32(q + offset) * scale``: [G,T,H,D] float32."""
    scale = scale_of(codes)[:, None]
    x = q.astype(np.float32)
    x += off.astype(np.float32)[:, None]
    x *= scale
    return x


register_codec("stepz", StepZCodec)
