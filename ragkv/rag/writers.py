"""Several writers on one data folder: the protocol they obey.

A data folder (the index, and the default store under it) may be written by several processes at once:
services (``ragkv-server serve``), ``ragkv-server ingest``, the Ray pipeline's driver
(:mod:`ragkv.rag.distributed`) and its workers. What makes that safe:

* **Appends need no lock.** Chunk KV and tree pages are content-addressed and written whole (a key names
  one content; every read verifies digest, tokens and shape), so two writers storing one key store the
  same bytes. Index commits are SQLite transactions (``BEGIN IMMEDIATE``: SQLite serialises them; chunk
  ids are never reused), and a document is acknowledged once its commit returns.
* **Every writer holds the folder's lock shared** (``<data_dir>/.writer.lock``, a POSIX record lock) for
  as long as it writes: :class:`WriterLock`.
* **Deleting stored KV is what could hurt another writer** (its KV stored before its commit), so:
  write-ahead intents carry their writer's ``owner`` and a writer settles only its own; intents of
  writers that died, and garbage collection (every unreferenced blob), happen only **alone**: with the
  lock upgraded to exclusive (:meth:`WriterLock.alone`, non-blocking: while another writer runs it is
  refused, and ``gc`` says so). KV stored by the Ray pipeline's workers before the driver commits is
  therefore safe from every other writer while the driver lives.
* **Other writers' commits are seen after a refresh** (:meth:`ragkv.rag.corpus.Corpus.refresh`; the
  service's ``POST /v1/admin/reload``), which reconciles the in-memory FAISS index with SQLite.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".writer.lock"

#: the lock each data folder's writer holds in this process (resolved path -> lock)
_HELD: dict[Path, WriterLock] = {}
_HELD_LOCK = threading.Lock()


class DataDirBusy(ValueError):
    """The data folder cannot be written now: a process holds it alone (a garbage collection), or an
    operation that needs it alone met other writers. The message says which and what to do."""


class WriterLock:
    """This process's registration as a writer of ``data_dir`` (shared; see the module doc).
    ``owner``: the token its write-ahead intents carry. Close it (or exit) to leave."""

    def __init__(self, data_dir: str | os.PathLike):
        self.dir = Path(data_dir).resolve()
        self.path = self.dir / LOCK_FILE
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._mutex = threading.Lock()
        self._file = open(self.path, "a+")  # noqa: SIM115 - the lock lives as long as the file is open
        try:
            fcntl.lockf(self._file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            self._file.close()
            raise DataDirBusy(
                f"{self.dir} is held alone by another process (a garbage collection, `ragkv-server gc`); "
                "retry when it ends"
            ) from None
        with _HELD_LOCK:
            _HELD[self.dir] = self

    @contextmanager
    def alone(self) -> Iterator[bool]:
        """Hold the folder exclusively for the block if no other process writes to it (yields True), else
        yield False at once; shared again after. For what would hurt another writer: garbage collection,
        settling intents of writers that died."""
        with self._mutex:
            try:
                fcntl.lockf(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another writer: this process keeps its shared lock (POSIX: unchanged)
                yield False
                return
            try:
                yield True
            finally:
                fcntl.lockf(self._file.fileno(), fcntl.LOCK_SH)  # a downgrade: never blocks

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Stop being a writer of the folder (the lock is released)."""
        with _HELD_LOCK:
            if _HELD.get(self.dir) is self:
                del _HELD[self.dir]
        if not self._file.closed:
            self._file.close()


def held(data_dir: str | os.PathLike) -> WriterLock | None:
    """The writer lock this process holds on ``data_dir`` (None: it holds none: a library RAG, alone
    by the caller's word)."""
    with _HELD_LOCK:
        lock = _HELD.get(Path(data_dir).resolve())
    return lock if lock is not None and not lock.closed else None
