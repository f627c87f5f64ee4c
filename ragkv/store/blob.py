"""Chunk KV blob format, shared by every store backend.

Layout, format version 2 (all integers little-endian)::

    prefix   16 bytes  MAGIC (6) | version u16 | header_len u32 | reserved u32 (0)
    header   header_len bytes of UTF-8 JSON (see :class:`BlobHeader`)
    tag      32 bytes: the header's digest (sha256, or HMAC-SHA256 with the store's key) over
             version, header_len and the header
    data     the codec's segments back to back; segment i covers layers [start, stop), sits at
             data_start + offset, and its digest (same scheme) is listed in the header

A reader parses the prefix and header from the first bytes, then reads only the segments of the
layers it needs (``os.pread`` on a file, ``GETRANGE`` on Redis), and verifies each one's digest.
The header names the codec and its parameters, so a blob decodes correctly even after a store's
default codec changed; a store only decodes the codecs it was configured with (:class:`BlobAuth`
and the store's allow-list), and checks the header's geometry before anything is allocated.

Digests are sha256 (hashlib, ~1.7 GB/s here on 16 MiB; crc32 was ~3.9 GB/s but is no integrity
check against anyone who can write the store). With an HMAC key (``BlobAuth(key)``) a blob written
without that key fails verification, so a writable store directory or Redis does not let anyone
inject KV into answers. Version 1 blobs (crc32) read as unusable: they are recomputed and rewritten.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ragkv.kv.chunk import ChunkKV
from ragkv.store.codecs.base import CodecError, KVCodec, get_codec

MAGIC = b"RAGKV\x00"
VERSION = 2
_PREFIX = struct.Struct("<6sHII")
PREFIX_SIZE = _PREFIX.size  # 16
#: bytes of the header tag (a sha256 / HMAC-SHA256 digest) after the header JSON
TAG_SIZE = 32
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


class BlobAuth:
    """How blobs are authenticated: sha256 digests (no key) or HMAC-SHA256 with a secret key.

    A keyed store accepts only blobs tagged with its key; an unkeyed one only plain sha256 blobs
    (it cannot check a keyed blob, so that one is unusable there too)."""

    def __init__(self, key: bytes | str | None = None) -> None:
        if isinstance(key, str):
            key = key.encode()
        if key is not None and len(key) < 16:
            raise ValueError("the blob HMAC key must have at least 16 bytes")
        self._key = key or None
        self.scheme = "hmac-sha256" if self._key else "sha256"

    def digest(self, data: bytes | memoryview) -> bytes:
        """The 32-byte tag of ``data``."""
        if self._key is None:
            return hashlib.sha256(data).digest()
        return hmac.digest(self._key, data, "sha256")

    def verify(self, data: bytes | memoryview, tag: bytes) -> bool:
        """Whether ``tag`` is ``data``'s tag (constant-time comparison)."""
        return hmac.compare_digest(self.digest(data), tag)

    def __repr__(self) -> str:  # never shows the key
        return f"BlobAuth({self.scheme})"


#: the default: plain sha256 digests
UNKEYED = BlobAuth()


@dataclass(frozen=True)
class KVGeometry:
    """What KV of one model looks like: a stored header must match it before anything is allocated."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_tokens: int  # the model's context: no chunk is longer

    @classmethod
    def of(cls, config) -> KVGeometry:
        """The geometry of a :class:`ragkv.model.config.ModelConfig`."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, config.max_position)

    def check(self, hdr: BlobHeader) -> None:
        """:class:`BlobError` unless ``hdr`` has this geometry."""
        got = (hdr.num_layers, hdr.num_kv_heads, hdr.head_dim)
        want = (self.num_layers, self.num_kv_heads, self.head_dim)
        if got != want:
            raise BlobError(f"blob geometry (layers, kv heads, head_dim) {got} is not the model's {want}")
        if not 0 < hdr.num_tokens <= self.max_tokens:
            raise BlobError(f"blob holds {hdr.num_tokens} tokens; the model's context is {self.max_tokens}")


@dataclass(frozen=True)
class Segment:
    """One independently decodable layer group inside a blob."""

    start: int  # first layer
    stop: int  # one past the last layer
    offset: int  # relative to data_start
    length: int
    tag: str  # hex digest of the segment bytes (BlobHeader.checksum scheme)


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
    data_start: int = 0  # absolute offset of the first segment (prefix + header + tag)
    checksum: str = "sha256"  # digest scheme of the header tag and segment tags (BlobAuth.scheme)

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
            "checksum": self.checksum,
            "segments": [[s.start, s.stop, s.offset, s.length, s.tag] for s in self.segments],
            "meta": self.meta,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, obj: dict, data_start: int) -> BlobHeader:
        try:
            if obj.get("format") != "ragkv-chunk-kv" or obj.get("checksum") not in ("sha256", "hmac-sha256"):
                raise BlobError("not a ragkv chunk KV header")
            num_layers, num_tokens, num_kv_heads, head_dim = (_int(x) for x in obj["shape"])
            if obj["dtype"] not in DTYPES:
                raise BlobError(f"unknown dtype {obj['dtype']!r}")
            segments = [_segment(s) for s in obj["segments"]]
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
                checksum=str(obj["checksum"]),
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
        if min(self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim) <= 0:
            raise BlobError(f"header shape {self.shape} is not positive")
        expect = 0
        layer = 0
        for s in self.segments:
            if s.offset != expect or s.length <= 0 or s.start != layer or s.stop <= s.start:
                raise BlobError("header segments are not contiguous")
            expect += s.length
            layer = s.stop
        if layer != self.num_layers:
            raise BlobError("header segments do not cover all layers")


