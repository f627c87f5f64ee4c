"""The retriever-aware KV layer: ingest documents (split, embed, index, precompute chunk KV), retrieve,
and answer with the retrieved chunks' stored KV blended (or any other prefill mode)."""

from __future__ import annotations

import copy
import hashlib
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ragkv.blend.controller import LoadingController
from ragkv.blend.locate import ChunkLocator, Located
from ragkv.blend.prefill import MODES, UnknownModeError
from ragkv.blend.resolver import ChunkResolver, WarnThrottle
from ragkv.fidelity import explicit_point, parse_fidelity
from ragkv.generate import SamplingParams, TokenEvent
from ragkv.kv.chunk import ChunkKV, chunk_key
from ragkv.llm import LLM
from ragkv.prompt import DEFAULT_INSTRUCTION, DEFAULT_QUESTION, prompt_parts
from ragkv.rag.collections import collection_name
from ragkv.rag.embedder import DEFAULT_EMBEDDER, Embedder
from ragkv.rag.generation import Generated, Generator, PromptJob, ThreadGenerator
from ragkv.rag.index import ChunkIndex, ChunkRecord, PendingDocument, text_sha
from ragkv.rag.quotas import (
    QuotaExceededError,
    Quotas,
    Usage,
    check_collection,
    check_document,
    measure_kv_bytes_per_token,
)
from ragkv.rag.splitter import split_tokens

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
    doc_ids: list[str]
    documents_added: int = 0
    documents_unchanged: int = 0
    chunks_added: int = 0
    kv_computed: int = 0
    kv_already_stored: int = 0
    #: computed but not stored (store full, down, disk full): indexed and answerable, recomputed when used
    kv_not_stored: int = 0
    seconds: float = 0.0


@dataclass
class RagPrompt:
    """A question's prompt before prefill: token-id head, chunks (in prompt order), token-id tail."""

    prefix: list[int]
    chunks: list[ChunkRecord]
    suffix: list[int]
    seconds: float  # retrieval (and fitting) time


@dataclass
class RagAnswer:
    """An answer with its sources, timings (seconds) and prefill statistics."""

    text: str
    sources: list[ChunkRecord]
    mode: str
    timings: dict
    stats: dict
    prompt_ids: list[int] = field(default_factory=list)  # the prompt's token ids, as prefilled
    token_ids: list[int] = field(default_factory=list)  # the answer's


@dataclass
class _Corpus:
    """What views of one RAG share about its corpus: the chunk locator, built on first use and then
    updated by every commit and delete (under the RAG's KV lock)."""

    locator: ChunkLocator | None = None


