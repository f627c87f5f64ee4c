"""The retrieval index: a SQLite chunk table (the durable record) plus an in-memory FAISS index over it.

Crash consistency: SQLite is the single source of truth. Every chunk row carries its embedding, and a
document (its row, its chunks and their vectors) is written in one transaction, so after ``kill -9`` at
any point a document is either wholly there or not there at all. The FAISS index is a cache of those
vectors: it is saved as a snapshot (``vectors.faiss``) only every ``snapshot_every`` changes (and on
close), and at start-up it is reconciled with SQLite (vectors of chunks missing from the snapshot are
added, vectors of deleted chunks removed; chunk ids are never reused, so the id sets say everything).
Adding a document therefore costs one SQLite transaction over its own chunks, not a rewrite of the
whole index. Leftover temporary files of an interrupted snapshot are removed at start-up.

The ``kv_intents`` table is the write-ahead record of chunk KV that may sit in the store without a
chunk referencing it (KV written by an ingest that has not committed yet, KV of chunks a delete has
just removed); :meth:`ragkv.rag.RAG` deletes those blobs once they are unreferenced, also after a crash.

Collections (:mod:`ragkv.rag.collections`): every document and chunk row names its collection, and a
document is identified by ``(collection, doc_id)``. A folder written before collections is migrated
when opened (its documents land in the default collection; chunk ids and the id sequence are kept).
Search within a collection passes FAISS an id selector of that collection's chunk ids (kept in
memory): the top ``k`` is exact inside the collection, unlike over-fetching and filtering, which
misses hits of a small collection next to a large one, and one flat index keeps one snapshot and one
reconciliation instead of one per collection.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path

import numpy as np

from ragkv.rag.collections import DEFAULT_COLLECTION

log = logging.getLogger("ragkv.rag")


class IndexFullError(OSError):
    """A write to the index met a full disk (ENOSPC, or SQLite's page limit): it was rolled back whole,
    so the index holds what it held before; retry once space is freed (the service answers 507)."""


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, sqlite3.OperationalError):
        code = getattr(e, "sqlite_errorcode", None)  # Python >= 3.11; the message before that
        return code == sqlite3.SQLITE_FULL if code is not None else "disk is full" in str(e)
    return isinstance(e, OSError) and e.errno == errno.ENOSPC


@dataclass
class ChunkRecord:
    """One indexed chunk: where it came from, its exact token ids and its KV key."""

    chunk_id: int
    doc_id: str
    seq: int
    text: str
    token_ids: list[int]
    kv_key: str
    metadata: dict = field(default_factory=dict)
    score: float = 0.0
    collection: str = DEFAULT_COLLECTION


@dataclass
class CollectionCounts:
    """A collection's size as quotas count it: documents, chunks, tokens of every chunk, and tokens of
    its distinct chunk KV keys (``kv_tokens``: a key two of its chunks share counts once)."""

    documents: int = 0
    chunks: int = 0
    tokens: int = 0
    kv_tokens: int = 0


@dataclass
class PendingDocument:
    """A document ready to commit: its chunks ``(seq, text, token_ids, kv_key)`` and their vectors."""

    doc_id: str
    sha: str
    metadata: dict
    chunks: list[tuple[int, str, list[int], str]]
    vectors: np.ndarray
    collection: str = DEFAULT_COLLECTION


_TABLES = """
CREATE TABLE IF NOT EXISTS {documents} (
  collection TEXT NOT NULL DEFAULT 'default', doc_id TEXT NOT NULL, text_sha TEXT NOT NULL,
  metadata TEXT NOT NULL, PRIMARY KEY (collection, doc_id));
CREATE TABLE IF NOT EXISTS {chunks} (
  chunk_id INTEGER PRIMARY KEY AUTOINCREMENT, collection TEXT NOT NULL DEFAULT 'default',
  doc_id TEXT NOT NULL, seq INTEGER NOT NULL, text TEXT NOT NULL, token_ids BLOB NOT NULL,
  kv_key TEXT NOT NULL, vector BLOB, UNIQUE(collection, doc_id, seq));
"""
_SCHEMA = (
    _TABLES.format(documents="documents", chunks="chunks")
    + """
CREATE INDEX IF NOT EXISTS chunks_kv ON chunks(kv_key, collection);
CREATE INDEX IF NOT EXISTS documents_sha ON documents(text_sha);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS kv_intents (
  kv_key TEXT NOT NULL, owner TEXT NOT NULL DEFAULT '', PRIMARY KEY (kv_key, owner));
"""
)


def text_sha(text: str) -> str:
    """The content hash that decides whether a re-ingested document changed."""
    return hashlib.sha256(text.encode()).hexdigest()


class ChunkIndex:
    """FAISS inner-product (cosine on normalised vectors) or L2 index over chunk ids, + chunk table.

    A restart (``ChunkIndex(same_dir)``) finds every committed document, chunk and vector again,
    whatever point an earlier process was killed at (see the module docstring).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        dim: int,
        metric: str = "cosine",
        identity: str = "",
        snapshot_every: int | None = None,
    ):
        if metric not in ("cosine", "l2"):
            raise ValueError("metric must be 'cosine' or 'l2'")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dim, self.metric = dim, metric
        #: changes (vectors added + removed) after which the FAISS snapshot is rewritten; None: adaptive
        self.snapshot_every = snapshot_every
        self._lock = threading.RLock()
        self._snap_lock = threading.Lock()
        for tmp in self.dir.glob("*.tmp"):  # an interrupted snapshot (or the old full rewrite)
            log.info("removing leftover %s", tmp)
            tmp.unlink(missing_ok=True)
        self.db = sqlite3.connect(self.dir / "chunks.sqlite", check_same_thread=False, isolation_level=None)
        # WAL + FULL: a committed transaction survives kill -9 and power loss; readers never see half of one
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(chunks)")}
        if cols and "vector" not in cols:  # an index written before vectors moved into SQLite
            self.db.execute("ALTER TABLE chunks ADD COLUMN vector BLOB")
        self._migrate_collections()
        self._migrate_intents()
        self.db.executescript(_SCHEMA)
        #: the writer whose intents this process records (:mod:`ragkv.rag.writers`; "": no owner named)
        self.owner = ""
        want = json.dumps({"dim": dim, "metric": metric, "identity": identity}, sort_keys=True)
        row = self.db.execute("SELECT v FROM meta WHERE k='index'").fetchone()
        if row and row[0] != want:
            raise ValueError(
                f"index in {self.dir} was built with {row[0]}, not {want}: use another directory or re-ingest"
            )
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('index', ?)", (want,))
        self._faiss_path = self.dir / "vectors.faiss"
        self._dirty = 0
        self.vectors, self._ids = self._load_vectors()
        #: committed chunk ids per collection (the search's id selectors)
        self._members: dict[str, set[int]] = {}
        for cid, coll in self.db.execute("SELECT chunk_id, collection FROM chunks"):
            self._members.setdefault(coll, set()).add(int(cid))
        #: per-collection counts (:meth:`usage`): counted on first use, then kept by commits and deletes
        self._usage: dict[str, CollectionCounts] = {}
        self._n_docs = int(self.db.execute("SELECT COUNT(*) FROM documents").fetchone()[0])
        self._n_chunks = int(self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])
        if self._dirty:
            self.snapshot()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One SQLite write transaction (``BEGIN IMMEDIATE``): committed at the end of the block, rolled
        back when anything in it (or the commit) raises."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException as e:
            if self.db.in_transaction:  # SQLite may have rolled back itself (a full disk does)
                self.db.execute("ROLLBACK")
            if _disk_full(e):
                raise IndexFullError(
                    errno.ENOSPC,
                    f"the index's disk is full ({self.dir}): nothing of this change was committed; "
                    "free space and retry",
                ) from e
            raise

    # ---- start-up recovery ------------------------------------------------------------------------
    def _migrate_collections(self) -> None:
        """A folder from before collections: rebuild its two tables with a ``collection`` column (every
        row in the default collection), in one transaction, keeping chunk ids and the id sequence (ids
        are never reused: the FAISS reconciliation relies on it)."""
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(documents)")}
        if not cols or "collection" in cols:
            return
        log.info("index %s: migrating to collections (existing documents: %r)", self.dir, DEFAULT_COLLECTION)
        with self._transaction():
            row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name='chunks'").fetchone()
            # one statement at a time: executescript would commit the open transaction
            for stmt in _TABLES.format(documents="documents_v2", chunks="chunks_v2").split(";"):
                if stmt.strip():
                    self.db.execute(stmt)
            self.db.execute(
                "INSERT INTO documents_v2 (collection, doc_id, text_sha, metadata) "
                "SELECT ?, doc_id, text_sha, metadata FROM documents",
                (DEFAULT_COLLECTION,),
            )
            self.db.execute(
                "INSERT INTO chunks_v2 (chunk_id, collection, doc_id, seq, text, token_ids, kv_key, vector) "
                "SELECT chunk_id, ?, doc_id, seq, text, token_ids, kv_key, vector FROM chunks",
                (DEFAULT_COLLECTION,),
            )
            for old in ("documents", "chunks"):
                self.db.execute(f"DROP TABLE {old}")
                self.db.execute(f"ALTER TABLE {old}_v2 RENAME TO {old}")
            if row is not None:
                self.db.execute("DELETE FROM sqlite_sequence WHERE name='chunks'")
                self.db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('chunks', ?)", (row[0],))

    def _migrate_intents(self) -> None:
        """Intents from before several writers (``kv_key`` only): kept, owned by no named writer (settled
        by the next writer alone on the folder)."""
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(kv_intents)")}
        if not cols or "owner" in cols:
            return
        with self._transaction():
            self.db.execute("ALTER TABLE kv_intents RENAME TO kv_intents_v1")
            self.db.execute(
                "CREATE TABLE kv_intents (kv_key TEXT NOT NULL, owner TEXT NOT NULL DEFAULT '', "
                "PRIMARY KEY (kv_key, owner))"
            )
            self.db.execute("INSERT INTO kv_intents (kv_key, owner) SELECT kv_key, '' FROM kv_intents_v1")
            self.db.execute("DROP TABLE kv_intents_v1")

    def _empty(self):
        import faiss

        base = faiss.IndexFlatIP(self.dim) if self.metric == "cosine" else faiss.IndexFlatL2(self.dim)
        return faiss.IndexIDMap2(base)

    def _load_vectors(self):
        """The snapshot reconciled with the chunk table (which wins): returns (index, id set)."""
        import faiss

        index = None
        if self._faiss_path.exists():
            try:
                index = faiss.read_index(str(self._faiss_path))
                if index.d != self.dim:
                    raise ValueError(f"snapshot has dimension {index.d}, not {self.dim}")
            except Exception as e:  # noqa: BLE001 - a snapshot is only a cache: rebuild it from SQLite
                log.warning(
                    "FAISS snapshot %s unreadable (%s): rebuilding it from the chunk table",
                    self._faiss_path,
                    e,
                )
                index = None
        if index is None:
            index = self._empty()
        snap_ids = set(faiss.vector_to_array(index.id_map).tolist()) if index.ntotal else set()
        self._migrate_vectors(index, snap_ids)
        db_ids, added, removed = self._reconcile(index, snap_ids)
        if added or removed:
            log.info(
                "index %s: snapshot reconciled with the chunk table (+%d, -%d vectors)",
                self.dir,
                added,
                removed,
            )
        self._dirty = added + removed
        return index, db_ids

    def _reconcile(self, index, have: set[int]) -> tuple[set[int], int, int]:
        """Make ``index`` (holding the ids ``have``) hold exactly the chunk table's vectors: returns the
        table's ids and how many vectors were added and removed (the chunk table wins)."""
        db_ids = {r[0] for r in self.db.execute("SELECT chunk_id FROM chunks")}
        stale = have - db_ids
        if stale:
            index.remove_ids(np.fromiter(stale, dtype=np.int64))
        missing = sorted(db_ids - have)
        sql = "SELECT chunk_id, vector FROM chunks WHERE chunk_id IN ({marks})"
        for rows in self._select_in(sql, missing, size=4096):
            vecs = np.stack([np.frombuffer(v, dtype=np.float32) for _, v in rows])
            index.add_with_ids(vecs, np.asarray([r[0] for r in rows], dtype=np.int64))
        return db_ids, len(missing), len(stale)

    def refresh(self) -> dict:
        """Take in what other processes committed to this index (several writers on one data folder,
        :mod:`ragkv.rag.writers`): vectors added or deleted there, the collections' members, the counts.
        Returns ``{"added": n, "removed": n}`` (vectors). Searches wait for it (O(chunks) ids read)."""
        with self._lock:
            self._ids, added, removed = self._reconcile(self.vectors, self._ids)
            if added or removed:
                self._members = {}
                for cid, coll in self.db.execute("SELECT chunk_id, collection FROM chunks"):
                    self._members.setdefault(coll, set()).add(int(cid))
                self._usage.clear()  # counted again on first use
                self._n_docs = int(self.db.execute("SELECT COUNT(*) FROM documents").fetchone()[0])
                self._n_chunks = len(self._ids)
                self._dirty += added + removed
        if added or removed:
            log.info("index %s: refreshed from the chunk table (+%d, -%d vectors)", self.dir, added, removed)
            self._maybe_snapshot()
        return {"added": added, "removed": removed}

    def _migrate_vectors(self, index, snap_ids: set[int]) -> None:
        """Chunks without a stored vector (an index from before vectors moved into SQLite): take the
        vector from the old FAISS file; a document whose chunks are not all there was half-written by
        a crash of that version: it is removed (listed but never retrieved otherwise), to be re-ingested."""
        rows = self.db.execute(
            "SELECT chunk_id, collection, doc_id FROM chunks WHERE vector IS NULL"
        ).fetchall()
        if not rows:
            return
        broken: set[tuple[str, str]] = set()
        with self._transaction():
            for cid, coll, doc_id in rows:
                if cid in snap_ids:
                    vec = index.reconstruct(int(cid)).astype(np.float32)
                    self.db.execute("UPDATE chunks SET vector=? WHERE chunk_id=?", (vec.tobytes(), cid))
                else:
                    broken.add((coll, doc_id))
            for coll, doc_id in sorted(broken):
                log.warning("document %r was half-written by an earlier crash: removed, re-ingest it", doc_id)
                _, keys, _ = self._delete_rows(doc_id, coll)
                self._set_intents(keys, ())  # their KV (if any) is unreferenced now

    # ---- documents -----------------------------------------------------------------------------
    def _query(self, sql: str, args: tuple = ()) -> list:
        """Read rows under the index lock (one SQLite connection is shared by the server's threads)."""
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    def document_sha(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> str | None:
        """The text hash of a committed document of ``collection`` (None: not indexed there)."""
        rows = self._query(
            "SELECT text_sha FROM documents WHERE collection=? AND doc_id=?", (collection, doc_id)
        )
        return rows[0][0] if rows else None

    def document_shas(self, collection: str = DEFAULT_COLLECTION) -> dict[str, str]:
        """``{doc_id: text hash}`` of ``collection``'s committed documents."""
        return dict(self._query("SELECT doc_id, text_sha FROM documents WHERE collection=?", (collection,)))

    def has_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> bool:
        return self.document_sha(doc_id, collection) is not None

    def document_ids(self, collection: str = DEFAULT_COLLECTION) -> list[str]:
        """The ids of ``collection``'s documents, sorted."""
        rows = self._query("SELECT doc_id FROM documents WHERE collection=? ORDER BY doc_id", (collection,))
        return [r[0] for r in rows]

    def collections(self) -> list[str]:
        """The collections that hold at least one chunk, sorted (in memory: no SQLite)."""
        with self._lock:
            return sorted(c for c, ids in self._members.items() if ids)

    @property
    def num_documents(self) -> int:
        """Committed documents (kept in memory: health checks read it without touching SQLite)."""
        return self._n_docs

    def add_document(
        self,
        doc_id: str,
        sha: str,
        metadata: dict,
        chunks: list[tuple[int, str, list[int], str]],
        vectors: np.ndarray,
        collection: str = DEFAULT_COLLECTION,
    ) -> list[int]:
        """Insert (or replace) a document's chunks ``(seq, text, token_ids, kv_key)`` and their vectors."""
        ids, _ = self.commit([PendingDocument(doc_id, sha, metadata, chunks, vectors, collection)])
        return ids[(collection, doc_id)]

    def commit(self, docs: list[PendingDocument]) -> tuple[dict[tuple[str, str], list[int]], list[str]]:
        """Add or replace ``docs`` in one transaction (all or none); returns their chunk ids by
        ``(collection, doc_id)`` and the KV keys that no chunk references any more (recorded as
        intents until the caller deletes them)."""
        if len({(d.collection, d.doc_id) for d in docs}) != len(docs):
            raise ValueError("a commit names a document twice")
        for d in docs:
            v = np.asarray(d.vectors, dtype=np.float32)
            if v.shape != (len(d.chunks), self.dim):
                raise ValueError(f"document {d.doc_id!r}: {v.shape} vectors for {len(d.chunks)} chunks")
        with self._lock:
            out: dict[tuple[str, str], list[int]] = {}
            removed: list[int] = []
            gone_by: list[tuple[str, list[int]]] = []
            freed: set[str] = set()
            replaced = 0
            with self._transaction():
                after: dict[str, CollectionCounts] = {}  # the new counts of collections whose counts are kept
                for coll in {d.collection for d in docs} & set(self._usage):
                    mine = [d for d in docs if d.collection == coll]
                    chunks = [(key, len(toks)) for d in mine for _, _, toks, key in d.chunks]
                    after[coll] = self.usage_after(coll, [d.doc_id for d in mine], chunks)
                for d in docs:
                    gone, keys, existed = self._delete_rows(d.doc_id, d.collection)
                    removed += gone
                    gone_by.append((d.collection, gone))
                    freed |= keys
                    replaced += existed
                    self.db.execute(
                        "INSERT INTO documents (collection, doc_id, text_sha, metadata) VALUES (?, ?, ?, ?)",
                        (d.collection, d.doc_id, d.sha, json.dumps(d.metadata)),
                    )
                    vecs = np.ascontiguousarray(d.vectors, dtype=np.float32)
                    ids = []
                    for (seq, text, tokens, key), vec in zip(d.chunks, vecs, strict=True):
                        toks = np.asarray(tokens, dtype=np.int32).tobytes()
                        cur = self.db.execute(
                            "INSERT INTO chunks (collection, doc_id, seq, text, token_ids, kv_key, vector) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (d.collection, d.doc_id, seq, text, toks, key, vec.tobytes()),
                        )
                        ids.append(int(cur.lastrowid))
                    out[(d.collection, d.doc_id)] = ids
                new_keys = {c[3] for d in docs for c in d.chunks}
                freed = {k for k in freed - new_keys if not self.references(k)}
                self._set_intents(freed, new_keys)
            self._usage.update(after)
            self._apply(removed, [(out[(d.collection, d.doc_id)], d.vectors) for d in docs])
            for coll, gone in gone_by:
                self._members.get(coll, set()).difference_update(gone)
            for d in docs:
                self._members.setdefault(d.collection, set()).update(out[(d.collection, d.doc_id)])
            self._n_docs += len(docs) - replaced
            self._n_chunks += sum(len(v) for v in out.values()) - len(removed)
        self._maybe_snapshot()
        return out, sorted(freed)

    def delete_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> list[str]:
        """Remove a document of ``collection`` (KeyError: none there), its chunks and vectors; returns
        the KV keys no other chunk (of any collection) uses (they are recorded as intents in the same
        transaction, so a crash before the store deletes them is redone)."""
        with self._lock:
            with self._transaction():
                if not self.has_document(doc_id, collection):
                    raise KeyError(doc_id)
                kept = collection in self._usage
                after = self.usage_after(collection, [doc_id], [], deleted=True) if kept else None
                removed, keys, _ = self._delete_rows(doc_id, collection)
                freed = {k for k in keys if not self.references(k)}
                self._set_intents(freed, ())
            if after is not None:
                self._usage[collection] = after
            self._apply(removed, [])
            self._members.get(collection, set()).difference_update(removed)
            self._n_docs -= 1
            self._n_chunks -= len(removed)
        self._maybe_snapshot()
        return sorted(freed)

    def _delete_rows(self, doc_id: str, collection: str) -> tuple[list[int], set[str], bool]:
        """Delete a document's rows inside the caller's transaction: (chunk ids, their KV keys, existed)."""
        where = (collection, doc_id)
        rows = self.db.execute(
            "SELECT chunk_id, kv_key FROM chunks WHERE collection=? AND doc_id=?", where
        ).fetchall()
        had = self.db.execute("DELETE FROM documents WHERE collection=? AND doc_id=?", where).rowcount
        self.db.execute("DELETE FROM chunks WHERE collection=? AND doc_id=?", where)
        return [r[0] for r in rows], {r[1] for r in rows}, bool(had)

    # ---- usage (quotas) ----------------------------------------------------------------------------
    def usage(self, collection: str = DEFAULT_COLLECTION) -> CollectionCounts:
        """``collection``'s counts (:class:`CollectionCounts`): counted from the chunk table the first
        time (one pass over the collection's rows), then kept up to date by every commit and delete."""
        with self._lock:
            u = self._usage.get(collection)
            if u is None:
                if not self._members.get(collection):  # nothing there (any name may be asked): not kept
                    return CollectionCounts()
                u = self._usage[collection] = self._count(collection)
            return replace(u)

    def usage_after(
        self, collection: str, doc_ids, chunks: list[tuple[str, int]], deleted: bool = False
    ) -> CollectionCounts:
        """``collection``'s counts if a commit replaced (or added) the documents ``doc_ids`` with chunks
        ``(kv_key, tokens)`` (all of theirs together), or with ``deleted`` removed them, computed without
        changing anything: a replaced document's chunks leave, and a KV key counts while any chunk of
        the collection still uses it. Commits and deletes keep :meth:`usage`'s counts with it too."""
        ids = set(doc_ids)
        with self._lock:
            now = self.usage(collection)
            old: list[tuple[str, int]] = []
            existing = 0
            for doc_id in ids:
                old += self._rows_of(collection, doc_id)
                existing += self.has_document(doc_id, collection)
            keys = dict(old)
            keys.update(chunks)
            before: set[str] = set()
            outside: set[str] = set()  # keys other documents of the collection use
            sql = "SELECT kv_key, doc_id FROM chunks WHERE collection=? AND kv_key IN ({marks})"
            for key, doc_id in chain.from_iterable(self._select_in(sql, list(keys), collection)):
                before.add(key)
                if doc_id not in ids:
                    outside.add(key)
            after = outside | {k for k, _ in chunks}
            return CollectionCounts(
                documents=now.documents + (0 if deleted else len(ids)) - existing,
                chunks=now.chunks - len(old) + len(chunks),
                tokens=now.tokens - sum(n for _, n in old) + sum(n for _, n in chunks),
                kv_tokens=now.kv_tokens - sum(keys[k] for k in before) + sum(keys[k] for k in after),
            )

    def _count(self, collection: str) -> CollectionCounts:
        one = (collection,)
        docs = self.db.execute("SELECT COUNT(*) FROM documents WHERE collection=?", one).fetchone()[0]
        chunks, size = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(length(token_ids)), 0) FROM chunks WHERE collection=?", one
        ).fetchone()
        kv = self.db.execute(
            "SELECT COALESCE(SUM(n), 0) FROM (SELECT MAX(length(token_ids)) AS n FROM chunks "
            "WHERE collection=? GROUP BY kv_key)",
            one,
        ).fetchone()[0]
        return CollectionCounts(int(docs), int(chunks), int(size) // 4, int(kv) // 4)

    def _rows_of(self, collection: str, doc_id: str) -> list[tuple[str, int]]:
        """``(kv_key, tokens)`` of a document's chunks (token ids are int32: 4 bytes each)."""
        return [
            (k, int(n) // 4)
            for k, n in self.db.execute(
                "SELECT kv_key, length(token_ids) FROM chunks WHERE collection=? AND doc_id=?",
                (collection, doc_id),
            )
        ]

    def _select_in(self, sql: str, values: list, *args, size: int = 500) -> Iterator[list]:
        """The rows of ``sql`` with ``args`` then ``values`` as its ``IN ({marks})`` list, a batch of
        ``size`` values at a time (SQLite bounds the variables of one statement)."""
        for lo in range(0, len(values), size):
            part = values[lo : lo + size]
            yield self.db.execute(sql.format(marks=",".join("?" * len(part))), (*args, *part)).fetchall()

    def _set_intents(self, add, drop) -> None:
        """Record ``add`` as this writer's intents; forget every writer's intents on ``drop`` (now referenced)."""
        self.db.executemany(
            "INSERT OR IGNORE INTO kv_intents (kv_key, owner) VALUES (?, ?)", [(k, self.owner) for k in add]
        )
        self.db.executemany("DELETE FROM kv_intents WHERE kv_key=?", [(k,) for k in drop])

    def _apply(self, removed: list[int], added: list[tuple[list[int], np.ndarray]]) -> None:
        """Mirror a committed transaction in the in-memory FAISS index (under the lock)."""
        if removed:
            self.vectors.remove_ids(np.asarray(removed, dtype=np.int64))
            self._ids.difference_update(removed)
        for ids, vecs in added:
            if ids:
                self.vectors.add_with_ids(
                    np.ascontiguousarray(vecs, dtype=np.float32), np.asarray(ids, dtype=np.int64)
                )
                self._ids.update(ids)
        self._dirty += len(removed) + sum(len(i) for i, _ in added)

    # ---- KV intents --------------------------------------------------------------------------------
    def references(self, kv_key: str, collection: str | None = None) -> bool:
        """Whether a committed chunk (of ``collection``; None: of any) uses this KV key (a write-back
        must not store KV nobody uses; a request may reuse only its collection's KV)."""
        if collection is None:
            sql, args = "SELECT 1 FROM chunks WHERE kv_key=? LIMIT 1", (kv_key,)
        else:
            sql, args = "SELECT 1 FROM chunks WHERE kv_key=? AND collection=? LIMIT 1", (kv_key, collection)
        return bool(self._query(sql, args))

    def referenced_keys(self, keys, collection: str) -> set[str]:
        """The ones of ``keys`` that a committed chunk of ``collection`` uses."""
        sql = "SELECT DISTINCT kv_key FROM chunks WHERE collection=? AND kv_key IN ({marks})"
        with self._lock:
            return {
                r[0] for rows in self._select_in(sql, list(dict.fromkeys(keys)), collection) for r in rows
            }

    def add_intents(self, keys: list[str]) -> None:
        """Record, before writing them, KV keys that may end up in the store unreferenced."""
        if keys:
            with self._lock, self._transaction():
                self._set_intents(keys, ())

    def intents(self, owner: str | None = None) -> list[str]:
        """The keys of every writer's intents (``owner``: of that writer's only)."""
        if owner is None:
            return [r[0] for r in self._query("SELECT DISTINCT kv_key FROM kv_intents ORDER BY kv_key")]
        return [
            r[0] for r in self._query("SELECT kv_key FROM kv_intents WHERE owner=? ORDER BY kv_key", (owner,))
        ]

    def settle_intents(self, delete, everyone: bool = True) -> int:
        """Call ``delete(key)`` for every intent no chunk references, then forget those intents: every
        writer's (``everyone``: the caller is alone on the folder, :mod:`ragkv.rag.writers`), or only this
        writer's (``self.owner``), keeping KV another writer's intent still covers."""
        n = 0
        for key in self.intents(None if everyone else self.owner):
            with self._lock:
                rows = self.db.execute("SELECT owner FROM kv_intents WHERE kv_key=?", (key,)).fetchall()
            others = not everyone and any(o != self.owner for (o,) in rows)
            if not others and not self.references(key):
                delete(key)
                n += 1
            with self._lock:
                if everyone:
                    self.db.execute("DELETE FROM kv_intents WHERE kv_key=?", (key,))
                else:
                    self.db.execute("DELETE FROM kv_intents WHERE kv_key=? AND owner=?", (key, self.owner))
        return n

    def repair_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> bool:
        """Whether a committed document is whole (chunks present, vectors indexed); vectors missing from
        FAISS are re-added from the chunk table. False: re-ingest it (re-ingest repairs, never trusts)."""
        with self._lock:
            rows = self.db.execute(
                "SELECT chunk_id, vector FROM chunks WHERE collection=? AND doc_id=? ORDER BY seq",
                (collection, doc_id),
            ).fetchall()
            if not rows or any(v is None for _, v in rows):
                return False
            lost = [(cid, v) for cid, v in rows if cid not in self._ids]
            if lost:
                log.warning("document %r: %d chunk vector(s) missing from FAISS, re-added", doc_id, len(lost))
                vecs = np.stack([np.frombuffer(v, dtype=np.float32) for _, v in lost])
                self._apply([], [([c for c, _ in lost], vecs)])
            return True

    # ---- chunks ----------------------------------------------------------------------------------
    def _record(self, row) -> ChunkRecord:
        cid, doc_id, seq, text, blob, key, meta, coll = row
        tokens = np.frombuffer(blob, dtype=np.int32).tolist()
        return ChunkRecord(
            cid, doc_id, seq, text, tokens, key, json.loads(meta) if meta else {}, collection=coll
        )

    _SELECT = (
        "SELECT c.chunk_id, c.doc_id, c.seq, c.text, c.token_ids, c.kv_key, d.metadata, c.collection "
        "FROM chunks c JOIN documents d ON d.collection = c.collection AND d.doc_id = c.doc_id"
    )

    def chunk(self, chunk_id: int, collection: str | None = None) -> ChunkRecord | None:
        """The chunk with this id (None: no such chunk, or not in ``collection`` when one is given)."""
        if not 0 <= int(chunk_id) < 2**63:  # SQLite integers are 64-bit: anything else is unknown
            return None
        rows = self._query(self._SELECT + " WHERE c.chunk_id=?", (int(chunk_id),))
        rec = self._record(rows[0]) if rows else None
        return rec if rec is not None and collection in (None, rec.collection) else None

    def chunks_of(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> list[ChunkRecord]:
        rows = self._query(
            self._SELECT + " WHERE c.collection=? AND c.doc_id=? ORDER BY c.seq", (collection, doc_id)
        )
        return [self._record(r) for r in rows]

    def chunks_with_key(self, kv_key: str, collection: str | None = None) -> list[ChunkRecord]:
        """Chunks (of ``collection``; None: of any) whose KV key is ``kv_key`` (the same token ids
        under the same model), oldest first."""
        rows = self._query(self._SELECT + " WHERE c.kv_key=? ORDER BY c.chunk_id", (kv_key,))
        return [r for r in map(self._record, rows) if collection in (None, r.collection)]

    def documents_with_text(self, text: str, collection: str = DEFAULT_COLLECTION) -> list[str]:
        """Ids of ``collection``'s committed documents whose text is exactly ``text``."""
        rows = self._query(
            "SELECT doc_id FROM documents WHERE text_sha=? AND collection=? ORDER BY doc_id",
            (text_sha(text), collection),
        )
        return [r[0] for r in rows]

    def all_chunks(self) -> list[ChunkRecord]:
        return [self._record(r) for r in self._query(self._SELECT + " ORDER BY c.chunk_id")]

    def __len__(self) -> int:
        return self._n_chunks

    def search(self, vector: np.ndarray, k: int, collection: str | None = None) -> list[ChunkRecord]:
        """Top-``k`` chunks (of ``collection``; None: of all) by similarity (cosine: higher is closer;
        l2: the score is -distance). A collection is searched through an id selector (exact; see the
        module docstring), skipped when it holds every chunk."""
        import faiss

        query = np.asarray(vector, dtype=np.float32).reshape(1, -1)
        with self._lock:
            if self.vectors.ntotal == 0 or k <= 0:
                return []
            members = self._members.get(collection, set()) if collection is not None else None
            if members is None or len(members) == len(self._ids):
                scores, ids = self.vectors.search(query, k)
            elif not members:
                return []
            else:
                sel = faiss.IDSelectorBatch(np.fromiter(members, dtype=np.int64, count=len(members)))
                scores, ids = self.vectors.search(query, k, params=faiss.SearchParameters(sel=sel))
        out = []
        for s, cid in zip(scores[0], ids[0], strict=True):
            if cid < 0:
                continue
            rec = self.chunk(int(cid), collection)
            if rec is not None:
                rec.score = float(s) if self.metric == "cosine" else -float(s)
                out.append(rec)
        return out

    # ---- snapshots -------------------------------------------------------------------------------
    def _maybe_snapshot(self) -> None:
        every = self.snapshot_every or max(4096, self.vectors.ntotal // 8)
        if self._dirty >= every:
            try:
                self.snapshot()
            except OSError as e:  # disk full ...: the change is committed; start-up rebuilds from SQLite
                log.warning("could not write the FAISS snapshot (retried after more changes): %s", e)

    def snapshot(self) -> None:
        """Write the FAISS snapshot (atomically: temporary file, fsync, rename); only start-up speed
        depends on it. Serialised under the lock, written outside it, so searches are not held up."""
        import faiss

        with self._snap_lock:
            with self._lock:
                data = faiss.serialize_index(self.vectors)
                self._dirty = 0
            tmp = self._faiss_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(memoryview(data))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._faiss_path)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk keeps no half-written snapshot
                raise

    def close(self) -> None:
        """Snapshot if anything changed since the last one, and close SQLite."""
        if self._dirty:
            try:
                self.snapshot()
            except Exception as e:  # noqa: BLE001 - the next start-up reconciles from SQLite anyway
                log.warning("could not write the FAISS snapshot on close: %s", e)
        with self._lock:
            self.db.close()
