"""In-process chunk KV store: encoded blobs in a dict, bounded by blob bytes, LRU eviction, thread-safe.

Blobs (not tensors) are kept so the bound counts exactly what a disk or Redis would hold (int8
halves it), and every read hands out fresh tensors that the caller may modify in place. Segment
checksums are not re-verified by default: these bytes never left process memory.
"""

from __future__ import annotations

import math
import threading

from cachetools import LRUCache

from ragkv.store.base import BlobStore, StoreWriteError, check_max_bytes


class MemoryStore(BlobStore):
    """LRU over whole blobs; ``max_bytes=None`` means unbounded."""

    def __init__(self, max_bytes: int | None = None, verify: bool = False, **options) -> None:
        """``options``: :class:`BlobStore`'s (``codec``, ``codec_options``, ``hmac_key``, ``codecs``)."""
        super().__init__(verify=verify, **options)
        self.max_bytes = check_max_bytes(max_bytes)
        self._blobs: LRUCache[str, bytes] = LRUCache(
            math.inf if self.max_bytes is None else self.max_bytes, getsizeof=len
        )
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"MemoryStore(max_bytes={self.max_bytes})"

    def _read(self, key: str, offset: int, length: int | None) -> bytes | memoryview | None:
        with self._lock:
            blob = self._blobs.get(key)  # a hit becomes the most recently used
            if blob is None:
                return None
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
            if self._blobs.get(key) is not None:
                if not overwrite:
                    return False
                del self._blobs[key]
            while self._blobs and self._blobs.currsize + len(blob) > self._blobs.maxsize:
                evicted.append(self._blobs.popitem()[0])  # the least recently used
            self._blobs[key] = blob
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
            return self._blobs.pop(key, None) is not None

    def _keys(self) -> list[str]:
        with self._lock:
            return list(self._blobs)

    def _nbytes(self) -> int:
        with self._lock:
            return int(self._blobs.currsize)

    def _close(self) -> None:
        with self._lock:
            self._blobs.clear()
