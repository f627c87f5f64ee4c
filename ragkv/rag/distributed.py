"""Corpus-scale ingest as a Ray Data pipeline: read, split, embed, precompute chunk KV, commit.

Ray places, retries and scales the steps; ragkv adds no scheduler, worker or retry loop of its own. The
steps are the single-process ingest's own functions (:meth:`ragkv.rag.RAG.ingest`), run where Ray puts
them:

* **read** (Ray Data's readers, or a ``ray.data.Dataset`` given): JSONL (a line per document), Parquet
  (``id``, ``text``, ``metadata`` columns), text files (one document each), or any dataset with a
  ``text`` column; one unreadable file or line is one document's error, not the run's;
* **split** (:func:`ragkv.rag.splitter.split_tokens`, :func:`ragkv.kv.chunk.chunk_key`, the quotas'
  :func:`~ragkv.rag.quotas.check_document`): documents already committed with the same text are skipped;
* **embed** (:class:`ragkv.rag.Embedder`, in an actor pool: the model loaded once per actor);
* **chunk KV** (:meth:`ragkv.blend.ChunkResolver.compute_into_store`, and the KV tree's first level,
  :func:`ragkv.rag.first_level.precompute_first_level`, in an actor pool: the model loaded once per
  actor), written by the workers straight to the store;
* **commit** in the driver (:meth:`ragkv.rag.corpus.Corpus.commit_documents`): whole documents, a batch
  per SQLite transaction, their vectors added to the FAISS index; a committed document is acknowledged.

Idempotent and resumable: chunk KV and tree pages are content-addressed and a worker checks the store
before computing, committed documents are skipped by text hash, so a re-run computes nothing twice and a
run killed anywhere (driver or worker, ``kill -9``) finishes the rest when started again (what was in
flight is redone: KV found in the store, embeddings of uncommitted documents computed again). Blobs need
no lock (written whole under their content key, verified on every read); the index's writers follow
:mod:`ragkv.rag.writers`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from ragkv.rag.collections import collection_name
from ragkv.rag.corpus import IngestReport
from ragkv.rag.index import IndexFullError, PendingDocument, text_sha
from ragkv.rag.quotas import QuotaExceededError

if TYPE_CHECKING:
    import pandas as pd

    from ragkv.rag.pipeline import RAG

log = logging.getLogger("ragkv.rag.distributed")

#: suffixes read as JSONL (one document per line) and as Parquet; any other file is one text document
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
#: the columns of a document row after reading (``doc_id`` "" derives the id from the text, as
#: :class:`ragkv.rag.Document` does; ``error`` non-empty: the document could not be read)
DOC_COLUMNS = ("doc_id", "text", "metadata", "source", "error")
#: what a chunk row carries through split, embed and chunk KV to the driver's commit
CHUNK_DEFAULTS: dict[str, Any] = {
    "doc_id": "",
    "sha": "",
    "metadata": "{}",
    "source": "",
    "status": "",  # "chunk" | "empty" (a document without tokens) | "unchanged" | "error"
    "error": "",
    "n_chunks": 0,
    "seq": 0,
    "text": "",
    "token_ids": b"",  # int32 bytes, as the index stores them
    "kv_key": "",
    "vector": b"",  # float32 bytes
    "kv": "",  # "computed" | "stored" | "not_stored"
    "first": "",  # precompute_first_level's answer, or "not_stored"
    "worker": "",  # host:pid of the worker that computed the chunk's KV
}


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:  # pragma: no cover - the extra is installed by scripts/setup.sh
        raise ImportError("the Ray pipeline needs Ray Data: pip install 'ragkv[ray]'") from e
    return ray


@dataclass(frozen=True)
class WorkerSpec:
    """What a Ray worker rebuilds ingest's parts from: a :class:`~ragkv.rag.RAG` belongs to its process
    (model, SQLite, threads), this crosses to others. ``threads``: the serving processes' torch thread
    count (the exact KV tree's pages are keyed by it: first-level pages computed with another count are
    never matched). ``fingerprint``: the driver's KV model's; a worker whose model differs refuses."""

    model: str
    store: str
    embedder: str
    fingerprint: str
    dtype: str = "float32"
    device: str = "cpu"
    adapter: str | None = "auto"
    codec: str | None = None
    hmac_key: str | None = None
    threads: int = 1

    @classmethod
    def of(cls, rag: RAG, store: str | None = None, **overrides) -> WorkerSpec:
        """The spec of ``rag``'s model, embedder and thread count, over the store at URL ``store``
        (default: the data folder's default store, when that is the RAG's store)."""
        import torch

        from ragkv.store import default_store_url
        from ragkv.store.localdir import LocalDirStore

        if store is None:
            url = default_store_url(rag.data_dir)
            root = getattr(rag.store, "root", None)
            if not isinstance(rag.store, LocalDirStore) or Path(root) != Path(urlsplit(url).path).resolve():
                raise ValueError(
                    "the workers need the RAG's store by URL: pass store='redis://...' (or file:///...)"
                )
            store = url
        codec = getattr(getattr(rag.store, "codec", None), "name", None)
        base = dict(
            model=str(rag.model.name),
            store=store,
            embedder=rag.embedder.name,
            fingerprint=rag.corpus.model.fingerprint,
            dtype=str(rag.model.dtype).removeprefix("torch."),
            codec=codec,
            threads=torch.get_num_threads(),
        )
        return cls(**{**base, **overrides})


class _Parts:
    """A worker's model, store, chunk resolver and KV tree, built once per actor from a :class:`WorkerSpec`."""

    def __init__(self, spec: WorkerSpec):
        import torch

        from ragkv.blend.spans import expect_model
        from ragkv.llm import LLM
        from ragkv.store import default_store

        torch.set_num_threads(spec.threads)
        opts = dict(adapter=spec.adapter, cache_bytes=256 << 20, self_check_on_load=False)
        llm = LLM(spec.model, dtype=spec.dtype, device=spec.device, **opts)
        if llm.kv_model.fingerprint != spec.fingerprint:
            raise ValueError(
                f"worker model {spec.model!r} has fingerprint {llm.kv_model.fingerprint[:16]}, not the "
                f"driver's {spec.fingerprint[:16]}: every node must load the same weights"
            )
        self.store = default_store(spec.store, model=llm.kv_model, codec=spec.codec, hmac_key=spec.hmac_key)
        expect_model(self.store, llm.kv_model)
        # the LLM's own resolver and tree, over this store (chunk KV, and the tree's pages in its namespace)
        self.llm = LLM(llm.model, store=self.store, **opts)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"


