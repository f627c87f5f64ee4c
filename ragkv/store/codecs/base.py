"""Codec contract between KV tensors and bytes.

A codec turns the K/V of one *layer group* (``group_size`` consecutive layers) of one chunk into a
self-describing byte string and back. The store keeps one segment per layer group, so a reader can
fetch and decode one group without the others (layer-wise pipelined loading).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

#: the code a segment header stores for the KV's own dtype (every codec: raw, int8/int4, stepz, video)
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
CODE_DTYPES = {c: d for d, c in DTYPE_CODES.items()}
#: 2**(i/8) for i = 0..7 as float32: scale code ``c`` stands for ``_FRAC[c & 7] * 2**(c >> 3)``, exact in float32
_FRAC = np.array([2.0 ** (i / 8) for i in range(8)], dtype=np.float32)


class CodecError(ValueError):
    """Bytes that cannot be decoded (corrupt, truncated or foreign)."""


class KVCodec(ABC):
    """Encode/decode the K and V of ``group_size`` consecutive layers of one chunk."""

    name: ClassVar[str]
    #: layers per independently decodable segment (video packs 3 layers per frame's 3 planes)
    group_size: int = 1
    #: True when decode(encode(x)) == x bit for bit (raw), False for quantizing codecs
    lossless: bool = False
    #: most decoded bytes per stored byte (None: unbounded, e.g. video); readers refuse segments whose
    #: header declares more before allocating anything
    max_expansion: float | None = None
    #: the attributes :meth:`params` reports (a codec's constructor settings that change the bytes)
    param_names: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def encode(self, k: torch.Tensor, v: torch.Tensor, *, layer_start: int | None = None) -> bytes:
        """``k``, ``v``: ``[G, T, Hkv, D]`` (G <= group_size). Returns self-describing bytes.

        ``layer_start`` is the group's first layer in the chunk, for codecs whose settings vary by
        layer (per-layer quantization steps); codecs that treat every layer alike ignore it.
        """

    @abstractmethod
    def decode(
        self, data: bytes, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode`; raises :class:`CodecError` on bad bytes."""

    def params(self) -> dict:
        """Settings that change the bytes (stored in blob headers): :attr:`param_names` by default."""
        return {name: getattr(self, name) for name in self.param_names}

    def peek_shape(self, data: bytes | memoryview) -> tuple[int, int, int, int] | None:
        """``(G, T, Hkv, D)`` a segment's own header declares, read without decoding (None: unknown)."""
        return None

    def groups(self, num_layers: int) -> list[tuple[int, int]]:
        """Layer ranges ``[start, stop)`` of the segments of a chunk with ``num_layers`` layers."""
        g = max(1, self.group_size)
        return [(s, min(s + g, num_layers)) for s in range(0, num_layers, g)]


def check_kv(name: str, k: torch.Tensor, v: torch.Tensor) -> int:
    """The dtype code of ``k``, ``v`` for codec ``name``'s ``encode``: ValueError unless they are
    ``[G, T, Hkv, D]`` of one shape and one dtype of :data:`DTYPE_CODES`."""
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"{name} codec needs k, v of one shape [G,T,Hkv,D]; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.dtype != v.dtype or k.dtype not in DTYPE_CODES:
        raise ValueError(f"{name} codec supports {list(DTYPE_CODES)}; got {k.dtype}, {v.dtype}")
    return DTYPE_CODES[k.dtype]


def unpack_head(data: bytes | memoryview, head: struct.Struct, magic: bytes, name: str) -> tuple:
    """The fields after the magic of a segment's fixed header ``head``: CodecError when ``data`` is
    shorter than it or starts with another magic (not a ``name`` segment)."""
    if len(data) < head.size:
        raise CodecError(f"{name} segment shorter than its header")
    fields = head.unpack_from(data, 0)
    if fields[0] != magic:
        raise CodecError(f"not a {name} segment")
    return fields[1:]


def scale_of(code: np.ndarray) -> np.ndarray:
    """float32 scales ``2**(code/8)`` of stepz's and video's scale codes, bit-identical everywhere."""
    c = np.asarray(code, dtype=np.int32)
    return np.ldexp(_FRAC[c & 7], c >> 3).astype(np.float32)


def code_for_scale(step: np.ndarray, code_min: int, code_max: int) -> np.ndarray:
    """Smallest codes in ``[code_min, code_max]`` (int32) whose scale is >= ``step``: a step may grow,
    never shrink (that could clip)."""
    with np.errstate(divide="ignore"):
        c = np.ceil(8.0 * np.log2(np.maximum(step, 2.0 ** (code_min / 8))) - 1e-9)
    c = np.clip(c, code_min, code_max).astype(np.int32)
    # float rounding of log2: bump until the scale covers the step
    c[(scale_of(c) < step) & (c < code_max)] += 1
    return c


def log_once(logger: logging.Logger, level: int, key: tuple, msg: str, *args) -> None:
    """``logger.log(level, msg, *args)`` the first time this process meets ``key``: a condition that
    holds for every chunk (no calibration, no NVENC) is said once, not per segment."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


_LOGGED: set[tuple] = set()
_REGISTRY: dict[str, Callable[..., KVCodec]] = {}
#: the module of each built-in codec, imported on first use (video needs PyAV, an optional extra)
_BUILTIN = {
    "raw": "ragkv.store.codecs.raw",
    "int8": "ragkv.store.codecs.quant",
    "stepz": "ragkv.store.codecs.stepz",
    "video": "ragkv.store.codecs.video",
}


def register_codec(name: str, factory: Callable[..., KVCodec]) -> None:
    """Make a codec selectable by name (``get_codec(name, **options)``)."""
    _REGISTRY[name] = factory


def get_codec(name: str, **options) -> KVCodec:
    if name not in _REGISTRY:
        _load_builtin(name)
    if name not in _REGISTRY:
        raise KeyError(f"unknown KV codec {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**options)


def available_codecs() -> list[str]:
    for n in _BUILTIN:
        _load_builtin(n)
    return sorted(_REGISTRY)


def _load_builtin(name: str) -> None:
    if name in _BUILTIN:
        with contextlib.suppress(ImportError):
            importlib.import_module(_BUILTIN[name])
