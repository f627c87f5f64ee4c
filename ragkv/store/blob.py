"""Chunk KV blob format, shared by every store backend.

Layout (all integers little-endian)::

    prefix   16 bytes  MAGIC (6) | version u16 | header_len u32 | header_crc32 u32
    header   header_len bytes of UTF-8 JSON (see :class:`BlobHeader`)
    data     the codec's segments back to back; segment i covers layers [start, stop)
             and sits at data_start + offset, with its own crc32

A reader parses the prefix and header from the first bytes, then reads only the segments of the
layers it needs (``os.pread`` on a file, ``GETRANGE`` on Redis), and verifies each one's checksum.
The header names the codec and its parameters, so a blob decodes correctly even after a store's
default codec changed.

Checksums are crc32 (zlib): measured here at ~3.9 GB/s versus ~0.9 GB/s for blake2b-128 and
~1.7 GB/s for sha256 on 16 MiB. They only have to catch storage corruption and torn writes (keys are
already sha256 content hashes), and the load path must stay faster than the recompute it hides.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ragkv.kv.chunk import ChunkKV
from ragkv.store.codecs.base import CodecError, KVCodec, get_codec

MAGIC = b"RAGKV\x00"
VERSION = 1
_PREFIX = struct.Struct("<6sHII")
PREFIX_SIZE = _PREFIX.size  # 16
#: bytes a reader fetches first: covers the header of a 2K-token, 80-layer chunk; longer ones take a 2nd read
HEAD_READ_SIZE = 16 * 1024
#: refuse absurd header lengths from corrupt prefixes before allocating anything
MAX_HEADER_SIZE = 64 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class BlobError(ValueError):
    """Bytes that are not a valid chunk KV blob (corrupt, truncated, foreign or mismatched)."""


@dataclass(frozen=True)
class Segment:
    """One independently decodable layer group inside a blob."""

    start: int  # first layer
    stop: int  # one past the last layer
    offset: int  # relative to data_start
    length: int
    crc: int


@dataclass
class BlobHeader:
    """Everything about a stored chunk except its tensors."""

    key: str
    fingerprint: str
    convention: int
    token_ids: list[int]
    start_pos: int
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    codec: str
    codec_params: dict
    segments: list[Segment]
    meta: dict = field(default_factory=dict)
    created: float = 0.0
    data_start: int = 0  # absolute offset of the first segment (prefix + header length)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def data_size(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def total_size(self) -> int:
        return self.data_start + self.data_size

    def raw_nbytes(self) -> int:
        """Bytes of K plus V in the original dtype (what ``raw`` would store)."""
        n = self.num_layers * self.num_tokens * self.num_kv_heads * self.head_dim
        return 2 * n * self.torch_dtype.itemsize

    def segments_for(self, start: int, stop: int) -> list[Segment]:
        """Segments overlapping layers ``[start, stop)``, in order."""
        return [s for s in self.segments if s.start < stop and s.stop > start]

    def to_json(self) -> dict:
        return {
            "format": "ragkv-chunk-kv",
            "key": self.key,
            "fingerprint": self.fingerprint,
            "convention": self.convention,
            "token_ids": self.token_ids,
            "start_pos": self.start_pos,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "codec": {"name": self.codec, "params": self.codec_params},
            "checksum": "crc32",
            "segments": [[s.start, s.stop, s.offset, s.length, s.crc] for s in self.segments],
            "meta": self.meta,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, obj: dict, data_start: int) -> BlobHeader:
        try:
            if obj.get("format") != "ragkv-chunk-kv" or obj.get("checksum") != "crc32":
                raise BlobError("not a ragkv chunk KV header")
            num_layers, num_tokens, num_kv_heads, head_dim = (int(x) for x in obj["shape"])
            if obj["dtype"] not in DTYPES:
                raise BlobError(f"unknown dtype {obj['dtype']!r}")
            segments = [Segment(*(int(x) for x in s)) for s in obj["segments"]]
            hdr = cls(
                key=str(obj["key"]),
                fingerprint=str(obj["fingerprint"]),
                convention=int(obj["convention"]),
                token_ids=[int(t) for t in obj["token_ids"]],
                start_pos=int(obj["start_pos"]),
                num_layers=num_layers,
                num_tokens=num_tokens,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=str(obj["dtype"]),
                codec=str(obj["codec"]["name"]),
                codec_params=dict(obj["codec"]["params"]),
                segments=segments,
                meta=dict(obj.get("meta") or {}),
                created=float(obj.get("created", 0.0)),
                data_start=data_start,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, BlobError):
                raise
            raise BlobError(f"malformed blob header: {e!r}") from e
        hdr._validate()
        return hdr

    def _validate(self) -> None:
        if len(self.token_ids) != self.num_tokens:
            raise BlobError("header token_ids do not match its shape")
        expect = 0
        layer = 0
        for s in self.segments:
            if s.offset != expect or s.length <= 0 or s.start != layer or s.stop <= s.start:
                raise BlobError("header segments are not contiguous")
            expect += s.length
            layer = s.stop
        if layer != self.num_layers:
            raise BlobError("header segments do not cover all layers")


def encode_chunk(chunk: ChunkKV, codec: KVCodec) -> bytes:
    """Serialize a chunk's KV with ``codec``, one segment per codec layer group."""
    validate_chunk(chunk)
    segs: list[Segment] = []
    parts: list[bytes] = []
    offset = 0
    for start, stop in codec.groups(chunk.num_layers):
        data = codec.encode(chunk.k[start:stop], chunk.v[start:stop], layer_start=start)
        segs.append(Segment(start, stop, offset, len(data), zlib.crc32(data)))
        parts.append(data)
        offset += len(data)
    L, T, H, D = chunk.k.shape
    hdr = BlobHeader(
        key=chunk.key,
        fingerprint=chunk.fingerprint,
        convention=int(chunk.convention),
        token_ids=[int(t) for t in chunk.token_ids.tolist()],
        start_pos=int(chunk.start_pos),
        num_layers=L,
        num_tokens=T,
        num_kv_heads=H,
        head_dim=D,
        dtype=DTYPE_NAMES[chunk.k.dtype],
        codec=codec.name,
        codec_params=codec.params(),
        segments=segs,
        meta=chunk.meta,
        created=time.time(),
    )
    return assemble(hdr, parts)