# ---- reading ------------------------------------------------------------------------------------------
def _doc_row(doc_id, text, metadata, source: str, error: str = "") -> dict:
    if not isinstance(metadata, dict):
        metadata = {} if metadata is None else {"value": metadata}
    return {
        "doc_id": "" if doc_id is None else str(doc_id),
        "text": text if isinstance(text, str) else "",
        "metadata": json.dumps(metadata, default=str, sort_keys=True),
        "source": source,
        "error": error,
    }


def _frame(rows: list[dict], columns) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame(rows, columns=list(columns))


def read_text_files(batch: pd.DataFrame) -> pd.DataFrame:
    """One document per file (id: the file's stem, as ``ragkv-server ingest`` names it; metadata: its
    path); a file that cannot be read or decoded is that document's error."""
    rows = []
    for path in batch["path"]:
        p = Path(path)
        try:
            rows.append(_doc_row(p.stem, p.read_text(encoding="utf-8"), {"path": str(p)}, str(p)))
        except (OSError, UnicodeDecodeError) as e:
            rows.append(_doc_row(p.stem, "", {"path": str(p)}, str(p), f"unreadable file: {e}"))
    return _frame(rows, DOC_COLUMNS)


def parse_jsonl_lines(batch: pd.DataFrame) -> pd.DataFrame:
    """A JSONL line (``{"id"?, "text", "metadata"?}``, or a JSON string) as a document; a line that is
    not one is that document's error."""
    rows = []
    paths = batch["path"] if "path" in batch else [""] * len(batch)
    for line, path in zip(batch["text"], paths, strict=True):
        try:
            r = json.loads(line)
        except ValueError as e:
            rows.append(_doc_row("", "", {}, str(path), f"not JSON: {e}"))
            continue
        if isinstance(r, str):
            rows.append(_doc_row("", r, {}, str(path)))
        elif isinstance(r, dict):
            rows.append(_doc_row(r.get("id"), r.get("text"), r.get("metadata") or {}, str(path)))
        else:
            rows.append(
                _doc_row("", "", {}, str(path), "not a document (need a string or an object with 'text')")
            )
    return _frame(rows, DOC_COLUMNS)