class RAG:
    """Ingest -> retrieve -> answer with reused chunk KV; everything persists under ``data_dir``."""

    def __init__(
        self,
        llm: LLM | str,
        data_dir: str | Path,
        store=None,
        embedder: Embedder | str = DEFAULT_EMBEDDER,
        chunk_tokens: int = 512,
        overlap: int = 0,
        top_k: int = 6,
        order: str = "score",
        mode: str = "blend",
        ratio: float | str | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        question_template: str = DEFAULT_QUESTION,
        pipelined: bool = True,
        controller: LoadingController | None = None,
        metric: str = "cosine",
        seed: int = 0,
        ingest_batch: int = 32,
        system: str | None = None,
        examples: Sequence[tuple[str, str]] = (),
        collect_garbage_on_open: bool = False,
        generator: Generator | None = None,
        quotas: Quotas | None = None,
        fidelity: str | float | None = None,
    ):
        from ragkv.store import default_store, default_store_url

        self.llm = llm if isinstance(llm, LLM) else LLM(llm)
        self.model = self.llm.model
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if store is None or isinstance(store, (str, Path, dict)):
            # the applications' default (the CLI's and the service's): the compact codec unless the
            # URL names one, and blobs of the earlier raw default still decode, so a data folder
            # written by `ragkv serve` / `ragkv ingest` is read here, not recomputed
            spec = (
                dict(store)
                if isinstance(store, dict)
                else {"url": str(store or default_store_url(self.data_dir))}
            )
            if "url" not in spec:
                raise ValueError(f"store config needs a 'url' key, got {sorted(spec)}")
            store = default_store(str(spec.pop("url")), model=self.model, **spec)
        self.store = store
        self.embedder = embedder if isinstance(embedder, Embedder) else Embedder(embedder)
        if self.model.tokenizer is None:
            raise ValueError("RAG needs a model with a tokenizer")
        limit = self.model.config.max_position - 1
        if not 1 <= chunk_tokens <= limit:
            raise ValueError(f"chunk_tokens must be in [1, {limit}] for this model")
        if order not in ("score", "random"):
            raise ValueError("order must be 'score' or 'random'")
        if mode not in MODES:
            raise UnknownModeError(f"unknown mode {mode!r}; use one of {MODES}")
        self.chunk_tokens, self.overlap, self.top_k, self.order = chunk_tokens, overlap, top_k, order
        self.mode, self.ratio, self.pipelined, self.seed = mode, ratio, pipelined, seed
        #: how ``blend`` without a ratio runs (``ragkv.fidelity``; None: the LLM's setting)
        self.fidelity = None if fidelity is None else parse_fidelity(fidelity)
        self.instruction, self.question_template = instruction, question_template
        self.system = system
        self.examples = [(str(u), str(a)) for u, a in examples]
        self.controller = controller
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
        #: the one source of chunk KV for every query path of this RAG (the LLM's too): computed KV
        #: is written back only while the index references it (:meth:`_write_back`). No memory LRU:
        #: the store is the cache (a ``tiered`` store adds a memory tier), so deleted KV is gone.
        self.resolver = self.llm.resolver = ChunkResolver(
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
        #: the corpus's chunk locator (:meth:`chunk_locator`), in one record that views (:meth:`using`) share
        self._corpus = _Corpus()
        self.resolver.locator = self.chunk_locator
        #: what generates once a prompt is built (:mod:`ragkv.rag.generation`): threads by default
        self.generator: Generator = generator or ThreadGenerator()
        if hasattr(store, "pinned"):  # a size bound evicts KV no chunk references first
            store.pinned = self.index.references
        self._settle()  # KV left unreferenced by a crash (an uncommitted ingest, an unfinished delete)
        if collect_garbage_on_open:
            self.collect_garbage()

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
            with self._kv_lock:
                _, freed = self.index.commit(list(pending.values()))
                if (loc := self._corpus.locator) is not None:
                    loc.remove(freed)
                    loc.add((key, toks) for p in pending.values() for (_, _, toks, key) in p.chunks)
            rep.documents_added = len(pending)
            rep.chunks_added = sum(len(p.chunks) for p in pending.values())
        rep.seconds = time.perf_counter() - t0
        log.info("ingest: %s", rep)
        return rep

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
        another index sharing the store uses would be deleted too. Returns counts and bytes."""
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
        """Delete stored KV that the write-ahead record lists and no chunk references."""
        with self._kv_lock:
            try:
                n = self.index.settle_intents(self.store.delete)
            except (OSError, sqlite3.Error) as e:  # a full disk: after a commit that succeeded, not an error
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

    # ---- retrieve ------------------------------------------------------------------------------
    def retrieve(
        self, question: str, k: int | None = None, collection: str | None = None
    ) -> list[ChunkRecord]:
        """Top-k chunks of ``collection`` (default: the default collection), ordered by score or (as in
        the paper's evaluation) seeded-randomly."""
        if not question or not question.strip():
            raise ValueError("empty question")
        k = self.top_k if k is None else k
        if k < 1:
            raise ValueError("k must be >= 1")
        coll = collection_name(collection)
        recs = self.index.search(self.embedder.embed([question])[0], k, coll)
        if self.order == "random":
            rnd = random.Random(f"{self.seed}|{question}")
            rnd.shuffle(recs)
        return recs

    def chunks_by_id(self, chunk_ids: list[int], collection: str | None = None) -> list[ChunkRecord]:
        """The chunks with these ids in ``collection`` (default: the default collection); KeyError for
        an id that is unknown or of another collection (the same error: nothing tells them apart)."""
        coll = collection_name(collection)
        recs = []
        for cid in chunk_ids:
            rec = self.index.chunk(cid, coll)
            if rec is None:
                raise KeyError(f"unknown chunk id {cid}")
            recs.append(rec)
        return recs

    # ---- answer --------------------------------------------------------------------------------
    def answer(
        self,
        question: str,
        k: int | None = None,
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        chunks: list[ChunkRecord] | None = None,
        collection: str | None = None,
        fidelity: str | float | None = None,
        **sampling,
    ) -> RagAnswer:
        """Retrieve (unless ``chunks`` are given) and answer; timings: retrieval, kv_fetch, ttft, total.
        ``collection``, ``fidelity``: see :meth:`answer_stream`."""
        *_, ans = self.answer_stream(
            question, k, mode, ratio, params, chunks, collection, fidelity, **sampling
        )
        assert isinstance(ans, RagAnswer)
        return ans

    def prompt_parts(
        self, question: str, conversation: Sequence[tuple[str, str]] | None = None
    ) -> tuple[list[int], list[int]]:
        """Token ids of the head (system, instruction, few-shot turns) and tail (question) of a prompt;
        ``conversation``: a chat's turns before the question (:func:`ragkv.prompt.prompt_parts`)."""
        return prompt_parts(
            self.model,
            question,
            self.instruction,
            self.question_template,
            system=self.system,
            examples=self.examples,
            conversation=conversation,
        )

    def prompt(
        self,
        question: str,
        k: int | None = None,
        chunks: list[ChunkRecord] | None = None,
        max_new_tokens: int = 0,
        collection: str | None = None,
        conversation: Sequence[tuple[str, str]] | None = None,
    ) -> RagPrompt:
        """The prompt of ``question``: its token-id head and tail, and the chunks between them.

        Retrieves unless ``chunks`` are given; retrieved chunks are fitted to the context next to the
        head, the tail and ``max_new_tokens`` (lowest scores dropped). Shared by every generation
        backend (in process here, a vLLM server in ``ragkv.integrations.vllm``) so they ask the same thing.
        """
        t0 = time.perf_counter()
        prefix, suffix = self.prompt_parts(question, conversation)
        if chunks is not None:
            recs = list(chunks)
        else:
            recs = self.retrieve(question, k, collection)
            recs = self.fit_chunks(recs, len(prefix) + len(suffix) + max_new_tokens)
        return RagPrompt(prefix, recs, suffix, time.perf_counter() - t0)

    def answer_stream(
        self,
        question: str,
        k: int | None = None,
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        chunks: list[ChunkRecord] | None = None,
        collection: str | None = None,
        conversation: Sequence[tuple[str, str]] | None = None,
        fidelity: str | float | None = None,
        **sampling,
    ) -> Iterator:
        """Yield ``TokenEvent``s as they are generated, then the final :class:`RagAnswer`. Retrieval
        and the stored chunks reused from inside the question are ``collection``'s (default: the
        default collection; :meth:`kv_visible`). ``conversation``: a chat's ``(role, text)`` turns
        before the question, kept as turns around the RAG prompt (:meth:`prompt_parts`). ``fidelity``:
        where ``blend`` without a ratio runs (``ragkv.fidelity``; None: this RAG's setting); the point
        used is in ``stats["fidelity"]``."""
        coll = collection_name(collection)
        params = params or SamplingParams(**sampling)
        t0 = time.perf_counter()
        rp = self.prompt(question, k, chunks, params.max_new_tokens, coll, conversation)
        ids, found = list(rp.prefix), []
        for r in rp.chunks:
            found.append(Located(r.kv_key, tuple(r.token_ids), len(ids), 0, len(r.token_ids)))
            ids += r.token_ids
        ids += rp.suffix
        job = self.job(ids, found, mode, ratio, params, kv_collection=coll, fidelity=fidelity)
        yield from self._answer(job, rp.chunks, t0, rp.seconds)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        collection: str | None = None,
        fidelity: str | float | None = None,
    ) -> Iterator:
        """Complete ``prompt_ids`` exactly as given (an OpenAI client's rendered messages): token
        events, then a :class:`RagAnswer` without sources. In the modes that reuse KV the stored
        chunks found inside the ids are reused (:meth:`job`, ``collection``'s; None: any); the ids
        never change, so ``mode="full"`` prefills the same ids in full."""
        return self.stream_parts(prompt_ids, [], [], mode, ratio, params, fidelity, collection)

    def stream_parts(
        self,
        prefix: Sequence[int],
        chunks: Sequence[Sequence[int]],
        suffix: Sequence[int],
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        fidelity: str | float | None = None,
        collection: str | None = None,
    ) -> Iterator:
        """Complete token-id ``prefix + chunks + suffix`` (a framework's prompt): token events, then a
        :class:`RagAnswer` without sources. Chunk KV is found by content; stored chunks inside the
        rest of the prompt are located (transparent reuse of a flat prompt, :meth:`job`; only
        ``collection``'s, None: any)."""
        params = params or SamplingParams()
        t0 = time.perf_counter()
        ids, found = [int(t) for t in prefix], []
        for c in chunks:
            toks = tuple(int(t) for t in c)
            found.append(Located(chunk_key(toks, self.model.fingerprint), toks, len(ids), 0, len(toks)))
            ids += toks
        ids += [int(t) for t in suffix]
        job = self.job(ids, found, mode, ratio, params, kv_collection=collection, fidelity=fidelity)
        yield from self._answer(job, [], t0, 0.0)

    def stream_text(
        self,
        prefix: str,
        chunks: Sequence[str],
        question: str,
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        collection: str | None = None,
        fidelity: str | float | None = None,
    ) -> Iterator:
        """Complete a framework's prompt given as text, ``prefix + chunks + question`` (``chunks``
        may be empty: one flat prompt): token events, then a :class:`RagAnswer` without sources.
        ``collection``: only its stored chunks are found in the text (None: any; :meth:`job`).
        The prefix starts with BOS when the tokenizer adds one; each of ``chunks`` is a chunk whose
        KV is found by content (stored after first use). In modes that reuse KV the stored chunks
        inside ``prefix`` and ``question`` are given as themselves (:meth:`segment_text`), so a flat
        prompt is the same job as the same text with those chunks given explicitly; in other modes
        each part is tokenized as a whole."""
        t0 = time.perf_counter()
        params = params or SamplingParams()
        mode = mode or self.mode
        reuse = mode in ("reuse", "blend")
        m = self.model

        def part(text: str, add_bos: bool) -> tuple[list[int], list[Located]]:
            if reuse:
                return self.segment_text(text, add_bos, collection)
            return m.encode(text, add_bos=add_bos, specials=True), []

        ids, found = part(prefix, True)
        for c in chunks:
            toks = tuple(m.encode(c))
            found.append(Located(chunk_key(toks, m.fingerprint), toks, len(ids), 0, len(toks)))
            ids += toks
        tail, inside = part(question, False)
        found += [replace(f, start=f.start + len(ids)) for f in inside]
        ids += tail
        if not chunks and not tail and len(ids) <= 1:
            raise ValueError("empty prompt")
        job = self.job(ids, found, mode, ratio, params, kv_collection=collection, fidelity=fidelity)
        yield from self._answer(job, [], t0, 0.0)

    def segment_text(
        self, text: str, add_bos: bool = False, kv_collection: str | None = None, specials: bool = True
    ) -> tuple[list[int], list[Located]]:
        """``text``'s token ids with the stored chunks inside it given as themselves, and where.

        The locator finds stored chunks in ``text``'s tokens (:meth:`job`); each found chunk whose own
        text covers the rows found there is then given whole, its stored token ids in place of the
        text, and the text around the chunks is tokenized apart, as an explicit caller's prompt is.
        Where the text holds only part of a chunk (a framework trimmed its edge: LlamaIndex strips a
        node's text) the rows found are given, as found. The ids then differ from tokenizing ``text``
        as a whole only at a chunk's edge, where the two could merge differently; a prompt with no
        stored chunk is tokenized as a whole. ``add_bos``: start with BOS when the tokenizer adds one;
        ``kv_collection``: see :meth:`job`. ``specials``: ``text`` is a raw prompt (a framework's rendered
        template), so a special token's text in it is that token; False encodes it as text."""
        from ragkv.rag.splitter import encode_with_offsets

        m = self.model
        head = m.encode("", add_bos=add_bos)
        flat = m.encode(text, specials=specials)
        found = self.resolver.find(flat, [], self.kv_visible(kv_collection)) if flat else []
        if not found:
            return head + flat, []
        as_found = head + flat, [replace(f, start=f.start + len(head)) for f in found]
        try:
            same, offsets = encode_with_offsets(m.tokenizer, text, specials)
        except (NotImplementedError, TypeError, ValueError):  # a tokenizer without offsets
            return as_found
        if list(same) != flat:
            return as_found
        chars = [(offsets[f.start][0], offsets[f.stop - 1][1]) for f in found]
        ids, out, pos = list(head), [], 0
        for k, f in enumerate(found):
            a, b = chars[k]
            if a < pos or not _own_chars(offsets, f.start, f.stop, len(flat)):
                return as_found
            recs = self.index.chunks_with_key(f.key)
            whole = recs[0].text if recs else None
            at = text.find(whole, max(pos, a - len(whole))) if whole and whole.strip() else -1
            end = at + len(whole)
            limit = chars[k + 1][0] if k + 1 < len(found) else len(text)
            # the chunk's own text is all there, where the rows were found: it covers them, up to
            # whitespace a token took from beside it (a sentencepiece "▁" holds the space before),
            # and reaches into no other chunk's rows
            if pos <= at and end <= limit and _covers(text, at, end, a, b):
                a, b, lo, hi = at, end, 0, len(f.token_ids)
            else:
                lo, hi = f.lo, f.hi
            ids += m.encode(text[pos:a], specials=specials) if a > pos else []
            out.append(Located(f.key, f.token_ids, len(ids), lo, hi))
            ids += f.token_ids[lo:hi]
            pos = b
        ids += m.encode(text[pos:], specials=specials) if pos < len(text) else []
        return ids, out

    def job(
        self,
        prompt_ids: Sequence[int],
        chunks: Sequence[Located],
        mode: str | None = None,
        ratio: float | str | None = None,
        params: SamplingParams | None = None,
        locate: bool = True,
        kv_collection: str | None = None,
        fidelity: str | float | None = None,
        **options,
    ) -> PromptJob:
        """A checked :class:`PromptJob` with this RAG's defaults (mode, ratio) for what is not given.

        ``locate``: in modes that reuse KV, stored chunks found in the prompt's rows outside
        ``chunks`` (a document pasted into a question, a framework's own context format) are reused
        too (transparent reuse, :meth:`ChunkResolver.find`); False keeps exactly ``chunks``.
        ``kv_collection``: only that collection's stored chunks are located (:meth:`kv_visible`;
        None: any)."""
        mode = mode or self.mode
        if mode not in MODES:
            raise UnknownModeError(f"unknown mode {mode!r}; use one of {MODES}")
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("empty prompt")
        self.model.check_length(len(ids), params.max_new_tokens)
        ratio = self.ratio if ratio is None else ratio
        if ratio == "auto" or options.get("schedule") is not None:  # the caller's own choice
            op = explicit_point(mode, None if ratio == "auto" else options["schedule"].target_ratio)
        else:  # blend without a ratio: the fidelity gate's operating point (LLM.plan, the one place)
            mode, ratio, op = self.llm.plan(mode, ratio, self.fidelity if fidelity is None else fidelity)
        chunks = list(chunks)
        if locate and mode in ("reuse", "blend"):
            chunks = self.resolver.find(ids, chunks, self.kv_visible(kv_collection))
        ratio = 0.0 if ratio is None else ratio  # reuse / prefix / full: no rows chosen
        return PromptJob(ids, chunks, mode, ratio, params, fidelity=op, **options)

    def using(self, generator: Generator) -> RAG:
        """A view of this RAG that generates with ``generator``: e.g. one RAG answering both in process
        and on a vLLM server, or a service's engine over a RAG its caller keeps using. The view shares
        the index, store, resolver and corpus state; its settings (mode, ratio, prompt...) are this
        RAG's at the time of the call. Closing the view closes ``generator`` only."""
        view = copy.copy(self)
        view.generator = generator
        view.close = generator.close
        return view

    def generate(self, job: PromptJob) -> Iterator[TokenEvent | Generated]:
        """Complete ``job`` with this RAG's generator: token events, then one :class:`Generated`."""
        return self.generator.stream(self, job)

    def _answer(self, job: PromptJob, sources: list[ChunkRecord], t0: float, t_retrieval: float) -> Iterator:
        ttft = None
        for item in self.generate(job):
            if isinstance(item, Generated):
                total = time.perf_counter() - t0
                timings = {
                    "retrieval_s": t_retrieval,
                    "kv_fetch_s": item.kv_fetch_s,
                    "ttft_s": ttft if ttft is not None else total,
                    "total_s": total,
                    **item.timings,
                }
                stats = {**item.stats, "kv_hits": item.stats.get("kv_hits", 0)}
                yield RagAnswer(
                    item.text, sources, item.mode, timings, stats, list(job.prompt_ids), list(item.token_ids)
                )
            else:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                yield item

    def choose_ratio(self, job: PromptJob, items) -> tuple[float, object | None]:
        """``job``'s recompute ratio as a number: ``"auto"`` asks the loading controller (its decision
        is returned too), from the prompt's length and the rows that will come from chunk KV."""
        if job.ratio != "auto":
            return float(job.ratio), None
        if self.controller is None:
            raise ValueError("ratio='auto' needs a LoadingController (RAG(controller=...))")
        n_cached = sum(c.hi - c.lo for c in job.chunks) if items else 0
        decision = self.controller.choose_ratio(len(job.prompt_ids), n_cached, self._store_name())
        return decision.ratio, decision

    def fit_chunks(self, recs: list[ChunkRecord], other_tokens: int) -> list[ChunkRecord]:
        """Drop the lowest-scored chunks until they fit the context next to ``other_tokens`` (order kept)."""
        budget = self.model.config.max_position - other_tokens
        kept = sorted(recs, key=lambda r: -r.score)
        while kept and sum(len(r.token_ids) for r in kept) > budget:
            dropped = kept.pop()
            log.info(
                "dropping retrieved chunk %d (score %.3f) to fit the context", dropped.chunk_id, dropped.score
            )
        keep_ids = {r.chunk_id for r in kept}
        return [r for r in recs if r.chunk_id in keep_ids]

    def _store_name(self) -> str:
        names = list(self.controller.load_bytes_per_s) if self.controller else []
        desc = self.store.describe()
        return next((n for n in names if n in desc), names[0] if names else desc)

    @property
    def counters(self) -> dict:
        """Chunk-KV counters of every query path: hits, misses, recomputed after a failed load..."""
        return self.resolver.counters

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
        """Finish write-backs, snapshot the index, close the store, release the data folder's writer
        lock if this RAG holds one (``ragkv.apps.service.build_rag(writer=True)``)."""
        self.generator.close()
        self.resolver.close()
        self.index.close()
        self.store.close()
        lock = getattr(self, "writer_lock", None)
        if lock is not None:
            lock.close()
            self.writer_lock = None


def _covers(text: str, at: int, end: int, a: int, b: int) -> bool:
    """Whether characters ``[at, end)`` cover ``[a, b)`` but for whitespace at either end."""
    if at >= b or end <= a:
        return False
    return (at <= a or not text[a:at].strip()) and (end >= b or not text[end:b].strip())


def _own_chars(offsets, start: int, stop: int, n: int) -> bool:
    """Whether tokens ``[start, stop)`` cover characters no token outside them shares (a byte-level
    token holding part of a character shares it with its neighbour)."""
    before = start == 0 or offsets[start - 1][1] <= offsets[start][0]
    after = stop >= n or offsets[stop - 1][1] <= offsets[stop][0]
    return before and after
