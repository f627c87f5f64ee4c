"""Issue 24, item 1: collections. Documents, chunks, retrieval and the stored KV a request may reuse
belong to a collection; a key limited to collections never sees another's documents, chunks or KV.

Real parts only: SQLite + FAISS indexes on disk, the tiny model and the real embedder, and a live
``python -m ragkv_server.server`` on loopback for the service tests.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from pathlib import Path

import httpx
import numpy as np
import pytest

from ragkv.rag import RAG, ChunkIndex, Document
from ragkv.rag.collections import DEFAULT_COLLECTION, InvalidCollectionError, collection_name
from tests.helpers import bearer, musique_samples, stories_model
from tests.helpers_service import running_server

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
W_KEY = "write-all-0123456789abcdef"  # every collection
A_KEY = "write-a-0123456789abcdef"  # collection a only
B_KEY = "write-b-0123456789abcdef"  # collection b only
RA_KEY = "read-a-0123456789abcdef"  # read-only, collection a (and shared)
KEYS = {
    "RAGKV_API_KEYS": json.dumps(
        [W_KEY, {"key": A_KEY, "collections": ["a"]}, {"key": B_KEY, "collections": ["b"]}]
    ),
    "RAGKV_READ_API_KEYS": json.dumps([{"key": RA_KEY, "collections": ["a", "shared"]}]),
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A keyed server with documents in collections a and b (b's ids also used in a: the same names)."""
    root = tmp_path_factory.mktemp("collections")
    ctxs = [c for s in musique_samples(3) for c in s["ctxs"]]
    docs = {
        "a": [{"id": f"d{i}", "text": c["text"][:300]} for i, c in enumerate(ctxs[:6])],
        "b": [{"id": f"d{i}", "text": c["text"][:300]} for i, c in enumerate(ctxs[6:12])]
        + [{"id": f"b-only{i}", "text": c["text"][:300]} for i, c in enumerate(ctxs[12:14])],
    }
    with running_server(root, **KEYS) as base, httpx.Client(base_url=base, timeout=120) as c:
        chunks: dict[str, dict[str, list[int]]] = {"a": {}, "b": {}}
        for coll, key in (("a", A_KEY), ("b", W_KEY)):
            for lo in range(0, len(docs[coll]), 4):  # RAGKV_MAX_DOCUMENTS=4
                # A's key names no collection: its requests go to its first (and only) one
                headers = bearer(key) if key == A_KEY else bearer(key, coll)
                r = c.post("/v1/documents", json={"documents": docs[coll][lo : lo + 4]}, headers=headers)
                assert r.status_code == 200, r.text
                assert {d["status"] for d in r.json()["documents"]} == {"added"}
                chunks[coll].update({d["id"]: d["chunk_ids"] for d in r.json()["documents"]})
        yield c, docs, chunks, root / "data"


def _same_404(r: httpx.Response, ref: httpx.Response, ident: str, ref_ident: str) -> None:
    """``r`` is the 404 that an unknown id gets (``ref``), word for word once the ids are swapped."""
    assert r.status_code == ref.status_code == 404, r.text
    assert dict(r.headers).keys() == dict(ref.headers).keys()
    body, want = r.json()["error"], ref.json()["error"]
    assert body.pop("message").replace(ident, "ID") == want.pop("message").replace(ref_ident, "ID")
    assert body == want


def _kv_rows(data: Path, collection: str) -> list[tuple[str, list[int]]]:
    """(kv_key, token ids) of a collection's chunks, read from the server's index (read-only)."""
    db = sqlite3.connect(data / "index" / "chunks.sqlite")
    try:
        rows = db.execute("SELECT kv_key, token_ids FROM chunks WHERE collection=?", (collection,)).fetchall()
    finally:
        db.close()
    return [(k, np.frombuffer(t, dtype=np.int32).tolist()) for k, t in rows]