def assemble(hdr: BlobHeader, parts: list[bytes]) -> bytes:
    """Serialize ``hdr`` and its already encoded segments (in order) into one blob."""
    if [len(p) for p in parts] != [s.length for s in hdr.segments]:
        raise ValueError("segment bytes do not match the header's segment table")
    try:
        head = json.dumps(hdr.to_json(), separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"ChunkKV.meta must be JSON-serializable to be stored: {e}") from e
    prefix = _PREFIX.pack(MAGIC, VERSION, len(head), zlib.crc32(head))
    return b"".join([prefix, head, *parts])


def validate_chunk(chunk: ChunkKV) -> None:
    """Raise ``ValueError`` unless ``chunk`` is storable (consistent shapes, float dtype)."""
    k, v = chunk.k, chunk.v
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise ValueError("ChunkKV.k and .v must be tensors")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"ChunkKV.k/.v must both be [L, T, Hkv, D]; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.dtype != v.dtype or k.dtype not in DTYPE_NAMES:
        raise ValueError(f"ChunkKV.k/.v must share a float dtype in {list(DTYPES)}; got {k.dtype}, {v.dtype}")
    if chunk.token_ids.dim() != 1 or chunk.token_ids.numel() != k.shape[1]:
        raise ValueError(f"ChunkKV has {chunk.token_ids.numel()} token ids but T={k.shape[1]}")
    if k.shape[0] == 0 or k.shape[1] == 0:
        raise ValueError("ChunkKV must have at least one layer and one token")


def header_size(head: bytes | memoryview) -> int:
    """Total size of prefix + header given at least the 16 prefix bytes; validates the prefix."""
    if len(head) < PREFIX_SIZE:
        raise BlobError(f"blob truncated: {len(head)} bytes, no complete prefix")
    magic, version, hlen, _ = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise BlobError("bad magic: not a ragkv chunk KV blob")
    if version != VERSION:
        raise BlobError(f"unsupported blob format version {version} (this ragkv reads v{VERSION})")
    if hlen <= 0 or hlen > MAX_HEADER_SIZE:
        raise BlobError(f"implausible header length {hlen}")
    return PREFIX_SIZE + hlen