def _int(x) -> int:
    """An integer header field (JSON numbers only: no floats, strings or booleans)."""
    if type(x) is not int:
        raise BlobError(f"header field {x!r} is not an integer")
    return x


def _segment(s) -> Segment:
    if not isinstance(s, list) or len(s) != 5 or not isinstance(s[4], str) or len(s[4]) != 2 * TAG_SIZE:
        raise BlobError("malformed segment entry in the blob header")
    return Segment(_int(s[0]), _int(s[1]), _int(s[2]), _int(s[3]), s[4])


def encode_chunk(chunk: ChunkKV, codec: KVCodec, auth: BlobAuth = UNKEYED) -> bytes:
    """Serialize a chunk's KV with ``codec``, one segment per codec layer group, tagged with ``auth``."""
    validate_chunk(chunk)
    bind = getattr(codec, "for_fingerprint", None)
    if bind is not None:  # codecs with per-model settings (stepz's calibrated steps)
        codec = bind(chunk.fingerprint)
    segs: list[Segment] = []
    parts: list[bytes] = []
    offset = 0
    for start, stop in codec.groups(chunk.num_layers):
        data = codec.encode(chunk.k[start:stop], chunk.v[start:stop], layer_start=start)
        segs.append(Segment(start, stop, offset, len(data), auth.digest(data).hex()))
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
        checksum=auth.scheme,
    )
    return assemble(hdr, parts, auth)


def assemble(hdr: BlobHeader, parts: list[bytes], auth: BlobAuth = UNKEYED) -> bytes:
    """Serialize ``hdr`` and its already encoded segments (in order) into one blob tagged by ``auth``."""
    if [len(p) for p in parts] != [s.length for s in hdr.segments]:
        raise ValueError("segment bytes do not match the header's segment table")
    if hdr.checksum != auth.scheme:
        raise ValueError(f"header uses {hdr.checksum} digests, the store signs with {auth.scheme}")
    try:
        head = json.dumps(hdr.to_json(), separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"ChunkKV.meta must be JSON-serializable to be stored: {e}") from e
    prefix = _PREFIX.pack(MAGIC, VERSION, len(head), 0)
    return b"".join([prefix, head, auth.digest(prefix[6:12] + head), *parts])


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
    """Total size of prefix + header + tag given at least the 16 prefix bytes; validates the prefix."""
    if len(head) < PREFIX_SIZE:
        raise BlobError(f"blob truncated: {len(head)} bytes, no complete prefix")
    magic, version, hlen, _ = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise BlobError("bad magic: not a ragkv chunk KV blob")
    if version != VERSION:
        raise BlobError(
            f"unsupported blob format version {version} (this ragkv reads v{VERSION}; the chunk is recomputed)"
        )
    if hlen <= 0 or hlen > MAX_HEADER_SIZE:
        raise BlobError(f"implausible header length {hlen}")
    return PREFIX_SIZE + hlen + TAG_SIZE


def parse_header(head: bytes | memoryview, auth: BlobAuth = UNKEYED) -> BlobHeader:
    """Parse and authenticate the header from the first bytes of a blob (at least :func:`header_size`).

    :class:`BlobError` when its tag is not ``auth``'s (tampered, another key, or no key where one is
    required) or when it is malformed."""
    size = header_size(head)
    if len(head) < size:
        raise BlobError(f"blob truncated inside its header ({len(head)} < {size} bytes)")
    raw = bytes(head[PREFIX_SIZE : size - TAG_SIZE])
    if not auth.verify(bytes(head[6:12]) + raw, bytes(head[size - TAG_SIZE : size])):
        raise BlobError(f"header fails {auth.scheme} verification (tampered, or written with another key)")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlobError(f"header is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise BlobError("header is not a JSON object")
    hdr = BlobHeader.from_json(obj, data_start=size)
    if hdr.checksum != auth.scheme:
        raise BlobError(f"blob tagged with {hdr.checksum}, this store requires {auth.scheme}")
    return hdr


def check_segment(
    seg: Segment, data: bytes | memoryview, auth: BlobAuth = UNKEYED, verify: bool = True
) -> None:
    """Raise :class:`BlobError` unless ``data`` is the intact (with ``verify``: authentic) bytes of ``seg``."""
    if len(data) != seg.length:
        raise BlobError(
            f"segment of layers [{seg.start},{seg.stop}) truncated: {len(data)} of {seg.length} bytes"
        )
    if verify and not auth.verify(data, bytes.fromhex(seg.tag)):
        raise BlobError(f"digest mismatch in segment of layers [{seg.start},{seg.stop})")


def check_sizes(hdr: BlobHeader, codec: KVCodec) -> None:
    """:class:`BlobError` when a segment is too small to hold the layers its header declares.

    Run before anything is allocated from the header's shape: a forged header cannot make a reader
    reserve more than ``codec.max_expansion`` times the bytes actually stored."""
    if codec.max_expansion is None:
        return
    per_layer = 2 * hdr.num_tokens * hdr.num_kv_heads * hdr.head_dim * hdr.torch_dtype.itemsize
    for s in hdr.segments:
        if per_layer * (s.stop - s.start) > codec.max_expansion * s.length + 4096:
            raise BlobError(
                f"segment of layers [{s.start},{s.stop}) has {s.length} bytes: too few for shape {hdr.shape}"
            )


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
    check_sizes(hdr, codec)
    for seg, data in segs:  # a codec's own segment header must agree before it sizes any tensor
        peek = codec.peek_shape(data)
        if peek is not None and tuple(peek) != (seg.stop - seg.start, *hdr.shape[1:]):
            raise BlobError(f"segment of layers [{seg.start},{seg.stop}) holds shape {tuple(peek)}")
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
