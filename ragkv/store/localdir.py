"""Local directory chunk KV store (the embedded default).

Layout: ``<root>/<key[:2]>/<key>.kvb`` (one blob per chunk, 256 shards) plus ``<root>/index.sqlite``
(key, bytes, created, last access) so that ``contains``, ``keys`` and ``nbytes`` never open a blob.
Writes go to a temp file in the shard dir and are published with ``os.replace`` (atomic); a reader
sees the old blob, the new one, or none. The index is updated after the rename; a blob without an
index row (crash in between) is adopted by the next ``put`` of that key or by ``rebuild_index``.

``fsync`` is off by default: a torn write after a power loss fails its checksums and reads as a
miss, which costs one recompute, never wrong KV. Last-access times for the optional LRU byte bound
are buffered in memory and flushed to the index every ``access_flush_s`` (and before evicting), so
per-layer reads do not each cost an SQLite write. sqlite3 in WAL mode makes the index safe for
several processes sharing one directory.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from ragkv.store import blob as blobfmt
from ragkv.store.base import BlobStore, StoreFullError, check_max_bytes

log = logging.getLogger("ragkv.store")

INDEX_NAME = "index.sqlite"
SUFFIX = ".kvb"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    key TEXT PRIMARY KEY,
    nbytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_lru ON chunks(last_access);
"""


