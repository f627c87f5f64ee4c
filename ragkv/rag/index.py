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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger("ragkv.rag")


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


@dataclass
class PendingDocument:
    """A document ready to commit: its chunks ``(seq, text, token_ids, kv_key)`` and their vectors."""

    doc_id: str
    sha: str
    metadata: dict
    chunks: list[tuple[int, str, list[int], str]]
    vectors: np.ndarray


_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (doc_id TEXT PRIMARY KEY, text_sha TEXT NOT NULL, metadata TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
  chunk_id INTEGER PRIMARY KEY AUTOINCREMENT, doc_id TEXT NOT NULL, seq INTEGER NOT NULL, text TEXT NOT NULL,
  token_ids BLOB NOT NULL, kv_key TEXT NOT NULL, vector BLOB, UNIQUE(doc_id, seq));
CREATE INDEX IF NOT EXISTS chunks_kv ON chunks(kv_key);
CREATE INDEX IF NOT EXISTS documents_sha ON documents(text_sha);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS kv_intents (kv_key TEXT PRIMARY KEY);
"""


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
        self.db.executescript(_SCHEMA)
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(chunks)")}
        if "vector" not in cols:  # an index written before vectors moved into SQLite
            self.db.execute("ALTER TABLE chunks ADD COLUMN vector BLOB")
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
        self._n_docs = int(self.db.execute("SELECT COUNT(*) FROM documents").fetchone()[0])
        self._n_chunks = int(self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])
        if self._dirty:
            self.snapshot()

    # ---- start-up recovery ------------------------------------------------------------------------
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
        db_ids = {r[0] for r in self.db.execute("SELECT chunk_id FROM chunks")}
        stale = snap_ids - db_ids
        if stale:
            index.remove_ids(np.fromiter(stale, dtype=np.int64))
        missing = sorted(db_ids - snap_ids)
        for lo in range(0, len(missing), 4096):
            part = missing[lo : lo + 4096]
            marks = ",".join("?" * len(part))
            rows = self.db.execute(
                f"SELECT chunk_id, vector FROM chunks WHERE chunk_id IN ({marks})", part
            ).fetchall()
            vecs = np.stack([np.frombuffer(v, dtype=np.float32) for _, v in rows])
            index.add_with_ids(vecs, np.asarray([r[0] for r in rows], dtype=np.int64))
        if stale or missing:
            log.info(
                "index %s: snapshot reconciled with the chunk table (+%d, -%d vectors)",
                self.dir,
                len(missing),
                len(stale),
            )
        self._dirty = len(stale) + len(missing)
        return index, db_ids

    def _migrate_vectors(self, index, snap_ids: set[int]) -> None:
        """Chunks without a stored vector (an index from before vectors moved into SQLite): take the
        vector from the old FAISS file; a document whose chunks are not all there was half-written by
        a crash of that version: it is removed (listed but never retrieved otherwise), to be re-ingested."""
        rows = self.db.execute("SELECT chunk_id, doc_id FROM chunks WHERE vector IS NULL").fetchall()
        if not rows:
            return
        broken: set[str] = set()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for cid, doc_id in rows:
                if cid in snap_ids:
                    vec = index.reconstruct(int(cid)).astype(np.float32)
                    self.db.execute("UPDATE chunks SET vector=? WHERE chunk_id=?", (vec.tobytes(), cid))
                else:
                    broken.add(doc_id)
            for doc_id in sorted(broken):
                log.warning("document %r was half-written by an earlier crash: removed, re-ingest it", doc_id)
                _, keys, _ = self._delete_rows(doc_id)
                self._set_intents(keys, ())  # their KV (if any) is unreferenced now
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    # ---- documents -----------------------------------------------------------------------------
    def _query(self, sql: str, args: tuple = ()) -> list:
        """Read rows under the index lock (one SQLite connection is shared by the server's threads)."""
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    def document_sha(self, doc_id: str) -> str | None:
        """The text hash of a committed document (None: not indexed)."""
        rows = self._query("SELECT text_sha FROM documents WHERE doc_id=?", (doc_id,))
        return rows[0][0] if rows else None

    def has_document(self, doc_id: str) -> bool:
        return self.document_sha(doc_id) is not None

    def document_ids(self) -> list[str]:
        return [r[0] for r in self._query("SELECT doc_id FROM documents ORDER BY doc_id")]

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
    ) -> list[int]:
        """Insert (or replace) a document's chunks ``(seq, text, token_ids, kv_key)`` and their vectors."""
        ids, _ = self.commit([PendingDocument(doc_id, sha, metadata, chunks, vectors)])
        return ids[doc_id]

    def commit(self, docs: list[PendingDocument]) -> tuple[dict[str, list[int]], list[str]]:
        """Add or replace ``docs`` in one transaction (all or none); returns their chunk ids and the KV
        keys that no chunk references any more (recorded as intents until the caller deletes them)."""
        if len({d.doc_id for d in docs}) != len(docs):
            raise ValueError("a commit names a document twice")
        for d in docs:
            v = np.asarray(d.vectors, dtype=np.float32)
            if v.shape != (len(d.chunks), self.dim):
                raise ValueError(f"document {d.doc_id!r}: {v.shape} vectors for {len(d.chunks)} chunks")
        with self._lock:
            out: dict[str, list[int]] = {}
            removed: list[int] = []
            freed: set[str] = set()
            replaced = 0
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for d in docs:
                    gone, keys, existed = self._delete_rows(d.doc_id)
                    removed += gone
                    freed |= keys
                    replaced += existed
                    self.db.execute(
                        "INSERT INTO documents VALUES (?, ?, ?)", (d.doc_id, d.sha, json.dumps(d.metadata))
                    )
                    vecs = np.ascontiguousarray(d.vectors, dtype=np.float32)
                    ids = []
                    for (seq, text, tokens, key), vec in zip(d.chunks, vecs, strict=True):
                        cur = self.db.execute(
                            "INSERT INTO chunks (doc_id, seq, text, token_ids, kv_key, vector) VALUES (?, ?, ?, ?, ?, ?)",
                            (
                                d.doc_id,
                                seq,
                                text,
                                np.asarray(tokens, dtype=np.int32).tobytes(),
                                key,
                                vec.tobytes(),
                            ),
                        )
                        ids.append(int(cur.lastrowid))
                    out[d.doc_id] = ids
                new_keys = {c[3] for d in docs for c in d.chunks}
                freed = {k for k in freed - new_keys if not self._referenced(k)}
                self._set_intents(freed, new_keys)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self._apply(removed, [(out[d.doc_id], d.vectors) for d in docs])
            self._n_docs += len(docs) - replaced
            self._n_chunks += sum(len(v) for v in out.values()) - len(removed)
        self._maybe_snapshot()
        return out, sorted(freed)

    def delete_document(self, doc_id: str) -> list[str]:
        """Remove a document, its chunks and vectors; returns the KV keys no other chunk uses (they are
        recorded as intents in the same transaction, so a crash before the store deletes them is redone)."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                if not self.db.execute("SELECT 1 FROM documents WHERE doc_id=?", (doc_id,)).fetchone():
                    raise KeyError(doc_id)
                removed, keys, _ = self._delete_rows(doc_id)
                freed = {k for k in keys if not self._referenced(k)}
                self._set_intents(freed, ())
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self._apply(removed, [])
            self._n_docs -= 1
            self._n_chunks -= len(removed)
        self._maybe_snapshot()
        return sorted(freed)

    def _delete_rows(self, doc_id: str) -> tuple[list[int], set[str], bool]:
        """Delete a document's rows inside the caller's transaction: (chunk ids, their KV keys, existed)."""
        rows = self.db.execute("SELECT chunk_id, kv_key FROM chunks WHERE doc_id=?", (doc_id,)).fetchall()
        had = self.db.execute("DELETE FROM documents WHERE doc_id=?", (doc_id,)).rowcount
        self.db.execute("DELETE FROM chunks WHERE doc_id=?", (doc_id,))
        return [r[0] for r in rows], {r[1] for r in rows}, bool(had)

    def _referenced(self, key: str) -> bool:
        return self.db.execute("SELECT 1 FROM chunks WHERE kv_key=? LIMIT 1", (key,)).fetchone() is not None

    def _set_intents(self, add, drop) -> None:
        self.db.executemany("INSERT OR IGNORE INTO kv_intents VALUES (?)", [(k,) for k in add])
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
    def references(self, kv_key: str) -> bool:
        """Whether a committed chunk uses this KV key (a write-back must not store KV nobody uses)."""
        with self._lock:
            return self._referenced(kv_key)

    def add_intents(self, keys: list[str]) -> None:
        """Record, before writing them, KV keys that may end up in the store unreferenced."""
        if keys:
            with self._lock:
                self.db.execute("BEGIN IMMEDIATE")
                self._set_intents(keys, ())
                self.db.execute("COMMIT")

    def intents(self) -> list[str]:
        return [r[0] for r in self._query("SELECT kv_key FROM kv_intents ORDER BY kv_key")]

    def settle_intents(self, delete) -> int:
        """Call ``delete(key)`` for every intent no chunk references, then forget all intents."""
        n = 0
        for key in self.intents():
            if not self.references(key):
                delete(key)
                n += 1
            with self._lock:
                self.db.execute("DELETE FROM kv_intents WHERE kv_key=?", (key,))
        return n

    def repair_document(self, doc_id: str) -> bool:
        """Whether a committed document is whole (chunks present, vectors indexed); vectors missing from
        FAISS are re-added from the chunk table. False: re-ingest it (re-ingest repairs, never trusts)."""
        with self._lock:
            rows = self.db.execute(
                "SELECT chunk_id, vector FROM chunks WHERE doc_id=? ORDER BY seq", (doc_id,)
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
    def _record(self, row, score: float = 0.0) -> ChunkRecord:
        cid, doc_id, seq, text, tokens, key, meta = row
        return ChunkRecord(
            cid,
            doc_id,
            seq,
            text,
            np.frombuffer(tokens, dtype=np.int32).tolist(),
            key,
            json.loads(meta) if meta else {},
            score,
        )

    _SELECT = (
        "SELECT c.chunk_id, c.doc_id, c.seq, c.text, c.token_ids, c.kv_key, d.metadata FROM chunks c "
        "JOIN documents d ON d.doc_id = c.doc_id"
    )

    def chunk(self, chunk_id: int) -> ChunkRecord | None:
        if not 0 <= int(chunk_id) < 2**63:  # SQLite integers are 64-bit: anything else is unknown
            return None
        rows = self._query(self._SELECT + " WHERE c.chunk_id=?", (int(chunk_id),))
        return self._record(rows[0]) if rows else None

    def chunks_of(self, doc_id: str) -> list[ChunkRecord]:
        rows = self._query(self._SELECT + " WHERE c.doc_id=? ORDER BY c.seq", (doc_id,))
        return [self._record(r) for r in rows]

    def chunks_with_key(self, kv_key: str) -> list[ChunkRecord]:
        """Chunks whose KV key is ``kv_key`` (the same token ids under the same model), oldest first."""
        rows = self._query(self._SELECT + " WHERE c.kv_key=? ORDER BY c.chunk_id", (kv_key,))
        return [self._record(r) for r in rows]

    def documents_with_text(self, text: str) -> list[str]:
        """Ids of the committed documents whose text is exactly ``text``."""
        rows = self._query("SELECT doc_id FROM documents WHERE text_sha=? ORDER BY doc_id", (text_sha(text),))
        return [r[0] for r in rows]

    def all_chunks(self) -> list[ChunkRecord]:
        return [self._record(r) for r in self._query(self._SELECT + " ORDER BY c.chunk_id")]

    def __len__(self) -> int:
        return self._n_chunks

    def search(self, vector: np.ndarray, k: int) -> list[ChunkRecord]:
        """Top-``k`` chunks by similarity (cosine: higher is closer; l2: the score is -distance)."""
        with self._lock:
            if self.vectors.ntotal == 0 or k <= 0:
                return []
            scores, ids = self.vectors.search(np.asarray(vector, dtype=np.float32).reshape(1, -1), k)
        out = []
        for s, cid in zip(scores[0], ids[0], strict=True):
            if cid < 0:
                continue
            rec = self.chunk(int(cid))
            if rec is not None:
                rec.score = float(s) if self.metric == "cosine" else -float(s)
                out.append(rec)
        return out

    # ---- snapshots -------------------------------------------------------------------------------
    def _maybe_snapshot(self) -> None:
        every = self.snapshot_every or max(4096, self.vectors.ntotal // 8)
        if self._dirty >= every:
            self.snapshot()

    def snapshot(self) -> None:
        """Write the FAISS snapshot (atomically: temporary file, fsync, rename); only start-up speed
        depends on it. Serialised under the lock, written outside it, so searches are not held up."""
        import faiss

        with self._snap_lock:
            with self._lock:
                data = faiss.serialize_index(self.vectors)
                self._dirty = 0
            tmp = self._faiss_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(memoryview(data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._faiss_path)

    def close(self) -> None:
        """Snapshot if anything changed since the last one, and close SQLite."""
        if self._dirty:
            try:
                self.snapshot()
            except Exception as e:  # noqa: BLE001 - the next start-up reconciles from SQLite anyway
                log.warning("could not write the FAISS snapshot on close: %s", e)
        with self._lock:
            self.db.close()