@pytest.mark.slow  # a live server
def test_a_key_limited_to_a_collection_never_sees_another(limited):
    """The goal: a key limited to collection a never gets b's documents, chunks, retrieval hits or KV,
    over many random ids. Another collection's id is 404 exactly as an unknown one (same body), and
    another collection's stored KV is never reused (not by reference, not found in the prompt)."""
    c, docs, chunks, data = limited
    rng = random.Random(24)
    a_ids = {i for ids in chunks["a"].values() for i in ids}
    b_ids = {i for ids in chunks["b"].values() for i in ids}
    assert a_ids and b_ids and not a_ids & b_ids
    top = max(a_ids | b_ids)
    unknown = top + 1000

    # documents: the listing is a's; b's ids, unknown ids and a's ids named in b are all 404
    assert c.get("/v1/documents", headers=bearer(A_KEY)).json()["ids"] == sorted(chunks["a"])
    assert c.get("/v1/documents", headers=bearer(RA_KEY)).json()["ids"] == sorted(chunks["a"])
    assert c.get("/v1/documents", headers=bearer(RA_KEY, "shared")).json() == {"ids": [], "total": 0}
    ref = c.delete("/v1/documents/never-was", headers=bearer(A_KEY))
    for doc_id in rng.sample(sorted(chunks["b"]), 4):
        if doc_id in chunks["a"]:
            continue  # d0..d5 are a's own documents too (another document under the same name)
        _same_404(c.delete(f"/v1/documents/{doc_id}", headers=bearer(A_KEY)), ref, doc_id, "never-was")
    assert set(c.get("/v1/documents", headers=bearer(B_KEY)).json()["ids"]) == set(chunks["b"])

    # chunk ids: many random ids of b, unknown ids and a's; on /v1/query and on chat
    ref_q = c.post("/v1/query", json={"question": "who?", "chunk_ids": [unknown]}, headers=bearer(A_KEY))
    chat = {"messages": [{"role": "user", "content": "who?"}], "max_tokens": 1}
    ref_c = c.post(
        "/v1/chat/completions", json={**chat, "ragkv": {"chunk_ids": [unknown]}}, headers=bearer(A_KEY)
    )
    probes = rng.sample(sorted(b_ids), min(24, len(b_ids))) + [
        rng.randrange(top + 1, 2**40) for _ in range(8)
    ]
    rng.shuffle(probes)
    for cid in probes:
        for key in (A_KEY, RA_KEY):
            r = c.post("/v1/query", json={"question": "who?", "chunk_ids": [cid]}, headers=bearer(key))
            _same_404(r, ref_q, str(cid), str(unknown))
        r = c.post(
            "/v1/chat/completions", json={**chat, "ragkv": {"chunk_ids": [cid]}}, headers=bearer(A_KEY)
        )
        _same_404(r, ref_c, str(cid), str(unknown))
    for cid in rng.sample(sorted(a_ids), 3):  # a's own chunks are read, with their text
        r = c.post(
            "/v1/query", json={"question": "who?", "chunk_ids": [cid], "max_tokens": 1}, headers=bearer(A_KEY)
        )
        assert r.status_code == 200 and [s["chunk_id"] for s in r.json()["sources"]] == [cid]

    # retrieval: questions made of b's texts retrieve a's chunks only
    for d in rng.sample(docs["b"], 5):
        r = c.post(
            "/v1/query",
            json={"question": d["text"][:200], "max_tokens": 1, "top_k": 3},
            headers=bearer(RA_KEY),
        )
        assert r.status_code == 200, r.text
        assert {s["chunk_id"] for s in r.json()["sources"]} <= a_ids
        r = c.post(
            "/v1/query",
            json={"question": d["text"][:200], "max_tokens": 1, "top_k": 3},
            headers=bearer(B_KEY),
        )
        assert {s["chunk_id"] for s in r.json()["sources"]} <= b_ids

    # stored KV: b's keys by reference (key only, and key + span) and b's text inside a prompt
    b_only = [kt for kt in _kv_rows(data, "b") if kt[0] not in {k for k, _ in _kv_rows(data, "a")}]
    for kv_key, toks in rng.sample(b_only, min(6, len(b_only))):
        for ref_kind in ("key", "span"):
            chunk = kv_key if ref_kind == "key" else {"key": kv_key, "start": 1, "length": len(toks)}
            body = {
                "prompt": [1, *toks, 5, 6],
                "max_tokens": 1,
                "kv_transfer_params": {"ragkv": {"chunks": [chunk], "mode": "blend"}},
            }
            seen = c.post("/v1/completions", json=body, headers=bearer(A_KEY)).json()["ragkv"]
            assert seen["kv_hits"] == 0 and seen["kv_misses"] == 1 and seen["num_reused_rows"] == 0, seen
            own = c.post("/v1/completions", json=body, headers=bearer(B_KEY)).json()["ragkv"]
            assert own["kv_hits"] == 1, own
            # an unlimited key reuses any stored chunk here, as a vLLM server with the plugin does
            assert c.post("/v1/completions", json=body, headers=bearer(W_KEY)).json()["ragkv"]["kv_hits"] == 1
        flat = {"prompt": [1, *toks, 5, 6], "max_tokens": 1}
        assert (
            c.post("/v1/completions", json=flat, headers=bearer(A_KEY)).json()["ragkv"].get("kv_hits", 0) == 0
        )
        assert c.post("/v1/completions", json=flat, headers=bearer(B_KEY)).json()["ragkv"]["kv_hits"] == 1
    text = docs["b"][-1]["text"]  # b-only: its text pasted into a chat question
    pasted = {
        "messages": [{"role": "user", "content": text + "\nWho?"}],
        "max_tokens": 1,
        "ragkv": {"retrieve": False},
    }
    r = c.post("/v1/chat/completions", json=pasted, headers=bearer(A_KEY))
    assert r.json()["ragkv"]["stats"].get("kv_hits", 0) == 0
    r = c.post("/v1/chat/completions", json=pasted, headers=bearer(B_KEY))
    assert r.json()["ragkv"]["stats"]["kv_hits"] > 0


