"""The chunk KV store interface, and the shared read/write logic of byte-blob backends.

Contract (every backend):

* ``put`` is idempotent: a key already stored is not rewritten (except a blob this instance found
  corrupt, which the next ``put`` replaces). It returns ``True`` when the chunk is stored after the
  call and ``False`` when the backend failed (logged at WARNING on ``ragkv.store``); it never raises
  for backend failures, only ``ValueError`` for an invalid chunk. The caller just goes on and
  recomputes next time.
* Reads (``get``, ``load_layers``, ``header``, ``contains`` ...) never raise for store problems and
  never return wrong KV: a corrupt or truncated blob, a checksum, key, fingerprint or convention
  mismatch, an undecodable segment, or a backend that is down is logged at WARNING, counted in
  :meth:`ChunkStore.stats` and returned as a miss (``None``). Caller errors (a malformed key, a
  layer range outside the chunk) raise ``ValueError``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

import torch
from cachetools import LRUCache

from ragkv.kv.chunk import CHUNK_CONVENTION_VERSION, TREE_PAGE_PREFIX, ChunkKV
from ragkv.store import blob as blobfmt
from ragkv.store.blob import BlobAuth, BlobError, BlobHeader, KVGeometry, OutBufferError, Segment
from ragkv.store.codecs.base import CodecError, KVCodec, get_codec

log = logging.getLogger("ragkv.store")

_KEY_RE = re.compile(r"[0-9A-Za-z_.:-]{1,200}")
R = TypeVar("R")


class StoreWriteError(OSError):
    """A backend could not store a blob (full, too large for its bound, read-only ...)."""


class StoreFullError(StoreWriteError):
    """The store's size bound is reached by KV its owner still references: the write is refused."""


class FingerprintMismatch(BlobError):
    """The blob was produced by another model than the one asking for it."""


def check_key(key: str) -> str:
    """Validate a chunk key (content keys are hex; anything path- or glob-unsafe is refused)."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key) or key.startswith("."):
        raise ValueError(f"invalid chunk key {key!r}: expected 1-200 chars of [0-9A-Za-z_.:-]")
    return key


def check_max_bytes(max_bytes: int | None) -> int | None:
    """A store's size bound: positive, or None for unbounded."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    return max_bytes


def check_layer_range(start: int, stop: int) -> None:
    if not (isinstance(start, int) and isinstance(stop, int)) or start < 0 or stop <= start:
        raise ValueError(f"invalid layer range [{start}, {stop})")


class LayerRangeError(ValueError):
    """The requested layers lie outside the stored chunk (a caller error, so it is raised)."""


class WarnThrottle:
    """Log a warning of one kind at most once per ``every_s`` seconds, counting the ones held back
    (a store outage must not turn every chunk of every query into a log line)."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self.log, self.every_s = logger, every_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args) -> None:
        """Warn now, or count it if a warning of ``kind`` went out less than ``every_s`` ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e18) < self.every_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        self.log.warning(msg + (f" [{held} similar warnings suppressed]" if held else ""), *args)


