"""Collections through the service: a key limited to collections never sees another's documents, chunks,
retrieval hits or KV; naming a collection a key may not use is 403, a bad name 422. The library's
collections: tests/unit/rag/test_collections.py."""

from __future__ import annotations

import json
import random
import re
import sqlite3
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers_service import running_server

from ragkv.testing import bearer, musique_samples

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