def parse_header(head: bytes | memoryview) -> BlobHeader:
    """Parse and verify the header from the first bytes of a blob (at least :func:`header_size`)."""
    size = header_size(head)
    if len(head) < size:
        raise BlobError(f"blob truncated inside its header ({len(head)} < {size} bytes)")
    _, _, _, hcrc = _PREFIX.unpack_from(head, 0)
    raw = bytes(head[PREFIX_SIZE:size])
    if zlib.crc32(raw) != hcrc:
        raise BlobError("header checksum mismatch")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlobError(f"header is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise BlobError("header is not a JSON object")
    return BlobHeader.from_json(obj, data_start=size)


def check_segment(seg: Segment, data: bytes | memoryview) -> None:
    """Raise :class:`BlobError` unless ``data`` is the intact bytes of ``seg``."""
    if len(data) != seg.length:
        raise BlobError(
            f"segment of layers [{seg.start},{seg.stop}) truncated: {len(data)} of {seg.length} bytes"
        )
    if zlib.crc32(data) != seg.crc:
        raise BlobError(f"checksum mismatch in segment of layers [{seg.start},{seg.stop})")


def codec_for(hdr: BlobHeader) -> KVCodec:
    """The codec that wrote this blob, with the parameters it used."""
    try:
        return get_codec(hdr.codec, **hdr.codec_params)
    except (KeyError, TypeError, ValueError) as e:
        raise BlobError(f"cannot decode codec {hdr.codec!r} with params {hdr.codec_params}: {e}") from e


def decode_segments(
    hdr: BlobHeader,
    segs: list[tuple[Segment, bytes | memoryview]],
    start: int,
    stop: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode verified segments into K and V of layers ``[start, stop)``: ``[stop-start, T, Hkv, D]``.

    With ``out`` the layers are written into the caller's (reused, maybe pinned) buffers; codecs
    with a ``decode_into`` method (raw) then copy straight from the blob bytes, no temporaries.
    """
    codec = codec_for(hdr)
    shape = (stop - start, hdr.num_tokens, hdr.num_kv_heads, hdr.head_dim)
    if out is not None:
        k_out, v_out = out
        if tuple(k_out.shape) != shape or tuple(v_out.shape) != shape:
            raise OutBufferError(
                f"out buffers have shapes {tuple(k_out.shape)}, {tuple(v_out.shape)}; need {shape}"
            )
    elif len(segs) == 1:  # one segment: its decoded tensors are the answer (a slice when it is a group)
        seg, data = segs[0]
        k, v = _decode(codec, seg, data, shape, device, dtype or hdr.torch_dtype)
        lo, hi = start - seg.start, stop - seg.start
        return (k, v) if (lo, hi) == (0, seg.stop - seg.start) else (k[lo:hi], v[lo:hi])
    else:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        k_out = torch.empty(shape, dtype=dtype or hdr.torch_dtype, device=dev)
        v_out = torch.empty(shape, dtype=dtype or hdr.torch_dtype, device=dev)
    into = getattr(codec, "decode_into", None)
    for seg, data in segs:
        lo, hi = max(seg.start, start), min(seg.stop, stop)
        k_dst, v_dst = k_out[lo - start : hi - start], v_out[lo - start : hi - start]
        if into is not None:
            try:
                into(data, k_dst, v_dst, lo - seg.start, hi - seg.start)
            except CodecError as e:
                raise BlobError(f"segment of layers [{seg.start},{seg.stop}) does not decode: {e}") from e
        else:
            k, v = _decode(codec, seg, data, shape, k_out.device, k_out.dtype)
            copy_into(k_dst, k[lo - seg.start : hi - seg.start])
            copy_into(v_dst, v[lo - seg.start : hi - seg.start])
    return k_out, v_out


class OutBufferError(ValueError):
    """``out`` buffers that do not fit the requested layers (a caller error, raised)."""


def _decode(codec: KVCodec, seg: Segment, data, shape, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        k, v = codec.decode(data, device=device, dtype=dtype)
    except CodecError as e:
        raise BlobError(f"segment of layers [{seg.start},{seg.stop}) does not decode: {e}") from e
    want = (seg.stop - seg.start, *shape[1:])
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise BlobError(f"segment decoded to {tuple(k.shape)}, header says {want}")
    return k, v


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``; on CPU through numpy (one thread: see codecs.raw.tensor_from_bytes)."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype != torch.bfloat16:
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def to_chunk(hdr: BlobHeader, k: torch.Tensor, v: torch.Tensor) -> ChunkKV:
    """Rebuild the :class:`ChunkKV` described by ``hdr`` around decoded tensors."""
    return ChunkKV(
        token_ids=torch.tensor(hdr.token_ids, dtype=torch.long),
        k=k,
        v=v,
        start_pos=hdr.start_pos,
        fingerprint=hdr.fingerprint,
        convention=hdr.convention,
        meta=dict(hdr.meta),
    )
