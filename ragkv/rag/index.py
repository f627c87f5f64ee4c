"""The retrieval index: a FAISS vector index plus a SQLite chunk table, both persisted on disk."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (doc_id TEXT PRIMARY KEY, text_sha TEXT NOT NULL, metadata TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
  chunk_id INTEGER PRIMARY KEY AUTOINCREMENT, doc_id TEXT NOT NULL, seq INTEGER NOT NULL, text TEXT NOT NULL,
  token_ids BLOB NOT NULL, kv_key TEXT NOT NULL, UNIQUE(doc_id, seq));
CREATE INDEX IF NOT EXISTS chunks_kv ON chunks(kv_key);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ChunkIndex:
    """FAISS inner-product (cosine on normalised vectors) or L2 index over chunk ids, + chunk table.

    The FAISS index is saved atomically next to the SQLite file after every change; a restart
    (``ChunkIndex(same_dir)``) finds every document, chunk and vector again.
    """

    def __init__(self, directory: str | os.PathLike, dim: int, metric: str = "cosine", identity: str = ""):
        import faiss

        if metric not in ("cosine", "l2"):
            raise ValueError("metric must be 'cosine' or 'l2'")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dim, self.metric = dim, metric
        self._lock = threading.RLock()
        self.db = sqlite3.connect(self.dir / "chunks.sqlite", check_same_thread=False)
        self.db.executescript(_SCHEMA)
        want = json.dumps({"dim": dim, "metric": metric, "identity": identity}, sort_keys=True)
        row = self.db.execute("SELECT v FROM meta WHERE k='index'").fetchone()
        if row and row[0] != want:
            raise ValueError(
                f"index in {self.dir} was built with {row[0]}, not {want}: use another directory or re-ingest"
            )
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('index', ?)", (want,))
        self.db.commit()
        self._faiss_path = self.dir / "vectors.faiss"
        if self._faiss_path.exists():
            self.vectors = faiss.read_index(str(self._faiss_path))
        else:
            base = faiss.IndexFlatIP(dim) if metric == "cosine" else faiss.IndexFlatL2(dim)
            self.vectors = faiss.IndexIDMap2(base)

    # ---- documents -----------------------------------------------------------------------------
    def _query(self, sql: str, args: tuple = ()) -> list:
        """Read rows under the index lock (one SQLite connection is shared by the server's threads)."""
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    def document_sha(self, doc_id: str) -> str | None:
        rows = self._query("SELECT text_sha FROM documents WHERE doc_id=?", (doc_id,))
        return rows[0][0] if rows else None

    def has_document(self, doc_id: str) -> bool:
        return self.document_sha(doc_id) is not None

    def document_ids(self) -> list[str]:
        return [r[0] for r in self._query("SELECT doc_id FROM documents ORDER BY doc_id")]

    def add_document(
        self,
        doc_id: str,
        sha: str,
        metadata: dict,
        chunks: list[tuple[int, str, list[int], str]],
        vectors: np.ndarray,
    ) -> list[int]:
        """Insert a document's chunks ``(seq, text, token_ids, kv_key)`` and their vectors."""
        with self._lock:
            cur = self.db.cursor()
            cur.execute(
                "INSERT OR REPLACE INTO documents VALUES (?, ?, ?)", (doc_id, sha, json.dumps(metadata))
            )
            ids = []
            for seq, text, tokens, key in chunks:
                cur.execute(
                    "INSERT INTO chunks (doc_id, seq, text, token_ids, kv_key) VALUES (?, ?, ?, ?, ?)",
                    (doc_id, seq, text, np.asarray(tokens, dtype=np.int32).tobytes(), key),
                )
                ids.append(int(cur.lastrowid))
            if ids:
                self.vectors.add_with_ids(vectors, np.asarray(ids, dtype=np.int64))
            self.db.commit()
            self._save()
            return ids

    def delete_document(self, doc_id: str) -> list[str]:
        """Remove a document, its chunks and vectors; returns the KV keys no other chunk uses."""
        with self._lock:
            rows = self.db.execute("SELECT chunk_id, kv_key FROM chunks WHERE doc_id=?", (doc_id,)).fetchall()
            if not rows and not self.has_document(doc_id):
                raise KeyError(doc_id)
            ids = np.asarray([r[0] for r in rows], dtype=np.int64)
            if ids.size:
                self.vectors.remove_ids(ids)
            self.db.execute("DELETE FROM chunks WHERE doc_id=?", (doc_id,))
            self.db.execute("DELETE FROM documents WHERE doc_id=?", (doc_id,))
            self.db.commit()
            self._save()
            keys = {r[1] for r in rows}
            return [k for k in keys if not self._query("SELECT 1 FROM chunks WHERE kv_key=?", (k,))]

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

    def all_chunks(self) -> list[ChunkRecord]:
        return [self._record(r) for r in self._query(self._SELECT + " ORDER BY c.chunk_id")]

    def __len__(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM chunks")[0][0])

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

    def _save(self) -> None:
        import faiss

        tmp = self._faiss_path.with_suffix(f".{os.getpid()}.tmp")
        faiss.write_index(self.vectors, str(tmp))
        os.replace(tmp, self._faiss_path)

    def close(self) -> None:
        with self._lock:
            self.db.close()
