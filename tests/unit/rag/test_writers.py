"""Several writers on one data folder (ragkv.rag.writers): the shared lock, intents owned by their writer,
garbage collection only alone, and a refresh that takes in another writer's commits."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest

from ragkv.rag import writers
from ragkv.rag.index import ChunkIndex, PendingDocument
from ragkv.rag.writers import DataDirBusy, WriterLock

HOLD = """
import sys, time
from ragkv.rag.writers import WriterLock
lock = WriterLock(sys.argv[1])
if sys.argv[2] == "alone":
    with lock.alone() as alone:
        print("alone" if alone else "shared", flush=True)
        time.sleep(120)
print("shared", flush=True)
time.sleep(120)
"""


@contextmanager
def other_writer(folder, mode: str = "shared"):
    """Another process registered as a writer of ``folder`` (``mode="alone"``: holding it exclusively)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), mode], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == mode
        yield p
    finally:
        p.kill()
        p.wait(timeout=30)


def test_writers_share_the_folder_and_only_one_alone_collects(tmp_path):
    mine = WriterLock(tmp_path)
    assert writers.held(tmp_path) is mine and mine.owner
    with mine.alone() as alone:
        assert alone  # no other writer
    with other_writer(tmp_path):  # a second writer registers beside this one
        with mine.alone() as alone:
            assert not alone
        with mine.alone() as alone:  # still registered (a refused upgrade keeps the shared lock)
            assert not alone
    with mine.alone() as alone:
        assert alone  # the other one is gone
    mine.close()
    assert writers.held(tmp_path) is None
    with other_writer(tmp_path, "alone"), pytest.raises(DataDirBusy, match="held alone"):
        WriterLock(tmp_path)  # a process collecting garbage holds the folder alone: no writer joins


def _doc(doc_id: str, keys: list[str], dim: int = 4) -> PendingDocument:
    chunks = [(i, f"text {doc_id} {i}", [1, 2, 3], k) for i, k in enumerate(keys)]
    vecs = np.eye(dim, dtype=np.float32)[: len(keys)]
    return PendingDocument(doc_id, f"sha-{doc_id}", {}, chunks, vecs)


def test_intents_belong_to_their_writer(tmp_path):
    """A writer settles only its own intents, and keeps KV another writer's intent still covers; alone,
    it settles every writer's (those of writers that died)."""
    a, b = ChunkIndex(tmp_path, 4), ChunkIndex(tmp_path, 4)
    a.owner, b.owner = "a", "b"
    a.add_intents(["k1", "shared"])
    b.add_intents(["k2", "shared"])
    deleted: list[str] = []
    assert b.settle_intents(deleted.append, everyone=False) == 1
    assert deleted == ["k2"]  # "shared" is still a's intent: kept
    assert a.intents() == ["k1", "shared"] and a.intents("a") == ["k1", "shared"] and a.intents("b") == []
    b.commit([_doc("d", ["k1"])])  # committed: referenced, no writer's intent any more
    assert a.intents() == ["shared"]
    assert a.settle_intents(deleted.append, everyone=True) == 1 and deleted == ["k2", "shared"]
    assert a.intents() == []
    a.close()
    b.close()


def test_old_intents_are_migrated(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "chunks.sqlite")
    db.executescript(
        "CREATE TABLE kv_intents (kv_key TEXT PRIMARY KEY); INSERT INTO kv_intents VALUES ('old');"
    )
    db.close()
    idx = ChunkIndex(tmp_path, 4)
    assert idx.intents() == ["old"] and idx.intents("") == ["old"]
    idx.owner = "x"
    idx.add_intents(["old"])  # another owner's intent on the same key is its own row
    assert idx.intents() == ["old"] and idx.intents("x") == ["old"]
    idx.close()


def test_refresh_takes_in_another_writers_commits_and_deletes(tmp_path):
    served, other = ChunkIndex(tmp_path, 4), ChunkIndex(tmp_path, 4)
    other.commit([_doc("d1", ["k1", "k2"]), _doc("d2", ["k3"])])
    assert len(served) == 0 and served.search(np.eye(4, dtype=np.float32)[0], 3) == []
    assert served.refresh() == {"added": 3, "removed": 0}
    assert len(served) == 3 and served.num_documents == 2 and served.collections() == ["default"]
    assert served.search(np.eye(4, dtype=np.float32)[1], 1)[0].kv_key == "k2"
    assert served.usage().chunks == 3
    other.delete_document("d1")
    assert served.refresh() == {"added": 0, "removed": 2}
    assert len(served) == 1 and served.num_documents == 1 and served.usage().chunks == 1
    assert [r.kv_key for r in served.search(np.eye(4, dtype=np.float32)[0], 3)] == ["k3"]
    assert served.refresh() == {"added": 0, "removed": 0}
    served.close()
    other.close()


def test_garbage_collection_waits_until_a_writer_is_alone(tmp_path, embedder, one_thread):
    """KV another writer stored before its commit is not garbage: with another writer on the folder,
    ``collect_garbage`` is refused (and skipped on open); alone, it runs."""
    from ragkv.llm import LLM
    from ragkv.rag import RAG
    from ragkv.testing import stories_model

    lock = WriterLock(tmp_path)
    with other_writer(tmp_path):
        rag = RAG(
            LLM(stories_model()), tmp_path, embedder=embedder, chunk_tokens=64, collect_garbage_on_open=True
        )
        assert rag.index.owner == lock.owner
        with pytest.raises(DataDirBusy, match="other writers"):
            rag.collect_garbage()
    assert rag.collect_garbage()["deleted"] == 0
    rag.close()
    lock.close()