def read_parquet_files(batch: pd.DataFrame) -> pd.DataFrame:
    """The rows of each Parquet file (``id``, ``text``, ``metadata`` columns) as documents; a file that
    cannot be read is one error row."""
    import pandas as pd
    import pyarrow.parquet as pq

    frames = []
    for path in batch["path"]:
        try:
            table = pq.read_table(path).to_pandas()
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
            frames.append(_frame([_doc_row("", "", {}, str(path), f"unreadable file: {e}")], DOC_COLUMNS))
            continue
        table["path"] = str(path)
        frames.append(normalize_rows(table))
    return pd.concat(frames, ignore_index=True) if frames else _frame([], DOC_COLUMNS)


def normalize_rows(batch: pd.DataFrame) -> pd.DataFrame:
    """Rows of any dataset with a ``text`` column (``id``, ``metadata`` optional) as documents."""
    n = len(batch)
    ids = batch["id"] if "id" in batch else [None] * n
    metas = batch["metadata"] if "metadata" in batch else [None] * n
    source = batch["path"] if "path" in batch else [""] * n
    texts = batch["text"] if "text" in batch else [None] * n
    rows = []
    for doc_id, text, meta, src in zip(ids, texts, metas, source, strict=True):
        if isinstance(meta, str):
            try:
                meta = json.loads(meta)
            except ValueError:
                meta = {"value": meta}
        rows.append(_doc_row(doc_id, text, meta, str(src)))
    return _frame(rows, DOC_COLUMNS)


def read_documents(data, light: dict | None = None):
    """A ``ray.data.Dataset`` of documents (:data:`DOC_COLUMNS`) from ``data``: a Dataset (a ``text``
    column), a path, or a list of paths (folders walked; ``.jsonl``/``.ndjson``: a line per document,
    ``.parquet``: a row per document, any other file: one document), or a list of document dicts.
    ``light``: Ray task options of the reading steps (a fraction of a CPU: they wait on I/O)."""
    ray = _ray()
    light = light or {"num_cpus": 0.1}
    if isinstance(data, ray.data.Dataset):
        return data.map_batches(normalize_rows, batch_format="pandas", **light)
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if items and all(isinstance(x, dict) for x in items):
        rows = [
            {"id": d.get("id"), "text": d.get("text"), "metadata": json.dumps(d.get("metadata") or {})}
            for d in items
        ]
        return ray.data.from_items(rows).map_batches(normalize_rows, batch_format="pandas", **light)
    files: list[str] = []
    for x in items:
        p = Path(x)
        if p.is_dir():
            files += [str(f) for f in sorted(p.rglob("*")) if f.is_file() and not f.name.startswith(".")]
        else:
            files.append(str(p))  # missing: that document's error (read_text_files)
    jsonl = [f for f in files if f.lower().endswith(JSONL_SUFFIXES)]
    parquet = [f for f in files if f.lower().endswith(PARQUET_SUFFIXES)]
    text = [f for f in files if f not in set(jsonl) | set(parquet)]
    parts = []
    if jsonl:
        lines = ray.data.read_text(jsonl, include_paths=True, **light)
        parts.append(lines.map_batches(parse_jsonl_lines, batch_format="pandas", **light))
    # files by path, read in the steps (not Ray's file readers): one bad file is one document's error
    if parquet:
        paths = ray.data.from_items([{"path": f} for f in parquet])
        parts.append(paths.map_batches(read_parquet_files, batch_format="pandas", batch_size=1, **light))
    if text:
        paths = ray.data.from_items([{"path": f} for f in text])
        parts.append(paths.map_batches(read_text_files, batch_format="pandas", batch_size=16, **light))
    if not parts:
        raise ValueError(f"no documents found in {items!r}")
    return parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]


