"""Where the engine gets a request's chunk KV: in memory now, or fetched (store / compute) in background.

A request names each retrieved chunk by one of:

* a token-id list: its KV is looked up by content key (memory, then the store) and computed when
  missing (``compute_missing``), then stored;
* a :class:`ChunkRef` of a chunk already in the store: its token ids and KV
  come from the store; a miss is an error (there is nothing to recompute from);
* a :class:`~ragkv.kv.ChunkKV` already in hand.

``ready_now`` answers without I/O; everything else goes through ``fetch``, which the engine runs on
its fetcher thread (KVFetcher's ``waiting_for_KV`` queue) so that requests needing no I/O go on.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ragkv.kv.chunk import ChunkKV, chunk_key
from ragkv.kv.compute import compute_chunk_kv


class ChunkNotFoundError(LookupError):
    """A chunk named by key is not in the store (and its tokens are unknown, so it cannot be computed)."""


@dataclass(frozen=True)
class ChunkRef:
    """A chunk stored under ``key`` (``ChunkKV.key``) in the engine's chunk store."""

    key: str


def as_tokens(item) -> list[int] | None:
    """Token ids of a chunk item when known without I/O, else None."""
    if isinstance(item, ChunkKV):
        return item.token_ids.tolist()
    if isinstance(item, torch.Tensor):
        return [int(t) for t in item.flatten().tolist()]
    if isinstance(item, (list, tuple)):
        return [int(t) for t in item]
    return None


def normalize_item(item):
    """Validate one chunk item (token ids, :class:`ChunkRef` or ``ChunkKV``)."""
    if isinstance(item, (ChunkRef, ChunkKV)):
        return item
    if isinstance(item, (list, tuple, torch.Tensor)):
        toks = as_tokens(item)
        if not toks:
            raise ValueError("empty chunk in the request")
        return toks
    raise TypeError(f"a chunk must be token ids, a ChunkRef or a ChunkKV, got {type(item).__name__}")


class ChunkProvider:
    """Chunk KV for one model: an in-process LRU of ``cache_bytes`` over an optional ``ChunkStore``."""

    def __init__(self, model, store=None, compute_missing: bool = True, cache_bytes: int = 1 << 30):
        self.model = model
        self.store = store
        self.compute_missing = compute_missing
        self.cache_bytes = cache_bytes
        self._mem: OrderedDict[str, ChunkKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = {"memory_hits": 0, "store_hits": 0, "computed": 0, "fetch_s": 0.0}
        self._stats_lock = threading.Lock()

    def _count(self, name: str, n: float = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    def _key(self, item) -> str:
        if isinstance(item, ChunkRef):
            return item.key
        return chunk_key(item, self.model.fingerprint)

    def remember(self, kv: ChunkKV) -> None:
        """Keep ``kv`` in the in-process cache (LRU by bytes)."""
        with self._lock:
            if kv.key in self._mem:
                self._mem.move_to_end(kv.key)
                return
            self._mem[kv.key] = kv
            self._bytes += kv.nbytes()
            while self._bytes > self.cache_bytes and len(self._mem) > 1:
                _, old = self._mem.popitem(last=False)
                self._bytes -= old.nbytes()

    def ready_now(self, item, need_kv: bool):
        """The resolved item (ChunkKV, or token ids when KV is not needed) if available without I/O."""
        if isinstance(item, ChunkKV):
            return item if need_kv else item.token_ids.tolist()
        if not need_kv and not isinstance(item, ChunkRef):
            return item
        with self._lock:
            kv = self._mem.get(self._key(item))
            if kv is not None:
                self._mem.move_to_end(kv.key)
                self._count("memory_hits")
                return kv if need_kv else kv.token_ids.tolist()
        return None

    def fetch(self, item, need_kv: bool):
        """Resolve ``item`` with I/O or compute (store read, else compute and store)."""
        now = self.ready_now(item, need_kv)
        if now is not None:
            return now
        t0 = time.perf_counter()
        key = self._key(item)
        kv = self.store.get(key, self.model.fingerprint) if self.store is not None else None
        if kv is not None:
            kv = kv.to(self.model.device, self.model.dtype)
            self._count("store_hits")
        elif isinstance(item, ChunkRef):
            raise ChunkNotFoundError(f"chunk {key[:16]}... is not in the chunk store")
        elif self.compute_missing:
            kv = compute_chunk_kv(self.model, item)
            self._count("computed")
            if self.store is not None:
                self.store.put(kv)
        else:
            raise ChunkNotFoundError(f"chunk {key[:16]}... is not stored and compute_missing is off")
        self.remember(kv)
        self._count("fetch_s", time.perf_counter() - t0)
        return kv if need_kv else kv.token_ids.tolist()

    def fetch_all(self, items: Sequence, need_kv: bool) -> list:
        return [self.fetch(it, need_kv) for it in items]


class KVFetcher:
    """Background fetching (KVFetcher §3.3.1): a standalone thread pool, FCFS over requests."""

    def __init__(self, provider: ChunkProvider, workers: int = 1):
        if workers < 1:
            raise ValueError("fetch workers must be >= 1")
        self.provider = provider
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ragkv-fetch")

    def submit(self, items: Sequence, need_kv: bool, on_done: Callable[[Future], None]) -> Future:
        fut = self._pool.submit(self.provider.fetch_all, list(items), need_kv)
        fut.add_done_callback(on_done)
        return fut

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
