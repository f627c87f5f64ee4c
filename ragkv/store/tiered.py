"""A memory tier in front of any blob store: write-through, read-through with promotion.

Whole-chunk reads promote the verified blob into memory at once. Per-layer reads (pipelined
loading) are served from the backend segment by segment; the verified segments are staged and,
once every segment of a chunk has been read, reassembled into a blob and promoted, so the next
query for that chunk is served from memory without ever reading a chunk twice from the backend.
The memory tier holds exactly the backend's encoded blobs, so promotion costs no re-encoding.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from cachetools import LRUCache

from ragkv.kv.chunk import ChunkKV
from ragkv.store import blob as blobfmt
from ragkv.store.base import BlobStore, ChunkStore, decode_blob
from ragkv.store.blob import BlobHeader
from ragkv.store.memory import MemoryStore


class TieredStore(ChunkStore):
    """``memory`` (a bounded :class:`MemoryStore`) caching ``backend`` (local dir, Redis, ...)."""

    def __init__(
        self,
        backend: BlobStore,
        mem_bytes: int = 1 << 30,
        memory: MemoryStore | None = None,
        max_staged: int = 64,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.codec, self.auth = backend.codec, backend.auth
        if memory is None:
            memory = MemoryStore(
                max_bytes=mem_bytes, codec=backend.codec, hmac_key=backend.auth, codecs=backend.allowed_codecs
            )
        self.memory = memory
        self.max_staged = max_staged
        # key -> (header, {segment start layer: verified bytes}) of chunks being read layer by layer; the
        # least recently read partial chunk is dropped past ``max_staged``
        self._staged: LRUCache[str, tuple[BlobHeader, dict[int, bytes]]] = LRUCache(max_staged)
        self._stage_lock = threading.Lock()
        self._stats.update(memory_hits=0, backend_hits=0)

    def sibling(self, name: str) -> ChunkStore | None:
        """The backend's namespace ``name`` (no memory tier: the KV tree keeps its own RAM tier)."""
        return self.backend.sibling(name)

    def describe(self) -> str:
        return f"TieredStore({self.memory.describe()} -> {self.backend.describe()})"

    # -- writes ---------------------------------------------------------------------------------
    def _stored(self, key: str) -> bool:
        return self.backend.contains(key)  # the durable copy decides (memory may hold one the backend missed)

    def put_blob(self, key: str, blob: bytes) -> bool:
        ok_backend = self.backend.put_blob(key, blob)
        ok_memory = self.memory.put_blob(key, blob)
        self._count("puts" if ok_backend else "put_errors")
        # stored somewhere is stored: hot chunks keep being served from memory while the backend is down
        return ok_backend or ok_memory

    def expect_geometry(self, fingerprint: str, geometry) -> None:
        super().expect_geometry(fingerprint, geometry)
        self.memory.expect_geometry(fingerprint, geometry)
        self.backend.expect_geometry(fingerprint, geometry)

    def known_corrupt(self, key: str) -> bool:
        return self.memory.known_corrupt(key) or self.backend.known_corrupt(key)

    def mark_corrupt(self, key: str) -> None:
        self.memory.mark_corrupt(key)
        self.backend.mark_corrupt(key)

    def delete(self, key: str, strict: bool = False) -> bool:
        with self._stage_lock:
            self._staged.pop(key, None)
        a = self.memory.delete(key)
        b = self.backend.delete(key, strict)
        return a or b

    # -- reads ----------------------------------------------------------------------------------
    def _get(self, key: str, fingerprint: str, device, dtype) -> ChunkKV | None:
        if self.memory.contains(key):
            chunk = self.memory.get(key, fingerprint, device, dtype)
            if chunk is not None:
                return self._hit("memory_hits", chunk)
        got = self.backend.fetch(key, fingerprint)
        if got is None:
            return self._miss()
        hdr, data = got
        data = bytes(data)
        self.memory.put_blob(key, data)
        k, v = decode_blob(hdr, data, 0, hdr.num_layers, device, dtype)
        return self._hit("backend_hits", blobfmt.to_chunk(hdr, k, v))

    def _load_layers(
        self, key: str, start: int, stop: int, fingerprint: str, device, dtype, out
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.memory.contains(key):
            kv = self.memory.load_layers(key, start, stop, fingerprint, device, dtype, out)
            if kv is not None:
                return self._hit("memory_hits", kv)
        got = self.backend.read_segments(key, start, stop, fingerprint)
        if got is None:
            return self._miss()
        hdr, segs = got
        self._stage(key, hdr, segs)
        return self._hit("backend_hits", blobfmt.decode_segments(hdr, segs, start, stop, device, dtype, out))

    def header(self, key: str) -> BlobHeader | None:
        return self.memory.header(key) if self.memory.contains(key) else self.backend.header(key)

    def contains(self, key: str) -> bool:
        return self.memory.contains(key) or self.backend.contains(key)

    def keys(self) -> list[str]:
        return sorted(set(self.backend.keys()) | set(self.memory.keys()))

    def nbytes(self) -> int:
        """Bytes in the backend (the memory tier only caches them)."""
        return self.backend.nbytes()

    def stats(self) -> dict:
        out = super().stats()
        out["memory"] = self.memory.stats()
        out["backend_store"] = self.backend.stats()
        out["bytes_read"] = out["backend_store"]["bytes_read"]
        out["bytes_written"] = out["backend_store"]["bytes_written"]
        out["errors"] += out["memory"]["errors"] + out["backend_store"]["errors"]
        out["corrupt"] += out["memory"]["corrupt"] + out["backend_store"]["corrupt"]
        out["evictions"] = out["memory"]["evictions"]
        return out

    def close(self) -> None:
        self.memory.close()
        self.backend.close()

    # -- internals ------------------------------------------------------------------------------
    def _hit(self, which: str, result):
        self._count("hits")
        self._count(which)
        return result

    def _miss(self):
        self._count("misses")
        return None

    def _stage(self, key: str, hdr: BlobHeader, segs) -> None:
        """Keep verified segments; promote the chunk once all of them have been read."""
        with self._stage_lock:
            entry = self._staged.get(key)
            if entry is None or entry[0].total_size != hdr.total_size or entry[0].created != hdr.created:
                entry = (hdr, {})
            parts = entry[1]
            for s, data in segs:
                parts[s.start] = bytes(data)
            complete = len(parts) == len(hdr.segments)
            if complete:
                self._staged.pop(key, None)
            else:
                with contextlib.suppress(ValueError):  # max_staged=0 stages nothing
                    self._staged[key] = entry  # now the most recently read
        if complete:
            blob = blobfmt.assemble(hdr, [parts[s.start] for s in hdr.segments], self.backend.auth)
            self.memory.put_blob(key, blob)