# ---- split, embed, chunk KV (Ray workers) ---------------------------------------------------------------
def _chunk_row(**values) -> dict:
    return {**CHUNK_DEFAULTS, **values}


class Split:
    """Documents -> chunk rows: the single-process ingest's split, keys and document quota."""

    def __init__(
        self, tokenizer, chunk_tokens: int, overlap: int, fingerprint: str, quotas, collection: str, committed
    ):
        self.tokenizer, self.chunk_tokens, self.overlap = tokenizer, chunk_tokens, overlap
        self.fingerprint, self.quotas, self.collection = fingerprint, quotas, collection
        self.committed: dict[str, str] = committed

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        from ragkv.kv.chunk import chunk_key
        from ragkv.rag.corpus import Document
        from ragkv.rag.quotas import check_document
        from ragkv.rag.splitter import split_tokens

        rows = []
        for r in batch.itertuples(index=False):
            base = {"doc_id": r.doc_id, "metadata": r.metadata, "source": r.source}
            if r.error:
                rows.append(_chunk_row(**base, status="error", error=r.error))
                continue
            try:
                doc = Document(r.text, r.doc_id or None, json.loads(r.metadata))
                base["doc_id"] = doc.id
                sha = text_sha(doc.text)
                if self.committed.get(doc.id) == sha:
                    rows.append(_chunk_row(**base, sha=sha, status="unchanged"))
                    continue
                parts = split_tokens(self.tokenizer, doc.text, self.chunk_tokens, self.overlap)
                check_document(self.quotas, doc.id, sum(len(c.token_ids) for c in parts), self.collection)
            except ValueError as e:  # an empty text, a document over max_document_tokens
                rows.append(_chunk_row(**base, status="error", error=str(e)))
                continue
            if not parts:
                rows.append(_chunk_row(**base, sha=sha, status="empty"))
            for c in parts:
                toks = list(c.token_ids)
                rows.append(
                    _chunk_row(
                        **base,
                        sha=sha,
                        status="chunk",
                        n_chunks=len(parts),
                        seq=c.seq,
                        text=c.text,
                        token_ids=np.asarray(toks, dtype=np.int32).tobytes(),
                        kv_key=chunk_key(toks, self.fingerprint),
                    )
                )
        return _frame(rows, CHUNK_DEFAULTS)


class Embed:
    """Chunk rows -> their embeddings (:meth:`ragkv.rag.Embedder.embed`, the model loaded once per actor)."""

    def __init__(self, embedder: str):
        from ragkv.rag.embedder import Embedder

        self.embedder = Embedder(embedder)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        mask = (batch["status"] == "chunk").to_numpy()
        if mask.any():
            vecs = self.embedder.embed(list(batch["text"][mask]), background=True)
            col = list(batch["vector"])
            for i, v in zip(np.flatnonzero(mask), vecs, strict=True):
                col[i] = np.ascontiguousarray(v, dtype=np.float32).tobytes()
            batch["vector"] = col
        return batch