class LocalDirStore(BlobStore):
    """One checksummed, per-layer addressable file per chunk under ``root``; survives restarts."""

    backend_errors = (OSError, sqlite3.Error)

    def __init__(
        self,
        root: str | os.PathLike,
        max_bytes: int | None = None,
        fsync: bool = False,
        access_flush_s: float = 5.0,
        **options,
    ) -> None:
        """``options``: :class:`BlobStore`'s (``codec``, ``codec_options``, ``verify``, ``hmac_key``, ``codecs``)."""
        super().__init__(**options)
        self.max_bytes = check_max_bytes(max_bytes)
        self.root = Path(root).expanduser().resolve()
        self._options = dict(options, fsync=fsync, access_flush_s=access_flush_s)
        self.fsync = fsync
        self.access_flush_s = access_flush_s
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        db_path = self.root / INDEX_NAME
        fresh = not db_path.exists()
        if fresh:  # private from the start: sqlite would create it with the process umask
            os.close(os.open(db_path, os.O_CREAT | os.O_WRONLY, 0o600))
        self._lock = threading.RLock()
        self._db = sqlite3.connect(db_path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._pending_access: dict[str, float] = {}
        self._last_flush = time.monotonic()
        if fresh and any(self.root.glob(f"??/*{SUFFIX}")):
            self.rebuild_index()  # cleans temp files too
        else:
            self._clean_tmp()

    def sibling(self, name: str) -> LocalDirStore:
        """``root/name`` as a store of its own (same key, codec and checks; its own size index)."""
        opts = {k: v for k, v in self._options.items() if k != "hmac_key"}
        return LocalDirStore(self.root / name, self.max_bytes, hmac_key=self.auth, **opts)

    def describe(self) -> str:
        return f"LocalDirStore({self.root})"

    def path_of(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    # -- primitives -----------------------------------------------------------------------------
    def _read(self, key: str, offset: int, length: int | None) -> bytes | None:
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            self._drop_row(key)
            return None
        try:
            if length is None:
                length = max(0, os.fstat(fd).st_size - offset)
            parts = []
            got = 0
            while got < length:
                b = os.pread(fd, length - got, offset + got)
                if not b:
                    break  # end of file: the caller sees a short read (truncated blob)
                parts.append(b)
                got += len(b)
        finally:
            os.close(fd)
        self._note_access(key)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _write(self, key: str, blob: bytes, overwrite: bool) -> bool:
        path = self.path_of(key)
        if not overwrite and path.exists():
            self._index_row(key, path.stat().st_size)  # adopt a blob whose index row was lost
            return False
        path.parent.mkdir(mode=0o700, exist_ok=True)
        # the writer's pid in the name lets a later start-up remove the leftovers of a killed writer
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.{os.getpid()}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self.fsync:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._index_row(key, len(blob), replace=True)
        if self.max_bytes is not None:
            self._evict(protect=key)
        return True

    def _exists(self, key: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM chunks WHERE key=?", (key,)).fetchone() is not None

    def _delete(self, key: str) -> bool:
        try:
            os.unlink(self.path_of(key))
            removed = True
        except FileNotFoundError:
            removed = False
        return self._drop_row(key) or removed

    def _keys(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT key FROM chunks ORDER BY created")]

    def _nbytes(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM chunks").fetchone()[0])

    def _close(self) -> None:
        with self._lock:
            if self._db is None:
                return
            try:
                self._flush_access()
            except sqlite3.Error as e:
                log.warning("%s: could not save access times on close: %s", self.describe(), e)
            self._db.close()
            self._db = None

    # -- index ----------------------------------------------------------------------------------
    def rebuild_index(self) -> int:
        """Re-create the index from the blobs on disk (reads headers only); returns the blob count."""
        rows = []
        for path in self.root.glob(f"??/*{SUFFIX}"):
            key = path.name[: -len(SUFFIX)]
            try:
                with open(path, "rb") as f:
                    head = f.read(blobfmt.HEAD_READ_SIZE)
                    size = blobfmt.header_size(head)
                    if size > len(head):
                        head += f.read(size - len(head))
                hdr = blobfmt.parse_header(head, self.auth)
                if hdr.key != key:
                    raise blobfmt.BlobError("header key differs from file name")
            except (OSError, blobfmt.BlobError) as e:
                log.warning(
                    "%s: skipping unreadable blob %s while rebuilding the index: %s", self.describe(), path, e
                )
                continue
            st = path.stat()
            rows.append((key, st.st_size, hdr.created or st.st_mtime, st.st_mtime))
        self._clean_tmp()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            with self._db:  # commits, or rolls back on an exception
                self._db.execute("DELETE FROM chunks")
                self._db.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?)", rows)
        return len(rows)

    def _clean_tmp(self) -> int:
        """Remove temp files of writers that died mid-write: their pid is gone (this host), or they are
        over an hour old (another host's, or named before the pid was in the name)."""
        n = 0
        for tmp in self.root.glob("??/.*.tmp"):
            parts = tmp.name.split(".")  # "", key16, pid, random + "tmp"
            pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
            try:
                if (pid is not None and pid != os.getpid() and not _alive(pid)) or (
                    time.time() - tmp.stat().st_mtime > 3600
                ):
                    tmp.unlink()
                    n += 1
            except OSError:
                pass
        if n:
            log.info("%s: removed %d temp file(s) of interrupted writes", self.describe(), n)
        return n

    def _index_row(self, key: str, nbytes: int, replace: bool = False) -> None:
        now = time.time()
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        with self._lock:
            self._db.execute(f"{verb} INTO chunks VALUES (?, ?, ?, ?)", (key, nbytes, now, now))

    def _drop_row(self, key: str) -> bool:
        with self._lock:
            self._pending_access.pop(key, None)
            return self._db.execute("DELETE FROM chunks WHERE key=?", (key,)).rowcount > 0

    def _note_access(self, key: str) -> None:
        with self._lock:
            self._pending_access[key] = time.time()
            if time.monotonic() - self._last_flush >= self.access_flush_s:
                self._flush_access()

    def _flush_access(self) -> None:
        with self._lock:
            self._last_flush = time.monotonic()
            if not self._pending_access:
                return
            rows = [(t, k) for k, t in self._pending_access.items()]
            self._pending_access.clear()
            self._db.executemany("UPDATE chunks SET last_access=MAX(last_access, ?) WHERE key=?", rows)

    def _evict(self, protect: str) -> None:
        """Delete least recently accessed blobs until the directory fits ``max_bytes``; blobs the owner
        pins (:attr:`pinned`) are kept, and when only pinned KV is left over the bound the blob just
        written (``protect``) is removed again and :class:`StoreFullError` raised (never silent loss)."""
        with self._lock:
            self._flush_access()
            total = self._nbytes()
            if total <= self.max_bytes:
                return
            rows = self._db.execute(
                "SELECT key, nbytes FROM chunks WHERE key != ? ORDER BY last_access", (protect,)
            ).fetchall()
            for key, n in rows:
                if total <= self.max_bytes:
                    return
                if self.pinned is not None and self.pinned(key):
                    continue
                self._delete(key)
                self._forget(key)
                self._count("evictions")
                total -= n
            if total > self.max_bytes:
                self._delete(protect)
                self._forget(protect)
                raise StoreFullError(
                    f"{self.describe()} is full: {total} bytes of referenced KV exceed max_bytes="
                    f"{self.max_bytes}; chunk {protect[:16]} was not stored (it will be recomputed when "
                    "used). Raise the store's max_bytes or delete documents."
                )


def _alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
