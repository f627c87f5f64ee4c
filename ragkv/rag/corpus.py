"""The corpus side of a RAG: documents in, chunk KV kept in step with them.

Ingest (split, embed, index, precompute chunk KV), delete, garbage collection, quotas, write-back of
computed KV and the locks that order them; it owns the index, the store, the embedder and the one
chunk resolver of its KV (whose write-back policy is :meth:`Corpus._write_back`). The answering side
(:mod:`ragkv.rag.answering`) reads it; :class:`ragkv.rag.RAG` composes both.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ragkv.blend.locate import ChunkLocator
from ragkv.blend.resolver import ChunkResolver, WarnThrottle
from ragkv.kv.chunk import ChunkKV, chunk_key
from ragkv.rag import writers
from ragkv.rag.collections import collection_name
from ragkv.rag.embedder import DEFAULT_EMBEDDER, Embedder
from ragkv.rag.index import ChunkIndex, PendingDocument, text_sha
from ragkv.rag.quotas import (
    QuotaExceededError,
    Quotas,
    Usage,
    check_collection,
    check_document,
    measure_kv_bytes_per_token,
)
from ragkv.rag.splitter import split_tokens
from ragkv.store import default_store, default_store_url

log = logging.getLogger("ragkv.rag")


class IngestCancelled(RuntimeError):
    """An ingest stopped before its commit (client gone, deadline, shutdown): nothing of it is indexed."""


@dataclass
class Document:
    """Text to ingest, with a stable id (derived from the text when not given) and metadata."""

    text: str
    id: str | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError("document text must be a non-empty string")
        if self.id is None:
            self.id = hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclass
class IngestReport:
    doc_ids: list[str] = field(default_factory=list)
    documents_added: int = 0
    documents_unchanged: int = 0
    chunks_added: int = 0
    kv_computed: int = 0
    kv_already_stored: int = 0
    #: computed but not stored (store full, down, disk full): indexed and answerable, recomputed when used
    kv_not_stored: int = 0
    seconds: float = 0.0


@dataclass
class _Shared:
    """What views of one corpus share: the chunk locator, built on first use and then updated by
    every commit and delete (under the corpus's KV lock)."""

    locator: ChunkLocator | None = None


class Corpus:
    """Documents and their chunk KV under ``data_dir``: ingest, delete, GC, quotas, write-back, locks."""

    def __init__(
        self,
        model,
        data_dir: str | Path,
        store=None,
        embedder: Embedder | str = DEFAULT_EMBEDDER,
        chunk_tokens: int = 512,
        overlap: int = 0,
        metric: str = "cosine",
        ingest_batch: int = 32,
        quotas: Quotas | None = None,
        pipelined: bool = True,
        collect_garbage_on_open: bool = False,
    ):
        self.model = model
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if store is None or isinstance(store, (str, Path, dict)):
            # the applications' default (the CLI's and the service's): the compact codec unless the
            # URL names one, and blobs of the earlier raw default still decode, so a data folder
            # written by `ragkv-server serve` / `ragkv-server ingest` is read here, not recomputed
            spec = (
                dict(store)
                if isinstance(store, dict)
                else {"url": str(store or default_store_url(self.data_dir))}
            )
            if "url" not in spec:
                raise ValueError(f"store config needs a 'url' key, got {sorted(spec)}")
            store = default_store(str(spec.pop("url")), model=self.model, **spec)
        self.store = store
        #: called with each newly ingested chunk's token ids after its KV is stored (a RAG's
        #: precompute of the exact KV tree's first level: the chunk's KV after the prompt head)
        self.chunk_hooks: list[Callable[[list[int]], None]] = []
        self.embedder = embedder if isinstance(embedder, Embedder) else Embedder(embedder)
        if self.model.tokenizer is None:
            raise ValueError("RAG needs a model with a tokenizer")
        limit = self.model.config.max_position - 1
        if not 1 <= chunk_tokens <= limit:
            raise ValueError(f"chunk_tokens must be in [1, {limit}] for this model")
        self.chunk_tokens, self.overlap = chunk_tokens, overlap
        #: ingest limits (:mod:`ragkv.rag.quotas`), checked before an ingest writes anything
        self.quotas = quotas if quotas is not None else Quotas()
        #: ingests refused by a quota since start, by limit name
        self.quota_refusals: dict[str, int] = {}
        self.index = ChunkIndex(
            self.data_dir / "index",
            self.embedder.dim,
            metric,
            identity=f"{self.embedder.name}|{self.model.fingerprint}",
        )
        #: the one source of chunk KV for every query path over this corpus: computed KV is written
        #: back only while the index references it (:meth:`_write_back`). No memory LRU: the store is
        #: the cache (a ``tiered`` store adds a memory tier), so deleted KV is gone.
        self.resolver = ChunkResolver(
            self.model, store, write_back=self._write_back, cache_bytes=0, pipelined=pipelined
        )
        #: chunks per ingest step: KV, embedding and the cancellation check go by this many chunks
        self.ingest_batch = max(1, int(ingest_batch))
        #: chunks embedded per ingest step (a waiting query gets the embedder after at most this many).
        #: 2, not 8: query p99 during a 50 MB ingest 1.41x idle vs 2.01x, for ~25% slower embedding of an
        #: ingest running alone (eval.bench_ingest_load, docs/BENCHMARKS.md)
        self.embed_step = 2
        self._ingest_lock = threading.RLock()  # ingests and deletes run one at a time
        # orders "is this key still used?" + store write (write-back) against index change + store delete
        self._kv_lock = threading.Lock()
        self._warn = WarnThrottle(log)
        #: the corpus's chunk locator (:meth:`chunk_locator`), built on first use
        self._corpus = _Shared()
        self.resolver.locator = self.chunk_locator
        if hasattr(store, "pinned"):  # a size bound evicts KV no chunk references first
            store.pinned = self.index.references
        # several writers on one data folder (ragkv.rag.writers): this process's intents carry its token
        if (lock := writers.held(self.data_dir)) is not None:
            self.index.owner = lock.owner
        self._settle()  # KV left unreferenced by a crash (an uncommitted ingest, an unfinished delete)
        if collect_garbage_on_open:
            try:
                self.collect_garbage()
            except writers.DataDirBusy as e:  # other writers' KV before their commits: not garbage
                log.info("no garbage collection on open: %s", e)

    # ---- ingest --------------------------------------------------------------------------------
    def ingest(
        self,
        docs: Iterable[Document | str | dict],
        show_progress: bool = True,
        cancel: Callable[[], bool] | None = None,
        pause: Callable[[], None] | None = None,
        collection: str | None = None,
    ) -> IngestReport:
        """Split, embed, index and precompute every chunk's KV, into ``collection`` (default: the
        default collection). Idempotent: unchanged (and whole) documents are skipped. All documents
        are committed together, or none (:class:`IngestCancelled` when ``cancel()`` turns true). Both
        hooks run between small steps (a chunk's KV, the embedding of ``embed_step`` chunks, a
        document's split): ``pause()`` may block to let other work (the service's queries) go first.

        Quotas (``self.quotas``, :mod:`ragkv.rag.quotas`): every changed document is split first; one
        over ``max_document_tokens``, or a collection that the commit would take over a collection
        limit, refuses the whole call (:class:`~ragkv.rag.quotas.QuotaExceededError`) before any KV,
        write-ahead record or chunk is written."""
        coll = collection_name(collection)
        docs = [self._as_document(d) for d in docs]

        def step() -> None:
            if pause is not None:
                pause()
            if cancel is not None and cancel():
                raise IngestCancelled("ingest cancelled before its commit; nothing of it was indexed")

        with self._ingest_lock:
            try:
                return self._ingest(docs, show_progress, step, coll)
            except QuotaExceededError as e:  # refused before anything was written
                self.quota_refusals[e.limit] = self.quota_refusals.get(e.limit, 0) + 1
                raise
            finally:
                self._settle()  # KV of an ingest that did not commit, KV of replaced chunks

    def _ingest(
        self, docs: list[Document], show_progress: bool, step: Callable[[], None], coll: str
    ) -> IngestReport:
        t0 = time.perf_counter()
        rep = IngestReport(doc_ids=list(dict.fromkeys(d.id for d in docs)))
        fp = self.model.fingerprint
        # 1. plan: which documents are unchanged, and the chunks (and KV keys) of the others, checked
        # against the quotas before anything (KV, write-ahead record, index) is written
        unchanged: list[str] = []
        planned: dict[str, tuple[Document, str, list, list[str]]] = {}
        for doc in docs:
            sha = text_sha(doc.text)
            if doc.id in planned and planned[doc.id][1] == sha:
                continue  # named twice in one call
            old = self.index.document_sha(doc.id, coll)
            if old == sha and doc.id not in planned and self.index.repair_document(doc.id, coll):
                unchanged.append(doc.id)
                continue
            step()
            parts = split_tokens(self.model.tokenizer, doc.text, self.chunk_tokens, self.overlap)
            check_document(self.quotas, doc.id, sum(len(c.token_ids) for c in parts), coll)
            keys = [chunk_key(list(c.token_ids), fp) for c in parts]
            planned[doc.id] = (doc, sha, parts, keys)
        self._check_collection(coll, planned)
        # 2. write: stored KV of unchanged documents (the store may have lost some since), then the
        # changed documents' KV and embeddings; committed together at the end
        pending: dict[str, PendingDocument] = {}
        mine: set[str] = set()  # keys this ingest computed or found stored for this collection
        for doc_id in unchanged:
            rep.documents_unchanged += 1
            for rec in self.index.chunks_of(doc_id, coll):
                step()
                self._ensure_kv(rec.token_ids, rec.kv_key, rep, coll, mine)  # referenced: no intent
        for doc, sha, parts, all_keys in tqdm(
            planned.values(), desc="ingest", unit="doc", disable=not show_progress
        ):
            rows, vecs = [], []
            for lo in range(0, len(parts), self.ingest_batch):
                step()
                batch = parts[lo : lo + self.ingest_batch]
                keys = all_keys[lo : lo + self.ingest_batch]
                missing = [k for k in dict.fromkeys(keys) if not self.store.contains(k)]
                self.index.add_intents(missing)  # write-ahead: KV about to be stored, not yet referenced
                for c, key in zip(batch, keys, strict=True):
                    step()
                    self._ensure_kv(list(c.token_ids), key, rep, coll, mine)
                    for hook in self.chunk_hooks:
                        hook(list(c.token_ids))
                    # tuples of atomic values only: the garbage collector stops tracking them, so a
                    # large pending ingest does not lengthen every full collection (GIL pauses)
                    rows.append((c.seq, c.text, c.token_ids, key))
                texts = [c.text for c in batch]
                for e in range(0, len(texts), self.embed_step):
                    step()
                    vecs.append(self.embedder.embed(texts[e : e + self.embed_step], background=True))
            vectors = np.concatenate(vecs) if vecs else np.zeros((0, self.embedder.dim), np.float32)
            pending[doc.id] = PendingDocument(doc.id, sha, doc.metadata, rows, vectors, coll)
        step()
        if pending:
            self._commit(list(pending.values()))
            rep.documents_added = len(pending)
            rep.chunks_added = sum(len(p.chunks) for p in pending.values())
        rep.seconds = time.perf_counter() - t0
        log.info("ingest: %s", rep)
        return rep

    def _commit(self, pending: list[PendingDocument]) -> None:
        """Index ``pending`` (one transaction: all or none) and keep the chunk locator in step."""
        with self._kv_lock:
            _, freed = self.index.commit(pending)
            if (loc := self._corpus.locator) is not None:
                loc.remove(freed)
                loc.add((key, toks) for p in pending for (_, _, toks, key) in p.chunks)

    def commit_documents(self, pending: list[PendingDocument]) -> None:
        """Commit documents whose chunk KV another process computed and stored (the Ray pipeline,
        :mod:`ragkv.rag.distributed`): indexed together, or none; KV of replaced chunks no chunk uses any
        more is deleted after. Once this returns, the documents are acknowledged (SQLite, durable).
        The collection quotas hold here as in :meth:`ingest` (:class:`QuotaExceededError`, nothing
        committed); the document quota was checked where the documents were split."""
        with self._ingest_lock:
            try:
                for coll in dict.fromkeys(p.collection for p in pending):
                    self._check_pending(coll, [p for p in pending if p.collection == coll])
                self._commit(pending)
            except QuotaExceededError as e:
                self.quota_refusals[e.limit] = self.quota_refusals.get(e.limit, 0) + 1
                raise
            finally:
                self._settle()

    def _check_pending(self, coll: str, pending: list[PendingDocument]) -> None:
        """:meth:`_check_collection` for documents already split (their chunks' keys and token counts)."""
        if not self.quotas.limits_collections or not pending:
            return
        chunks = [(key, len(toks)) for p in pending for (_, _, toks, key) in p.chunks]
        after = self.index.usage_after(coll, [p.doc_id for p in pending], chunks)
        check_collection(self.quotas, self.usage(coll), self._usage_of(coll, after))

    def committed_shas(self, collection: str | None = None) -> dict[str, str]:
        """``{doc_id: text hash}`` of ``collection``'s committed documents (what a re-run skips)."""
        return self.index.document_shas(collection_name(collection))

    def refresh(self) -> dict:
        """See what other writers of this data folder committed or deleted since this process looked
        (several processes on one index: :mod:`ragkv.rag.writers`): the in-memory FAISS index, collection
        members and counts are reconciled with SQLite, and the chunk locator is rebuilt on next use.
        Returns ``{"added": vectors added, "removed": vectors removed}``; queries go on meanwhile."""
        with self._ingest_lock:
            got = self.index.refresh()
            if got["added"] or got["removed"]:
                with self._kv_lock:
                    self._corpus.locator = None
        return got

    def _check_collection(self, coll: str, planned: dict) -> None:
        """Refuse (:class:`QuotaExceededError`) an ingest of ``planned`` documents that would take the
        collection over a collection quota, counted as the commit would leave it (replaced documents'
        chunks gone); nothing has been written yet."""
        if not self.quotas.limits_collections or not planned:
            return
        chunks = [
            (key, len(c.token_ids))
            for _, _, parts, keys in planned.values()
            for c, key in zip(parts, keys, strict=True)
        ]
        after = self.index.usage_after(coll, list(planned), chunks)
        check_collection(self.quotas, self.usage(coll), self._usage_of(coll, after))

    def usage(self, collection: str | None = None) -> Usage:
        """What ``collection`` (default: the default collection) holds as the quotas count it
        (:mod:`ragkv.rag.quotas`): documents, chunks, tokens, and the stored KV bytes it accounts for."""
        coll = collection_name(collection)
        return self._usage_of(coll, self.index.usage(coll))

    def _usage_of(self, coll: str, counts) -> Usage:
        return Usage(
            coll, counts.documents, counts.chunks, counts.tokens, counts.kv_tokens, self.kv_bytes_per_token()
        )

    def kv_bytes_per_token(self) -> int:
        """Stored KV bytes the quotas account per chunk token: ``quotas.kv_bytes_per_token``, else
        measured once with this RAG's model, store codec and chunk size
        (:func:`~ragkv.rag.quotas.measure_kv_bytes_per_token`)."""
        if self.quotas.kv_bytes_per_token is not None:
            return self.quotas.kv_bytes_per_token
        return measure_kv_bytes_per_token(self.model, self.store, self.chunk_tokens)

    def _ensure_kv(
        self, token_ids: list[int], key: str, rep: IngestReport, coll: str, mine: set[str]
    ) -> None:
        """Compute and store a chunk's KV unless stored (the key is referenced or in the intents).

        Stored KV that only *other collections of this index* use is computed again, so neither the
        report nor the time an ingest takes tells a caller that another collection holds the same chunk
        text. KV no collection of this index uses (written by another process sharing the store, e.g.
        a vLLM connector or a second ragkv, or not yet collected) is reused: it says nothing of them."""
        if key in mine or (self.store.contains(key) and not self._only_others_use(key, coll)):
            mine.add(key)
            rep.kv_already_stored += 1
            return
        mine.add(key)
        if not self.resolver.compute_into_store(token_ids):
            rep.kv_not_stored += 1
            self._warn.warning(
                "ingest-put", "could not store KV of chunk %s; it will be recomputed when retrieved", key[:16]
            )
        rep.kv_computed += 1

    def _only_others_use(self, key: str, coll: str) -> bool:
        """Whether chunks of this index use ``key``, none of them in ``coll``."""
        return self.index.references(key) and not self.index.references(key, coll)

    def chunk_locator(self) -> ChunkLocator | None:
        """The locator of this corpus's chunks inside flat prompts: built on first use (O(chunks),
        under the KV lock so no commit is missed), then kept in step by ingest and delete."""
        corpus = self._corpus
        if corpus.locator is None:
            with self._kv_lock:
                if corpus.locator is None:
                    corpus.locator = ChunkLocator((r.kv_key, r.token_ids) for r in self.index.all_chunks())
        return corpus.locator

    def collect_garbage(self, dry_run: bool = False) -> dict:
        """Delete every stored blob no chunk of this index references (KV of deleted documents, of
        crashed ingests, caches written by other paths). Only for a store this index owns: KV that
        another index sharing the store uses would be deleted too. Returns counts and bytes.
        With other writers on the data folder (:mod:`ragkv.rag.writers`) it is refused
        (:class:`~ragkv.rag.writers.DataDirBusy`): their KV stored before their commits is not garbage."""
        with self._alone() as alone:
            if not alone:
                raise writers.DataDirBusy(
                    f"{self.data_dir} has other writers now (services, ingests): garbage collection deletes "
                    "KV they stored before committing, so it runs only when this process writes alone"
                )
            return self._collect_garbage(dry_run)

    @contextmanager
    def _alone(self) -> Iterator[bool]:
        """Whether this process is the data folder's only writer, held so for the block (a process that
        holds no writer lock is alone by its caller's word: a library RAG)."""
        lock = writers.held(self.data_dir)
        if lock is None:
            yield True
            return
        with lock.alone() as alone:
            yield alone

    def _collect_garbage(self, dry_run: bool) -> dict:
        with self._ingest_lock, self._kv_lock:
            keys = self.store.keys()
            pending = set(self.index.intents())  # an ingest's KV before its commit (settled apart)
            garbage = [k for k in keys if k not in pending and not self.index.references(k)]
            before = self.store.nbytes()
            if not dry_run:
                for k in garbage:
                    self.store.delete(k)
            freed = before - self.store.nbytes() if not dry_run else 0
        if garbage and not dry_run:
            log.info("collected the stored KV of %d unreferenced chunk(s), %d bytes", len(garbage), freed)
        return {
            "blobs": len(keys),
            "unreferenced": len(garbage),
            "deleted": 0 if dry_run else len(garbage),
            "bytes_freed": freed,
        }

    def _settle(self) -> None:
        """Delete stored KV that the write-ahead record lists and no chunk references. A delete the
        store could not do (down, timed out) keeps its intent: retried by the next write or start."""
        with self._alone() as alone, self._kv_lock:
            try:  # alone: every writer's intents (those of writers that died too); else this one's
                n = self.index.settle_intents(lambda key: self.store.delete(key, strict=True), alone)
            except (OSError, sqlite3.Error) as e:  # a full disk or store down: after a commit, not an error
                self._warn.warning("settle", "unreferenced KV not deleted now (retried later): %s", e)
                return
        if n:
            log.info("deleted the stored KV of %d unreferenced chunk(s)", n)

    @staticmethod
    def _as_document(d) -> Document:
        if isinstance(d, Document):
            return d
        if isinstance(d, str):
            return Document(d)
        if isinstance(d, dict):
            return Document(d.get("text", ""), d.get("id"), dict(d.get("metadata") or {}))
        raise TypeError(f"cannot ingest {type(d).__name__}; pass Document, str or dict")

    def delete_document(self, doc_id: str, collection: str | None = None) -> None:
        """Remove a document of ``collection`` (KeyError: none there) from the index; KV no other chunk
        shares is deleted from the store, and no background write-back can store it again (it checks,
        under the same lock, that a chunk uses it)."""
        coll = collection_name(collection)
        with self._ingest_lock:
            with self._kv_lock:
                freed = self.index.delete_document(doc_id, coll)
                self.resolver.forget(freed)
                if (loc := self._corpus.locator) is not None:
                    loc.remove(freed)
            self._settle()

    def list_documents(self, collection: str | None = None) -> list[str]:
        """The ids of ``collection``'s documents (default: the default collection), sorted."""
        return self.index.document_ids(collection_name(collection))

    def kv_visible(self, collection: str | None) -> Callable[[str], bool] | None:
        """Which stored chunk KV a request in ``collection`` may reuse: the keys its chunks use (None
        for ``collection`` None: any stored chunk, the library's transparent reuse).

        Stored KV is content-addressed (chunk tokens + model), so collections with the same chunk text
        share one blob. A request reuses only keys its own collection references: KV found inside a
        prompt (transparent reuse) or named by ``kv_transfer_params`` that only another collection uses
        is treated as not stored (computed, never loaded), so neither statistics nor timings say
        whether another collection holds a chunk. Ingest recomputes such KV too (:meth:`_ensure_kv`)."""
        if collection is None:
            return None
        coll = collection_name(collection)
        return lambda key: self.index.references(key, coll)

    def _write_back(self, kv: ChunkKV) -> bool | None:
        """Store computed KV only while a chunk uses it (a deleted document's KV stays deleted); None
        when no chunk does (nothing to store)."""
        with self._kv_lock:
            if not self.index.references(kv.key):
                return None
            ok = self.store.put(kv)
        if not ok:
            self._warn.warning(
                "write-back", "write-back of chunk %s failed; it will be recomputed next time", kv.key[:16]
            )
        return ok

    def flush(self) -> None:
        """Wait for background KV write-backs."""
        self.resolver.flush()

    def close(self) -> None:
        """Finish write-backs, snapshot the index, close the store."""
        self.resolver.close()
        self.index.close()
        self.store.close()