class ChunkKV:
    """Chunk rows -> their KV and first level in the store (:meth:`ChunkResolver.compute_into_store`,
    :func:`precompute_first_level`; the model loaded once per actor). A row says what it took: ``kv``
    computed / stored (found, nothing computed) / not_stored (the store refused: recomputed when used)."""

    def __init__(self, spec: WorkerSpec, head: list[int], first_level: bool):
        self.parts = _Parts(spec)
        self.head, self.first_level = list(head), first_level
        self.tree = self._fresh_tree()

    def _fresh_tree(self):
        """A KV tree over the store's pages that knows nothing yet: after a store lost pages (a Redis
        restarted without persistence), the next passes write them again (a tree skips pages it wrote)."""
        from ragkv.blend.kvtree import KVTree, tree_store

        return KVTree(64 << 20, tree_store(self.parts.store))

    def _first_level(self, ids: list[int]) -> str:
        from ragkv.rag.first_level import SKIPPED, precompute_first_level

        if not self.first_level:
            return SKIPPED
        return precompute_first_level(self.parts.llm.model, self.tree, self.head, ids)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        from ragkv.rag.first_level import COMPUTED, first_level_stored

        llm, store = self.parts.llm, self.parts.store
        kv, first, errors = list(batch["kv"]), list(batch["first"]), list(batch["error"])
        computed_first = []
        for i, r in enumerate(batch.itertuples(index=False)):
            if r.status != "chunk":
                continue
            ids = np.frombuffer(r.token_ids, dtype=np.int32).tolist()
            try:
                if store.contains(r.kv_key):
                    kv[i] = "stored"
                else:
                    kv[i] = "computed" if llm.resolver.compute_into_store(ids) else "not_stored"
                first[i] = self._first_level(ids)
                if first[i] == COMPUTED:
                    computed_first.append((i, ids))
            except Exception as e:  # noqa: BLE001 - this chunk's document fails; the batch goes on
                log.exception("chunk %s of %s failed", r.seq, r.doc_id)
                errors[i] = f"chunk {r.seq}: {type(e).__name__}: {e}"
        # a first level counts once its pages are written; pages a store lost are written again once
        for attempt in range(2):
            self.tree.flush(timeout=120.0)
            model = llm.model
            missing = [
                (i, ids)
                for i, ids in computed_first
                if not first_level_stored(model, self.tree, self.head, ids)
            ]
            if not missing or attempt:
                break
            self.tree = self._fresh_tree()
            for _, ids in missing:
                self._first_level(ids)
        for i, _ in missing:
            first[i] = "not_stored"
        batch["kv"], batch["first"], batch["error"] = kv, first, errors
        batch["worker"] = self.parts.worker
        return batch


def _pool(size: int | tuple[int, int]):
    """An actor pool of ``size`` actors, or ``(min, max)``: Ray scales it between them."""
    ray = _ray()
    if isinstance(size, int):
        return ray.data.ActorPoolStrategy(size=size)
    return ray.data.ActorPoolStrategy(min_size=size[0], max_size=size[1])


