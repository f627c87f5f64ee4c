"""Where the engine gets a request's chunk KV: at hand now, or fetched in the background, both
through the owner's :class:`~ragkv.blend.resolver.ChunkResolver`.

A chunk item is a token-id list (looked up by content, computed when missing and stored), a
:class:`~ragkv.blend.spans.ChunkRef` of a stored chunk (a miss is an error: nothing to recompute
from), or a :class:`~ragkv.kv.ChunkKV` in hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ragkv.blend.resolver import ChunkNotFoundError, ChunkResolver
from ragkv.blend.spans import ChunkRef
from ragkv.kv.chunk import ChunkKV

__all__ = ["ChunkNotFoundError", "ChunkRef", "KVFetcher", "as_tokens", "normalize_item"]


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


class KVFetcher:
    """Background fetching (KVFetcher §3.3.1) of the engine's chunk KV through its owner's
    :class:`~ragkv.blend.resolver.ChunkResolver`: a standalone thread, FCFS over requests."""

    def __init__(self, resolver: ChunkResolver, compute_missing: bool = True):
        self.resolver = resolver
        self.compute_missing = compute_missing
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragkv-fetch")

    def _key(self, item) -> str:
        return item.key if isinstance(item, ChunkRef) else self.resolver.key(item)

    def ready_now(self, item, need_kv: bool):
        """The resolved item (ChunkKV, or token ids when KV is not needed) if available without I/O."""
        if isinstance(item, ChunkKV):
            return item if need_kv else item.token_ids.tolist()
        if not need_kv and not isinstance(item, ChunkRef):
            return item
        kv = self.resolver.cached(self._key(item))
        if kv is None:
            return None
        return kv if need_kv else kv.token_ids.tolist()

    def fetch(self, item, need_kv: bool):
        """Resolve ``item`` with I/O or compute (memory, the store, else computed and written back)."""
        now = self.ready_now(item, need_kv)
        if now is not None:
            return now
        if isinstance(item, ChunkRef):
            kv = self.resolver.stored_kv(item.key)
        else:
            kv = self.resolver.kv(item, compute_missing=self.compute_missing)
        return kv if need_kv else kv.token_ids.tolist()

    def fetch_all(self, items: Sequence, need_kv: bool) -> list:
        return [self.fetch(it, need_kv) for it in items]

    def submit(self, items: Sequence, need_kv: bool, on_done: Callable[[Future], None]) -> Future:
        fut = self._pool.submit(self.fetch_all, list(items), need_kv)
        fut.add_done_callback(on_done)
        return fut

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
