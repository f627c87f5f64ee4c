"""In-process chunk KV store: encoded blobs in a dict, bounded by blob bytes, LRU eviction, thread-safe.

Blobs (not tensors) are kept so the bound counts exactly what a disk or Redis would hold (int8
halves it), and every read hands out fresh tensors that the caller may modify in place. Segment
checksums are not re-verified by default: these bytes never left process memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ragkv.store.base import BlobStore, StoreWriteError, check_max_bytes


class MemoryStore(BlobStore):
    """LRU over whole blobs; ``max_bytes=None`` means unbounded."""

    def __init__(self, max_bytes: int | None = None, verify: bool = False, **options) -> None:
        """``options``: :class:`BlobStore`'s (``codec``, ``codec_options``, ``hmac_key``, ``codecs``)."""
        super().__init__(verify=verify, **options)
        self.max_bytes = check_max_bytes(max_bytes)
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"MemoryStore(max_bytes={self.max_bytes})"

    def _read(self, key: str, offset: int, length: int | None) -> bytes | memoryview | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is None:
                return None
            self._blobs.move_to_end(key)
        if offset == 0 and (length is None or length >= len(blob)):
            return blob
        return memoryview(blob)[offset : None if length is None else offset + length]

    def _write(self, key: str, blob: bytes, overwrite: bool) -> bool:
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            raise StoreWriteError(
                f"blob of {len(blob)} bytes exceeds the memory bound of {self.max_bytes} bytes"
            )
        evicted = []
        with self._lock:
            old = self._blobs.get(key)
            if old is not None and not overwrite:
                self._blobs.move_to_end(key)
                return False
            if old is not None:
                self._size -= len(self._blobs.pop(key))
            if self.max_bytes is not None:
                while self._blobs and self._size + len(blob) > self.max_bytes:
                    k, b = self._blobs.popitem(last=False)
                    self._size -= len(b)
                    evicted.append(k)
            self._blobs[key] = blob
            self._size += len(blob)
        for k in evicted:
            self._forget(k)
        if evicted:
            self._count("evictions", len(evicted))
        return True

    def _exists(self, key: str) -> bool:
        with self._lock:
            return key in self._blobs

    def _delete(self, key: str) -> bool:
        with self._lock:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self._size -= len(blob)
        return blob is not None

    def _keys(self) -> list[str]:
        with self._lock:
            return list(self._blobs)

    def _nbytes(self) -> int:
        with self._lock:
            return self._size

    def _close(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._size = 0
