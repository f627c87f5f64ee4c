"""The one chunk-KV resolver: every path that needs a chunk's KV for a prompt gets it here.

A chunk's KV comes, in this order, from an in-process LRU of whole :class:`ChunkKV` (computed
chunks, or whole reads for callers that need KV in hand), from the store (lazily, one blob segment
at a time, pipelined against the blend loop by :meth:`ChunkResolver.prefill`), or is computed. A
stored chunk that fails to load mid-prefill is recomputed and the prefill retried
(:func:`ragkv.blend.pipeline.prefill_with_recovery`: the one recovery loop). Computed KV is written
back by the *owner's* policy: a bare :class:`ragkv.LLM` stores whatever it computes when it has a
store; a :class:`ragkv.RAG` stores KV only for chunks its index references, checked under its lock,
so a chunk deleted while a query runs stays deleted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from cachetools import LRUCache

from ragkv.blend.core import PrefillResult
from ragkv.blend.locate import ChunkLocator, Located, split_at_chunks
from ragkv.blend.pipeline import ChunkLoadError, StoredChunk, pipelined_factory, prefill_with_recovery
from ragkv.blend.plan import BlendPlan
from ragkv.kv.chunk import ChunkKV, chunk_key
from ragkv.model.forward import compute_chunk_kv
from ragkv.store.base import WarnThrottle

log = logging.getLogger("ragkv.blend")

#: ``write_back(kv) -> stored?``: the owner stores ``kv`` if it still wants it
WritePolicy = Callable[[ChunkKV], bool]


class ChunkNotFoundError(LookupError):
    """A chunk named by key alone is not stored (its tokens are unknown, so it cannot be computed)."""


def store_always(store) -> WritePolicy:
    """A bare model's policy: computed KV goes to its store (a cache its owner manages)."""
    return lambda kv: bool(store.put(kv))


class PieceSlice:
    """Rows ``[lo, hi)`` of a per-layer KV piece (a stored chunk partly covered by the engine's cache)."""

    def __init__(self, piece, lo: int, hi: int):
        self.piece, self.lo, self.hi = piece, lo, hi

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo

    @property
    def token_ids(self) -> list[int]:
        ids = self.piece.token_ids
        return [int(t) for t in ids[self.lo : self.hi]]

    @property
    def key(self) -> str | None:
        return getattr(self.piece, "key", None)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.piece.layer_kv(layer)
        if self.lo == 0 and self.hi == k.shape[0]:
            return k, v
        return k[self.lo : self.hi], v[self.lo : self.hi]


class Resolved(list):
    """Prefill items of a prompt's chunks. ``hits``: how many came from memory or the store;
    ``computed``: the KV computed for them (at resolve time or after a failed load)."""

    def __init__(self):
        super().__init__()
        self.hits = 0
        self.computed: list[ChunkKV] = []