@pytest.mark.slow  # a live server
def test_naming_a_collection_a_key_may_not_use_is_403_and_bad_names_422(limited):
    c, docs, chunks, _ = limited
    q = {"question": "who?", "max_tokens": 1}
    for method, path, body in [
        ("GET", "/v1/documents", None),
        ("POST", "/v1/query", q),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
        ("POST", "/v1/documents", {"documents": [{"id": "x", "text": "intruder"}]}),
        ("DELETE", "/v1/documents/d0", None),
    ]:
        for name in ("b", "default", "no-such-collection"):  # existing or not: the same 403
            r = c.request(method, path, json=body, headers=bearer(A_KEY, name))
            assert r.status_code == 403, (path, name, r.text)
        for bad in ("a b", "x" * 65, "../a", "a,b"):
            r = c.request(method, path, json=body, headers=bearer(W_KEY, bad))
            # OpenAI's routes answer a bad request 400, as OpenAI does; ragkv's own 422
            assert r.status_code == (400 if "completions" in path else 422), (path, bad, r.text)
            assert "X-Ragkv-Collection" in r.json()["error"]["message"]
    assert c.get("/v1/documents", headers=bearer(B_KEY)).json()["ids"] == sorted(chunks["b"])
    # the admin route spans every collection: unlimited write keys only
    assert c.post("/v1/admin/gc", json={}, headers=bearer(A_KEY)).status_code == 403
    assert c.post("/v1/admin/gc", json={}, headers=bearer(W_KEY)).status_code == 200
    # an unlimited key works in any collection; with no header, in the default one
    assert c.get("/v1/documents", headers=bearer(W_KEY, "a")).json()["ids"] == sorted(chunks["a"])
    assert c.get("/v1/documents", headers=bearer(W_KEY)).json() == {"ids": [], "total": 0}
    # a's document named like one of b's is its own: a re-ingest of it is "unchanged", b's untouched
    r = c.post("/v1/documents", json={"documents": docs["a"][:1]}, headers=bearer(A_KEY))
    assert r.json()["documents"][0]["status"] == "unchanged"
    assert r.json()["documents"][0]["chunk_ids"] == chunks["a"][docs["a"][0]["id"]]
    assert re.fullmatch(r"d\d", docs["a"][0]["id"]) and docs["a"][0]["id"] in chunks["b"]