# ---- the driver -----------------------------------------------------------------------------------------
@dataclass
class DatasetIngestReport(IngestReport):
    """What a pipeline run did: the single-process :class:`IngestReport`'s counts (``doc_ids``: the
    documents committed by this run, acknowledged), and ``errors``: ``{"doc_id", "source", "error"}`` of
    every document not ingested (the rest went on)."""

    documents: int = 0
    first_level_computed: int = 0
    first_level_stored: int = 0
    first_level_not_stored: int = 0
    errors: list[dict] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class _Collector:
    """The driver's side: chunk rows grouped into whole documents, committed in batches."""

    def __init__(self, rag: RAG, collection: str, commit_every: int, bar):
        self.rag, self.collection, self.commit_every, self.bar = rag, collection, commit_every, bar
        self.rep = DatasetIngestReport()
        self.open: dict[tuple[str, str], dict] = {}  # (doc_id, sha) -> the document's rows so far
        self.ready: list[tuple[PendingDocument, str]] = []
        self.done: dict[str, str] = {}  # doc_id -> sha, ended in this run (committed, unchanged or failed)
        self.workers: set[str] = set()

    def error(self, doc_id: str, source: str, message: str) -> None:
        self.rep.errors.append({"doc_id": doc_id, "source": source, "error": message})
        self.bar.update(1)

    def take(self, batch: pd.DataFrame) -> None:
        for r in batch.itertuples(index=False):
            if r.worker:
                self.workers.add(r.worker)
            if r.status in ("error", "unchanged"):
                self.rep.documents += 1
                if r.status == "error":
                    self.error(r.doc_id, r.source, r.error)
                else:
                    self.rep.documents_unchanged += 1
                    self.bar.update(1)
                continue
            key = (r.doc_id, r.sha)
            doc = self.open.setdefault(key, {"rows": {}, "error": "", "row": r})
            if r.status == "chunk":
                doc["rows"][r.seq] = r
                if r.error:
                    doc["error"] = doc["error"] or r.error
            if len(doc["rows"]) >= r.n_chunks:
                del self.open[key]
                self._close(doc)
                if len(self.ready) >= self.commit_every:
                    self.commit()

    def _close(self, doc: dict) -> None:
        r = doc["row"]
        self.rep.documents += 1
        if doc["error"]:
            return self.error(r.doc_id, r.source, doc["error"])
        if r.doc_id in self.done or any(p.doc_id == r.doc_id for p, _ in self.ready):
            return self.error(
                r.doc_id, r.source, "document id given twice in one run; the first one was kept"
            )
        rows = [doc["rows"][s] for s in sorted(doc["rows"])]
        chunks = [
            (x.seq, x.text, np.frombuffer(x.token_ids, dtype=np.int32).tolist(), x.kv_key) for x in rows
        ]
        dim = self.rag.embedder.dim
        vecs = (
            np.stack([np.frombuffer(x.vector, dtype=np.float32) for x in rows])
            if rows
            else np.zeros((0, dim), np.float32)
        )
        self.ready.append(
            (
                PendingDocument(r.doc_id, r.sha, json.loads(r.metadata), chunks, vecs, self.collection),
                r.source,
            )
        )
        for x in rows:
            self._count(x)

    def _count(self, x) -> None:
        rep = self.rep
        rep.kv_computed += x.kv == "computed"
        rep.kv_already_stored += x.kv == "stored"
        rep.kv_not_stored += x.kv == "not_stored"
        rep.first_level_computed += x.first == "computed"
        rep.first_level_stored += x.first == "stored"
        rep.first_level_not_stored += x.first == "not_stored"

    def commit(self) -> None:
        if not self.ready:
            return
        batch, self.ready = self.ready, []
        docs = [p for p, _ in batch]
        try:
            self.rag.corpus.commit_documents(docs)
        except QuotaExceededError as e:  # the batch would take its collection over a quota: one by one
            if len(batch) == 1:
                return self.error(batch[0][0].doc_id, batch[0][1], f"not committed: {e}")
            for one in batch:
                self.ready = [one]
                self.commit()
            return
        except (IndexFullError, OSError) as e:  # a full disk: these documents are not ingested, say so
            for p, source in batch:
                self.error(p.doc_id, source, f"not committed: {e}")
            return
        for p in docs:
            self.done[p.doc_id] = p.sha
            self.rep.doc_ids.append(p.doc_id)
            self.rep.documents_added += 1
            self.rep.chunks_added += len(p.chunks)
        self.bar.update(len(docs))

    def finish(self) -> DatasetIngestReport:
        self.commit()
        for (doc_id, _), doc in self.open.items():  # chunks lost with a block Ray gave up on
            self.rep.documents += 1
            self.error(doc_id, doc["row"].source, "incomplete: some chunks never came back (a failed block)")
        self.rep.workers = sorted(self.workers)
        return self.rep


