"""Issue 24, item 1: collections. Documents, chunks, retrieval and the stored KV a request may reuse
belong to a collection; a key limited to collections never sees another's documents, chunks or KV.

Real parts only: SQLite + FAISS indexes on disk, the tiny model and the real embedder, and a live
``python -m ragkv_server.server`` on loopback for the service tests.
"""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from ragkv.rag import RAG, ChunkIndex, Document
from ragkv.rag.collections import DEFAULT_COLLECTION, InvalidCollectionError, collection_name
from tests.helpers import musique_samples, stories_model

DIM = 8


def _vecs(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _chunks(tag: str, n: int) -> list[tuple[int, str, list[int], str]]:
    return [(i, f"{tag} chunk {i}", [i + 1, i + 2], f"{tag}-key-{i}") for i in range(n)]


# ---- the library ------------------------------------------------------------------------------------
def test_collection_names_are_checked_in_one_place():
    assert collection_name(None) == DEFAULT_COLLECTION == "default"
    assert collection_name("team-a.v2_1") == "team-a.v2_1"
    for bad in ("", "a b", "a/b", "../x", "x" * 65, "é", "a,b", 3):
        with pytest.raises(InvalidCollectionError):
            collection_name(bad)


#: the chunk table layout of every release before collections
OLD_SCHEMA = """
CREATE TABLE documents (doc_id TEXT PRIMARY KEY, text_sha TEXT NOT NULL, metadata TEXT NOT NULL);
CREATE TABLE chunks (
  chunk_id INTEGER PRIMARY KEY AUTOINCREMENT, doc_id TEXT NOT NULL, seq INTEGER NOT NULL, text TEXT NOT NULL,
  token_ids BLOB NOT NULL, kv_key TEXT NOT NULL, vector BLOB, UNIQUE(doc_id, seq));
CREATE INDEX chunks_kv ON chunks(kv_key);
CREATE INDEX documents_sha ON documents(text_sha);
CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE kv_intents (kv_key TEXT PRIMARY KEY);
"""


def test_an_old_data_folder_opens_with_its_documents_in_the_default_collection(tmp_path):
    """A folder written before collections (old tables, no FAISS snapshot) opens: its documents are
    the default collection's, searchable, and chunk ids are never reused (the id sequence is kept)."""
    d = tmp_path / "index"
    d.mkdir()
    db = sqlite3.connect(d / "chunks.sqlite")
    db.executescript(OLD_SCHEMA)
    vecs = _vecs(4, 0)
    for doc, rows in (("a", [(0, 0), (1, 1), (2, 2)]), ("b", [(0, 3)])):
        db.execute("INSERT INTO documents VALUES (?, ?, ?)", (doc, f"sha-{doc}", json.dumps({"t": doc})))
        for seq, i in rows:
            tokens = np.asarray([i, i + 1], dtype=np.int32).tobytes()
            db.execute(
                "INSERT INTO chunks (doc_id, seq, text, token_ids, kv_key, vector) VALUES (?, ?, ?, ?, ?, ?)",
                (doc, seq, f"{doc}{seq}", tokens, f"key-{i}", vecs[i].tobytes()),
            )
    db.execute(  # a chunk deleted later: its id (10) must never come back
        "INSERT INTO chunks (chunk_id, doc_id, seq, text, token_ids, kv_key) VALUES (10, 'gone', 0, '', x'', 'k')"
    )
    db.execute("DELETE FROM chunks WHERE chunk_id=10")
    db.commit()
    db.close()

    idx = ChunkIndex(d, DIM)
    assert idx.document_ids() == ["a", "b"] == idx.document_ids(DEFAULT_COLLECTION)
    assert idx.collections() == [DEFAULT_COLLECTION]
    assert idx.document_sha("a") == "sha-a" and len(idx) == 4 and idx.num_documents == 2
    rec = idx.chunk(1)
    assert (rec.doc_id, rec.collection, rec.metadata, rec.token_ids) == ("a", "default", {"t": "a"}, [0, 1])
    assert [r.chunk_id for r in idx.search(vecs[3], 1)] == [4]
    assert [r.chunk_id for r in idx.search(vecs[3], 1, DEFAULT_COLLECTION)] == [4]
    new = idx.add_document("c", "sha-c", {}, _chunks("c", 2), _vecs(2, 1))
    assert min(new) > 10
    same_id = idx.add_document("a", "sha-a2", {}, _chunks("a2", 1), _vecs(1, 2), collection="other")
    assert idx.chunks_of("a")[0].text == "a0" and idx.chunks_of("a", "other")[0].chunk_id == same_id[0]
    idx.close()
    again = ChunkIndex(d, DIM)  # reopened: migrated once, nothing lost
    assert again.document_ids() == ["a", "b", "c"] and again.document_ids("other") == ["a"]
    assert again.collections() == ["default", "other"]
    again.close()


def test_collections_partition_the_index(tmp_path):
    """Documents are (collection, id): the same id in two collections is two documents; search,
    chunk reads, deletes and key references stay inside the collection named."""
    idx = ChunkIndex(tmp_path / "index", DIM)
    va, vb = _vecs(3, 1), _vecs(3, 2)
    ids_a = idx.add_document("x", "sha-a", {}, _chunks("a", 3), va, collection="a")
    ids_b = idx.add_document("x", "sha-b", {}, _chunks("b", 3), vb, collection="b")
    assert idx.document_ids("a") == ["x"] == idx.document_ids("b") and idx.document_ids() == []
    for i, v in enumerate(vb):  # b's own vectors are the nearest, yet a search of a finds only a's
        hits = idx.search(v, 3, "a")
        assert {h.chunk_id for h in hits} == set(ids_a) and all(h.collection == "a" for h in hits)
        assert idx.search(v, 1, "b")[0].chunk_id == ids_b[i]
    assert {h.chunk_id for h in idx.search(vb[0], 6)} == set(ids_a + ids_b)  # no collection: all
    assert idx.search(va[0], 3, "nobody") == []
    assert idx.chunk(ids_b[0], "a") is None and idx.chunk(ids_b[0], "b").doc_id == "x"
    assert idx.referenced_keys(["a-key-0", "b-key-0", "zz"], "a") == {"a-key-0"}
    assert idx.references("b-key-1") and not idx.references("b-key-1", "a")
    with pytest.raises(KeyError):
        idx.delete_document("x", "nobody")
    idx.delete_document("x", "a")
    assert idx.document_ids("a") == [] and [r.chunk_id for r in idx.chunks_of("x", "b")] == ids_b
    assert idx.search(va[0], 3, "a") == [] and idx.collections() == ["b"]
    idx.close()


def test_rag_retrieves_reads_and_reuses_only_its_collection(tmp_path, embedder):
    """``RAG`` takes a collection everywhere: ingest, list, retrieve, chunk reads, delete, and the
    stored chunks reused from inside a question (another collection's stored KV is not reused, and an
    ingest of the same text into another collection computes it, so neither tells that it exists)."""
    rag = RAG(stories_model(), tmp_path / "data", embedder=embedder, chunk_tokens=48, top_k=3)
    ctxs = musique_samples(1)[0]["ctxs"]
    text_a, text_b = ctxs[0]["text"][:400], ctxs[1]["text"][:400]
    rep_b = rag.ingest([Document(text_b, "doc")], show_progress=False, collection="b")
    rep_a = rag.ingest([Document(text_a, "doc")], show_progress=False, collection="a")
    assert rep_a.documents_added == rep_b.documents_added == 1
    # the same text again, in a third collection: KV computed, not reported as "already stored"
    rep_c = rag.ingest([Document(text_b, "other")], show_progress=False, collection="c")
    assert rep_c.kv_already_stored == 0 and rep_c.kv_computed == rep_b.kv_computed > 0
    assert rag.list_documents("a") == ["doc"] == rag.list_documents("b") and rag.list_documents() == []
    a_ids = {r.chunk_id for r in rag.index.chunks_of("doc", "a")}
    b_ids = {r.chunk_id for r in rag.index.chunks_of("doc", "b")}
    assert {r.chunk_id for r in rag.retrieve(text_b[:200], 3, "a")} <= a_ids
    assert {r.chunk_id for r in rag.retrieve(text_b[:200], 3, "b")} <= b_ids
    with pytest.raises(KeyError):
        rag.chunks_by_id([min(b_ids)], "a")
    assert rag.chunks_by_id([min(b_ids)], "b")[0].text in text_b
    with pytest.raises(InvalidCollectionError):
        rag.retrieve("who?", 1, "no such/name")

    def reused(collection: str) -> int:
        ans = rag.answer(
            text_b[:300] + "\nWho?", chunks=[], max_new_tokens=1, collection=collection, mode="reuse"
        )
        return ans.stats.get("kv_hits", 0)

    assert reused("b") > 0 and reused("a") == 0
    with pytest.raises(KeyError):
        rag.delete_document("doc", "nobody")
    rag.delete_document("doc", "b")
    assert rag.list_documents("a") == ["doc"] and rag.list_documents("b") == []
    assert reused("b") == 0 and reused("c") > 0  # c's chunk of the same text keeps its KV
    rag.close()


def test_kv_another_process_stored_is_reused_by_ingest(tmp_path, embedder):
    """A store shared with another index (a second ragkv, a vLLM connector): KV that no collection of
    this index uses says nothing of its collections, so ingest reuses it. Before, every such chunk was
    recomputed (test_vllm_client's shared-store ingest reported kv_computed 13, not 0)."""
    text = musique_samples(1)[0]["ctxs"][0]["text"][:400]
    store = f"file://{tmp_path / 'kv'}?codec=raw"
    first = RAG(stories_model(), tmp_path / "one", store=store, embedder=embedder, chunk_tokens=48)
    assert first.ingest([Document(text, "doc")], show_progress=False).kv_computed > 0
    first.close()
    second = RAG(stories_model(), tmp_path / "two", store=store, embedder=embedder, chunk_tokens=48)
    rep = second.ingest([Document(text, "doc")], show_progress=False, collection="x")
    assert rep.kv_computed == 0 and rep.kv_already_stored > 0
    second.close()


# ---- the service: keys limited to collections --------------------------------------------------------