class ChunkStore(ABC):
    """Where chunk KV lives between ingest and reuse; see the module docstring for the contract.

    Subclasses set ``codec`` and ``auth`` (what :meth:`put` encodes a chunk with)."""

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        counters = (
            "hits misses errors corrupt puts puts_skipped put_errors bytes_read bytes_written evictions full"
        )
        self._stats: dict[str, int] = dict.fromkeys(counters.split(), 0)
        #: "backend unavailable" warnings at most every 30 s (``_warn.every_s``); corruption ones always
        self._warn = WarnThrottle(log, every_s=30.0)
        #: model fingerprint -> the KV geometry its blobs must have (see :meth:`expect_geometry`)
        self._geometry: dict[str, KVGeometry] = {}

    # -- interface ------------------------------------------------------------------------------
    def put(self, chunk: ChunkKV) -> bool:
        """Store ``chunk`` under ``chunk.key`` unless already there; False when the backend failed."""
        blobfmt.validate_chunk(chunk)
        key = chunk.key
        if not self.known_corrupt(key) and self._stored(key):
            self._count("puts_skipped")
            return True
        return self.put_blob(key, blobfmt.encode_chunk(chunk, self.codec, self.auth))

    @abstractmethod
    def put_blob(self, key: str, blob: bytes) -> bool:
        """Store an already encoded blob (tier promotion, copying between stores)."""

    def get(
        self,
        key: str,
        fingerprint: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> ChunkKV | None:
        """The whole chunk, or None on a miss of any kind."""
        check_key(key)
        return self._get(key, fingerprint, device, dtype)

    def load_layers(
        self,
        key: str,
        start: int,
        stop: int,
        fingerprint: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V ``[stop-start, T, Hkv, D]`` of layers ``[start, stop)``, reading only their segments.

        ``out``: buffers to fill and return instead of allocating (reuse them across loads: fresh
        allocations page-fault, which dominated per-layer reads in our VM); device/dtype are theirs.
        After a miss their content is undefined."""
        check_key(key)
        check_layer_range(start, stop)
        return self._load_layers(key, start, stop, fingerprint, device, dtype, out)

    @abstractmethod
    def header(self, key: str) -> BlobHeader | None:
        """Token ids, shapes, dtype, codec, fingerprint ... without reading tensor data."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key`` (not read: it may still turn out unusable)."""

    @abstractmethod
    def delete(self, key: str, strict: bool = False) -> bool:
        """Remove the blob under ``key``; whether there was one. A backend that does not answer is a
        miss (False), or with ``strict`` a :class:`StoreWriteError` (the caller must know the blob may
        still be there: the write-ahead record keeps it for a later delete)."""

    @abstractmethod
    def keys(self) -> list[str]:
        """The keys of the stored blobs."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of stored blobs."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and files; the store must not be used afterwards."""

    def known_corrupt(self, key: str) -> bool:
        """Whether a read found the blob under ``key`` unusable (the next ``put`` rewrites it)."""
        return False

    def mark_corrupt(self, key: str) -> None:
        """Note that the blob under ``key`` is unusable (e.g. it holds other tokens), so ``put`` rewrites it."""
        return None  # stores without a corrupt set rewrite nothing (a put of a stored key is a no-op)

    def expect_geometry(self, fingerprint: str, geometry: KVGeometry) -> None:
        """Refuse (as corrupt) any blob of model ``fingerprint`` whose layers, KV heads, head_dim or
        token count do not fit ``geometry``, before its tensors are allocated or reach attention."""
        self._geometry[fingerprint] = geometry

    def stats(self) -> dict:
        """Counters since creation: hits, misses, errors, corrupt, puts, bytes_read/written, evictions."""
        with self._stats_lock:
            out: dict = dict(self._stats)
        out["backend"] = type(self).__name__
        return out

    def sibling(self, name: str) -> ChunkStore | None:
        """A store of the same backend in a namespace of its own (``name``), with this one's key and
        checks: where the exact KV tree keeps its pages apart from chunk KV (garbage collection,
        quotas and key listings of chunk KV never see them). None: this kind has no such namespace."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _get(self, key: str, fingerprint: str, device, dtype) -> ChunkKV | None:
        """:meth:`get` of a valid key."""

    @abstractmethod
    def _load_layers(
        self, key: str, start: int, stop: int, fingerprint: str, device, dtype, out
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`load_layers` of a valid key and layer range."""

    def _stored(self, key: str) -> bool:
        """Whether :meth:`put` may skip ``key`` (a blob not known corrupt is stored)."""
        return self.contains(key)

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] = self._stats.get(name, 0) + n

    def _backend_failed(self, op: str, key: str | None, exc: BaseException) -> None:
        """Log a backend failure, throttled by ``_warn`` (a dead Redis must not flood logs)."""
        self._count("errors")
        self._warn.warning(
            "backend",
            "%s unavailable during %s%s: %s: %s; treating it as a miss (KV will be recomputed)",
            self.describe(),
            op,
            f" of chunk {key[:16]}" if key else "",
            type(exc).__name__,
            exc,
        )


class BlobStore(ChunkStore):
    """A store of byte blobs in the :mod:`ragkv.store.blob` format; backends supply byte primitives.

    Subclasses implement ``_read``, ``_write``, ``_exists``, ``_delete``, ``_keys``, ``_nbytes`` and
    may raise any exception in ``backend_errors`` for "the backend itself failed".
    """

    #: exceptions that mean the backend failed (as opposed to bad data, which is a BlobError)
    backend_errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(
        self,
        codec: str | KVCodec = "raw",
        codec_options: dict | None = None,
        verify: bool = True,
        header_cache: int = 4096,
        hmac_key: bytes | str | BlobAuth | None = None,
        codecs: str | list[str] | tuple[str, ...] | frozenset[str] | None = None,
    ) -> None:
        super().__init__()
        self.codec = codec if isinstance(codec, KVCodec) else get_codec(codec, **(codec_options or {}))
        #: verify segment digests on read (the header's tag is always verified)
        self.verify = verify
        #: sha256 digests, or HMAC-SHA256 with the store's secret key (blobs without it are unusable)
        self.auth = hmac_key if isinstance(hmac_key, BlobAuth) else BlobAuth(hmac_key)
        if isinstance(codecs, str):
            codecs = [c.strip() for c in codecs.split(",") if c.strip()]
        #: codecs this store decodes: its own plus ``codecs``; a blob of any other is unusable
        self.allowed_codecs = frozenset({self.codec.name, *(codecs or ())})
        #: parsed headers of recently read blobs, the least recently used dropped past ``header_cache``
        self._headers: LRUCache[str, BlobHeader] = LRUCache(header_cache)
        self._hlock = threading.Lock()
        self._corrupt: set[str] = set()
        #: ``pinned(key)``: the owner still references this chunk (a RAG sets its index's check), so a
        #: size bound evicts unpinned blobs only and refuses a write rather than drop pinned KV
        self.pinned: Callable[[str], bool] | None = None

    # -- backend primitives ---------------------------------------------------------------------
    @abstractmethod
    def _read(self, key: str, offset: int, length: int | None) -> bytes | memoryview | None:
        """Bytes ``[offset, offset+length)`` of the blob (to its end when ``length`` is None).

        None when the key is absent; fewer bytes when the blob is shorter."""

    @abstractmethod
    def _write(self, key: str, blob: bytes, overwrite: bool) -> bool:
        """Store ``blob``; return False (writing nothing) when the key exists and not ``overwrite``."""

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abstractmethod
    def _keys(self) -> list[str]: ...

    @abstractmethod
    def _nbytes(self) -> int: ...

    def _close(self) -> None:
        pass

    def known_corrupt(self, key: str) -> bool:
        return key in self._corrupt

    def mark_corrupt(self, key: str) -> None:
        self._count("corrupt")
        self._corrupt.add(key)
        self._forget(key)

    # -- writes ---------------------------------------------------------------------------------
    def put_blob(self, key: str, blob: bytes) -> bool:
        check_key(key)
        hdr = blobfmt.parse_header(blob, self.auth)  # non-blob or foreign bytes are a caller bug: ValueError
        if hdr.key != key or hdr.total_size != len(blob):
            raise ValueError(f"blob does not hold chunk {key[:16]} or has the wrong length")
        overwrite = key in self._corrupt
        try:
            written = self._write(key, bytes(blob), overwrite)
        except (StoreFullError, *self.backend_errors) as e:
            if isinstance(e, StoreFullError):
                self._count("full")
            self._count("put_errors")
            self._backend_failed("put", key, e)
            return False
        self._forget(key)
        self._corrupt.discard(key)
        if written:
            self._count("puts")
            self._count("bytes_written", len(blob))
        else:
            self._count("puts_skipped")
        return True

    def delete(self, key: str, strict: bool = False) -> bool:
        check_key(key)
        self._forget(key)
        self._corrupt.discard(key)
        if not strict:
            return bool(self._guard("delete", key, lambda: self._delete(key), False))
        try:
            return bool(self._delete(key))
        except self.backend_errors as e:
            self._backend_failed("delete", key, e)
            raise StoreWriteError(f"{self.describe()}: could not delete chunk {key[:16]}: {e}") from e

    # -- reads ----------------------------------------------------------------------------------
    def _get(self, key: str, fingerprint: str, device, dtype) -> ChunkKV | None:
        def run() -> ChunkKV | None:
            got = self._fetch(key, fingerprint)
            if got is None:
                return None
            hdr, data = got
            return blobfmt.to_chunk(hdr, *decode_blob(hdr, data, 0, hdr.num_layers, device, dtype))

        return self._counted(self._guard("get", key, run, None))

    def fetch(self, key: str, fingerprint: str) -> tuple[BlobHeader, bytes | memoryview] | None:
        """The whole blob, verified, with its parsed header; None on a miss (counted)."""
        check_key(key)
        return self._counted(self._guard("fetch", key, lambda: self._fetch(key, fingerprint), None))

    def _load_layers(
        self, key: str, start: int, stop: int, fingerprint: str, device, dtype, out
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        def run():
            got = self._read_segments(key, start, stop, fingerprint)
            if got is None:
                return None
            hdr, segs = got
            return blobfmt.decode_segments(hdr, segs, start, stop, device, dtype, out)

        return self._counted(self._guard("load_layers", key, run, None))

    def read_segments(
        self, key: str, start: int, stop: int, fingerprint: str
    ) -> tuple[BlobHeader, list[tuple[Segment, bytes | memoryview]]] | None:
        """Verified bytes of the segments covering layers ``[start, stop)``; None on a miss (counted)."""
        check_key(key)
        check_layer_range(start, stop)
        return self._counted(
            self._guard(
                "read_segments", key, lambda: self._read_segments(key, start, stop, fingerprint), None
            )
        )

    def header(self, key: str) -> BlobHeader | None:
        check_key(key)

        def run() -> BlobHeader | None:
            hdr = self._header(key, fresh=True)[0]
            if hdr is not None:
                if hdr.key != key:  # a valid blob of another chunk: corrupt (_guard), rewritten on put
                    raise BlobError(f"blob stored under {key[:16]} holds chunk {hdr.key[:16]}")
                self._check_blob(hdr)
            return hdr

        return self._guard("header", key, run, None)

    def contains(self, key: str) -> bool:
        check_key(key)
        return bool(self._guard("contains", key, lambda: self._exists(key), False))

    def keys(self) -> list[str]:
        return list(self._guard("keys", None, self._keys, []))

    def nbytes(self) -> int:
        return int(self._guard("nbytes", None, self._nbytes, 0))

    def close(self) -> None:
        self._close()

    # -- internals ------------------------------------------------------------------------------
    def _counted(self, result):
        self._count("hits" if result is not None else "misses")
        return result

    def _guard(self, op: str, key: str | None, fn: Callable[[], R], default: R) -> R:
        """Run a read-path operation; turn a store failure (backend down, unusable blob, another
        model's KV) into ``default`` plus a counted warning; programming errors propagate."""
        try:
            return fn()
        except (LayerRangeError, OutBufferError):
            raise
        except FingerprintMismatch as e:
            self._count("errors")
            log.warning("%s: %s %s: %s; treating it as a miss", self.describe(), op, _short(key), e)
        except (BlobError, CodecError) as e:
            self._count("errors")
            self._count("corrupt")
            if key is not None:
                self._corrupt.add(key)
                self._forget(key)
            log.warning(
                "%s: %s %s: unusable blob (%s); treating it as a miss, the chunk will be recomputed and rewritten",
                self.describe(),
                op,
                _short(key),
                e,
            )
        except self.backend_errors as e:
            self._backend_failed(op, key, e)
        # anything else is a bug in ragkv and propagates: a codec bug must not pass for "every chunk
        # missed, blend recomputes everything" (bad data is a BlobError/CodecError above)
        return default

    def _read_counted(self, key: str, offset: int, length: int | None) -> bytes | memoryview | None:
        data = self._read(key, offset, length)
        if data is not None:
            self._count("bytes_read", len(data))
        return data

    def _forget(self, key: str) -> None:
        with self._hlock:
            self._headers.pop(key, None)

    def _check_header(self, hdr: BlobHeader, key: str, fingerprint: str) -> None:
        if hdr.key != key:
            raise BlobError(f"blob stored under {key[:16]} holds chunk {hdr.key[:16]}")
        if hdr.convention != CHUNK_CONVENTION_VERSION:
            raise BlobError(
                f"blob uses chunk convention v{hdr.convention}, this ragkv uses v{CHUNK_CONVENTION_VERSION}"
            )
        if hdr.fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"KV was computed by model {hdr.fingerprint[:16]}, requested for model {fingerprint[:16]}"
            )
        self._check_blob(hdr)

    def _check_blob(self, hdr: BlobHeader) -> None:
        """The checks a header must pass before any of its bytes are decoded or tensors allocated: an
        allowed codec, segments big enough for the declared shape, and the model's geometry."""
        # the exact KV tree's pages are always lossless raw (their fingerprint names the tree's root)
        tree_page = hdr.codec == "raw" and hdr.fingerprint.startswith(TREE_PAGE_PREFIX)
        if hdr.codec not in self.allowed_codecs and not tree_page:
            raise BlobError(
                f"blob codec {hdr.codec!r} is not one this store decodes {sorted(self.allowed_codecs)}"
            )
        blobfmt.check_sizes(hdr, blobfmt.codec_for(hdr))
        geometry = self._geometry.get(hdr.fingerprint)
        if geometry is not None:
            geometry.check(hdr)

    def _header(self, key: str, fresh: bool = False) -> tuple[BlobHeader | None, bool]:
        """(header, came_from_cache); reads only the first bytes of the blob."""
        if not fresh:
            with self._hlock:
                hdr = self._headers.get(key)  # a hit becomes the most recently used
                if hdr is not None:
                    return hdr, True
        head = self._read_counted(key, 0, blobfmt.HEAD_READ_SIZE)
        if head is None:
            return None, False
        size = blobfmt.header_size(head)
        if size > len(head):
            if len(head) < blobfmt.HEAD_READ_SIZE:
                raise BlobError(f"blob truncated inside its header ({len(head)} < {size} bytes)")
            rest = self._read_counted(key, len(head), size - len(head)) or b""
            head = bytes(head) + bytes(rest)
        hdr = blobfmt.parse_header(head, self.auth)
        self._cache_header(key, hdr)
        return hdr, False

    def _cache_header(self, key: str, hdr: BlobHeader) -> None:
        with self._hlock, contextlib.suppress(ValueError):  # a cache of 0 headers keeps none
            self._headers[key] = hdr

    def _fetch(self, key: str, fingerprint: str) -> tuple[BlobHeader, bytes | memoryview] | None:
        data = self._read_counted(key, 0, None)
        if data is None:
            return None
        hdr = blobfmt.parse_header(data, self.auth)
        self._check_header(hdr, key, fingerprint)
        if len(data) != hdr.total_size:
            raise BlobError(f"blob has {len(data)} bytes, its header says {hdr.total_size}")
        mv = memoryview(data)
        for s in hdr.segments:
            seg = mv[hdr.data_start + s.offset : hdr.data_start + s.offset + s.length]
            blobfmt.check_segment(s, seg, self.auth, self.verify)
        self._cache_header(key, hdr)
        return hdr, data

    def _read_segments(
        self, key: str, start: int, stop: int, fingerprint: str
    ) -> tuple[BlobHeader, list[tuple[Segment, memoryview]]] | None:
        for attempt in range(2):
            hdr, cached = self._header(key, fresh=attempt > 0)
            if hdr is None:
                return None
            self._check_header(hdr, key, fingerprint)
            if stop > hdr.num_layers:
                raise LayerRangeError(
                    f"layers [{start}, {stop}) requested, chunk {key[:16]} has {hdr.num_layers}"
                )
            segs = hdr.segments_for(start, stop)
            lo = segs[0].offset
            n = segs[-1].offset + segs[-1].length - lo
            data = self._read_counted(key, hdr.data_start + lo, n)
            if data is None or (len(data) < n and not self._exists(key)):
                self._forget(key)
                return None  # deleted or evicted meanwhile: a plain miss
            mv = memoryview(data)
            try:
                out = []
                for s in segs:
                    seg = mv[s.offset - lo : s.offset - lo + s.length]
                    blobfmt.check_segment(s, seg, self.auth, self.verify)
                    out.append((s, seg))
                return hdr, out
            except BlobError:
                if cached and attempt == 0:
                    self._forget(key)  # the blob may have been rewritten since we cached its header
                    continue
                raise
        return None


def decode_blob(
    hdr: BlobHeader,
    data: bytes | memoryview,
    start: int,
    stop: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode layers ``[start, stop)`` from a whole, verified blob."""
    mv = memoryview(data)
    segs = [
        (s, mv[hdr.data_start + s.offset : hdr.data_start + s.offset + s.length])
        for s in hdr.segments_for(start, stop)
    ]
    return blobfmt.decode_segments(hdr, segs, start, stop, device, dtype)


def _short(key: str | None) -> str:
    return f"chunk {key[:16]}" if key else ""