class ChunkResolver:
    """Chunk KV of one model for prompts: memory LRU, then the store, else computed and written back.

    ``store``: a :class:`ragkv.store.ChunkStore` or None (memory only). ``write_back``: the owner's
    policy for computed KV (default :func:`store_always` when there is a store); it runs on one
    background thread unless ``background_writes`` is False. ``cache_bytes``: the LRU's bound.
    ``pipelined``: prefill loads layer ``l+1`` while layer ``l`` computes.
    """

    def __init__(
        self,
        model,
        store=None,
        *,
        write_back: WritePolicy | None = None,
        cache_bytes: int = 1 << 30,
        pipelined: bool = True,
        background_writes: bool = True,
    ):
        self.model = model
        #: ``model`` writes, keys and checks chunk KV; prompts run on the model itself, which for a
        #: chunk-KV writer's model (:class:`ragkv.adapter.writer.WriterModel`) is its base
        self.prompt_model = getattr(model, "prompt_model", model)
        self.store = store
        self.write_back = write_back or (store_always(store) if store is not None else None)
        self.cache_bytes = int(cache_bytes)
        self.pipelined = pipelined
        #: the memory LRU of chunk KV, bounded by its tensors' bytes
        self._mem: LRUCache[str, ChunkKV] = LRUCache(max(self.cache_bytes, 1), getsizeof=ChunkKV.nbytes)
        self._lock = threading.Lock()
        self._writer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragkv-kv-writeback")
            if background_writes
            else None
        )
        self.counters = {
            "memory_hits": 0,
            "kv_hits": 0,
            "kv_misses": 0,
            "kv_recomputed_bad": 0,
            "computed": 0,
            "write_backs": 0,
            "write_back_failures": 0,
        }
        self._warn = WarnThrottle(log)
        #: ``locator()``: the stored chunks to look for inside flat prompts (transparent reuse), e.g.
        #: a RAG's corpus; None: a prompt's chunks are only those given explicitly
        self.locator: Callable[[], ChunkLocator | None] | None = None

    # ---- keys and the memory LRU -------------------------------------------------------------
    def key(self, token_ids: Sequence[int]) -> str:
        """The content key of a chunk for this model."""
        return chunk_key([int(t) for t in token_ids], self.model.fingerprint)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def cached(self, key: str) -> ChunkKV | None:
        """The chunk's KV if it is in memory (no I/O)."""
        with self._lock:
            kv = self._mem.get(key)  # a hit becomes the most recently used
            if kv is not None:
                self.counters["memory_hits"] += 1
            return kv

    def remember(self, kv: ChunkKV) -> None:
        """Keep ``kv`` in the memory LRU (bounded by ``cache_bytes``: the least recently used chunks
        go first; a chunk larger than the whole bound is not kept)."""
        if self.cache_bytes <= 0:
            return
        with self._lock:
            if self._mem.get(kv.key) is not None:  # already kept: now the most recently used
                return
            with contextlib.suppress(ValueError):  # cachetools' "value too large": larger than the bound
                self._mem[kv.key] = kv

    def forget(self, keys) -> None:
        """Drop chunks from memory (their documents were deleted)."""
        with self._lock:
            for k in keys:
                self._mem.pop(k, None)

    # ---- computing and writing back ----------------------------------------------------------
    def compute(self, token_ids: Sequence[int], write_back: bool = True) -> ChunkKV:
        """Compute a chunk's KV (chunk convention), keep it in memory and write it back by policy."""
        kv = compute_chunk_kv(self.model, [int(t) for t in token_ids])
        self._count("computed")
        self.remember(kv)
        if write_back and self.write_back is not None:
            if self._writer is None:
                self._write(kv)
            else:
                self._writer.submit(self._write, kv)
        return kv

    def save(self, kv: ChunkKV) -> bool:
        """Store ``kv`` now because a caller with write access asked (``save`` of ``/v1/completions``,
        which may serve another index sharing the store), whatever the owner's policy; stored?"""
        if self.store is None:
            return False
        try:
            ok = bool(self.store.put(kv))
        except OSError as e:
            self._warn.warning("save", "could not save the KV of chunk %s: %s", kv.key[:16], e)
            ok = False
        self._count("write_backs" if ok else "write_back_failures")
        return ok

    def compute_into_store(self, token_ids: Sequence[int]) -> bool:
        """Compute a chunk's KV and put it in the store now (ingest: not kept in memory); stored?"""
        if self.store is None:
            raise ValueError("compute_into_store needs a store")
        kv = compute_chunk_kv(self.model, [int(t) for t in token_ids])
        self._count("computed")
        return bool(self.store.put(kv))

    def _write(self, kv: ChunkKV) -> None:
        try:
            ok = self.write_back(kv)
        except OSError as e:  # store down, disk full: costs a recompute next time, not this answer
            ok = False
            self._warn.warning("write-back", "write-back of chunk %s failed: %s", kv.key[:16], e)
        except Exception:  # a bug: logged with its traceback (a background thread has no caller)
            log.exception("write-back of chunk %s failed", kv.key[:16])
            ok = False
        if ok:
            self._count("write_backs")
        elif ok is False:
            self._count("write_back_failures")

    # ---- resolving ---------------------------------------------------------------------------
    def kv(self, token_ids: Sequence[int], compute_missing: bool = True) -> ChunkKV:
        """The whole KV of a chunk in hand: memory, then one store read, else computed (and written back)."""
        ids = [int(t) for t in token_ids]
        key = self.key(ids)
        kv = self.cached(key)
        if kv is not None:
            return kv
        kv = self._read(key)
        if kv is not None:
            return kv
        if not compute_missing:
            raise ChunkNotFoundError(f"chunk {key[:16]}... is not stored and computing it is off")
        return self.compute(ids)

    def stored_kv(self, key: str) -> ChunkKV:
        """The whole KV of a chunk named by key alone: memory or the store, else :class:`ChunkNotFoundError`."""
        kv = self.cached(key) or self._read(key)
        if kv is None:
            raise ChunkNotFoundError(f"chunk {key[:16]}... is not in the chunk store")
        return kv

    def _read(self, key: str) -> ChunkKV | None:
        kv = self.store.get(key, self.model.fingerprint) if self.store is not None else None
        if kv is None:
            self._count("kv_misses")
            return None
        self._count("kv_hits")
        kv = kv.to(self.model.device, self.model.dtype)
        self.remember(kv)
        return kv

    def items(
        self,
        chunks: Sequence,
        *,
        write_back: bool = True,
        at: Sequence[int] | None = None,
        check: Callable[[], None] | None = None,
    ) -> Resolved:
        """Prefill items of ``chunks`` (token-id lists, or ``(token_ids, key)`` of chunks the caller
        knows): KV in memory, else a lazily loaded :class:`StoredChunk`, else computed now. A key that
        is not the chunk's content key for this model is never looked up: the chunk is computed.
        ``at``: each chunk's position among the prefill's items (default: these items alone);
        ``check()`` runs before each chunk (a cancellation check)."""
        out = Resolved()
        for i, c in enumerate(chunks):
            if check is not None:
                check()
            ids, key = (list(c[0]), c[1]) if isinstance(c, tuple) else ([int(t) for t in c], None)
            own = self.key(ids)
            item = self.cached(own)
            if item is None and self.store is not None and key in (None, own):
                try:
                    item = StoredChunk(
                        self.store, own, ids, self.model.fingerprint, index=i if at is None else at[i]
                    )
                    self._count("kv_hits")
                except ChunkLoadError:
                    item = None
            if item is None:
                self._count("kv_misses")
                item = self.compute(ids, write_back)
                out.computed.append(item)
            else:
                out.hits += 1
            out.append(item)
        return out

    def prefill(
        self,
        prefix: Sequence[int],
        items: list,
        suffix: Sequence[int],
        plan: BlendPlan,
        *,
        write_back: bool = True,
        on_recompute: Callable[[list[int]], None] | None = None,
        **prefill_kw,
    ) -> PrefillResult:
        """:func:`ragkv.blend.prefill` of ``plan`` over :meth:`items`; a stored chunk that fails to load
        mid-way is recomputed (``on_recompute(tokens)`` first, e.g. a cancellation check) and the
        prefill retried."""

        def recompute(toks: list[int]) -> ChunkKV:
            if on_recompute is not None:
                on_recompute(toks)
            kv = self.compute(toks, write_back)
            if isinstance(items, Resolved):
                items.computed.append(kv)
                items.hits -= 1
            return kv

        def bad(e: ChunkLoadError) -> None:
            self._warn.warning(
                "load", "stored KV of chunk %s failed to load (layer %d): recomputing it", e.key[:16], e.layer
            )
            self._count("kv_recomputed_bad")

        if self.pipelined and "source_factory" not in prefill_kw:
            prefill_kw["source_factory"] = pipelined_factory(self.model)
        return prefill_with_recovery(
            self.prompt_model,
            prefix,
            items,
            suffix,
            plan,
            recompute=recompute,
            on_load_error=bad,
            **prefill_kw,
        )

    def locate(self, prompt_ids: Sequence[int]) -> tuple[list[int], Resolved, list[int]] | None:
        """A flat prompt as ``(prefix, items, suffix)`` with the stored chunks found inside it as
        (slices of) their stored KV and the text around them as token lists; None when none is found
        (or no locator is set). Boundary tokens that tokenized differently stay text (computed)."""
        found = self.find(prompt_ids)
        return self.pieces(prompt_ids, found) if found else None

    def find(
        self,
        prompt_ids: Sequence[int],
        given: Sequence[Located] = (),
        visible: Callable[[str], bool] | None = None,
    ) -> list[Located]:
        """The stored chunks inside ``prompt_ids`` (none when no locator is set; see :meth:`locate`)
        in prompt order; with ``given`` (non-overlapping, in prompt order: chunks the caller placed),
        those are kept and the others are looked for only in the rows between them. ``visible``: only
        chunks whose key it accepts are candidates (a caller's collection; None: all)."""
        loc = self.locator() if self.locator is not None else None
        if loc is None:
            return list(given)
        ids = [int(t) for t in prompt_ids]
        out: list[Located] = []
        pos = 0
        for g in [*given, None]:
            end = g.start if g is not None else len(ids)
            if end > pos:  # one linear pass over each gap: the whole prompt costs one pass in all
                out += [replace(f, start=f.start + pos) for f in loc.find(ids[pos:end], visible)]
            if g is not None:
                out.append(g)
                pos = g.stop
        return out

    def pieces(
        self,
        prompt_ids: Sequence[int],
        found: Sequence[Located],
        *,
        write_back: bool = True,
        check: Callable[[], None] | None = None,
    ) -> tuple[list[int], Resolved, list[int]]:
        """``prompt_ids`` as ``(prefix, items, suffix)``: the non-overlapping chunks ``found`` (in prompt
        order) as their resolved KV (a :class:`PieceSlice` where only rows ``[lo, hi)`` are used),
        the text between them as token lists. ``write_back``/``check``: see :meth:`items`."""
        prefix, parts, suffix = split_at_chunks(prompt_ids, found)
        slots = [i for i, p in enumerate(parts) if isinstance(p, Located)]
        chunks = self.items(
            [(list(f.token_ids), f.key) for f in found], write_back=write_back, at=slots, check=check
        )
        for slot, f, item in zip(slots, found, chunks, strict=True):
            whole = f.lo == 0 and f.hi == len(f.token_ids)
            parts[slot] = item if whole else PieceSlice(item, f.lo, f.hi)
        out = Resolved()
        out.extend(parts)
        out.hits, out.computed = chunks.hits, chunks.computed
        return prefix, out, suffix

    # ---- lifetime ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for pending write-backs."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish pending write-backs."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