def ingest_dataset(
    data,
    rag: RAG,
    spec: WorkerSpec | None = None,
    *,
    store: str | None = None,
    collection: str | None = None,
    address: str | None = None,
    kv_actors: int | tuple[int, int] = 1,
    embed_actors: int | tuple[int, int] = 1,
    kv_cpus: float = 1.0,
    batch_size: int = 8,
    commit_every: int = 64,
    max_errored_blocks: int = 0,
    show_progress: bool = True,
) -> DatasetIngestReport:
    """Ingest ``data`` (:func:`read_documents`: a ``ray.data.Dataset``, paths, or document dicts) into
    ``rag``'s ``collection`` as a Ray Data pipeline (see the module doc); returns the run's report.

    ``spec``: how workers rebuild the model and store (default :meth:`WorkerSpec.of(rag, store)`).
    ``address``: the Ray cluster to join when Ray is not initialised yet (None: a local Ray, started and
    stopped here). ``kv_actors`` / ``embed_actors``: actor pool sizes (an int, or ``(min, max)`` to let Ray
    scale them); ``kv_cpus``: Ray CPUs one chunk-KV actor reserves. ``commit_every``: documents per index
    transaction (the unit of acknowledgement). ``max_errored_blocks``: blocks Ray may give up on after
    its retries before the run fails (their documents are reported, the rest goes on)."""
    ray = _ray()
    coll = collection_name(collection)
    spec = spec or WorkerSpec.of(rag, store)
    if spec.embedder != rag.embedder.name:
        raise ValueError(f"workers embed with {spec.embedder!r}, the index with {rag.embedder.name!r}")
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.max_errored_blocks = max_errored_blocks
        ctx.enable_progress_bars = False  # the driver's bar counts documents; Ray's count blocks
        head, _ = rag.answers.prompt_parts("?")  # the head does not depend on the question
        light = {"num_cpus": 0.1}
        # a dead actor is restarted and its batch retried: Ray Data's default for actor pools
        # (max_restarts=-1, max_task_retries=-1); tasks are retried too (max_retries)
        docs = read_documents(data, light)
        chunks = docs.map_batches(
            Split,
            batch_format="pandas",
            batch_size=batch_size,
            fn_constructor_kwargs=dict(
                tokenizer=rag.model.tokenizer,
                chunk_tokens=rag.chunk_tokens,
                overlap=rag.overlap,
                fingerprint=rag.corpus.model.fingerprint,
                quotas=rag.quotas,
                collection=coll,
                committed=rag.corpus.committed_shas(coll),
            ),
            compute=_pool(1),
            **light,
        )
        embedded = chunks.map_batches(
            Embed,
            batch_format="pandas",
            batch_size=batch_size,
            fn_constructor_kwargs={"embedder": spec.embedder},
            compute=_pool(embed_actors),
            num_cpus=0.25,
        )
        computed = embedded.map_batches(
            ChunkKV,
            batch_format="pandas",
            batch_size=batch_size,
            fn_constructor_kwargs={"spec": spec, "head": head, "first_level": rag.first_level},
            compute=_pool(kv_actors),
            num_cpus=kv_cpus,
        )
        from tqdm.auto import tqdm

        with tqdm(desc="ingest (ray)", unit="doc", disable=not show_progress) as bar:
            out = _Collector(rag, coll, commit_every, bar)
            for batch in computed.iter_batches(batch_format="pandas", batch_size=None):
                out.take(batch)
            rep = out.finish()
    finally:
        if started:
            ray.shutdown()
    rep.seconds = time.perf_counter() - t0
    log.info(
        "ray ingest: %d documents, %d added, %d unchanged, %d errors, %d chunk KV computed in %.1f s",
        rep.documents,
        rep.documents_added,
        rep.documents_unchanged,
        len(rep.errors),
        rep.kv_computed,
        rep.seconds,
    )
    return rep


def error_lines(rep: DatasetIngestReport) -> Iterable[str]:
    """The report's errors as lines for a terminal."""
    for e in rep.errors:
        yield f"  {e['doc_id'] or '?'} ({e['source'] or 'input'}): {e['error']}"
