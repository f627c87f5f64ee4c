"""Issue 24, item 4: quotas. Per-document and per-collection token and stored-KV-byte limits, checked
before an ingest writes anything (413 / 429 in the service), usage per collection, and a full disk
after a commit that succeeded is not an error.

Real parts only: the tiny model, the real embedder, SQLite + FAISS indexes and file stores on disk,
and the service's app (``create_app``) over a RAG built from its settings (``build_rag``).
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading

import numpy as np
import pytest

from ragkv.rag import RAG, ChunkIndex, Document, QuotaExceededError, Quotas
from ragkv.rag.quotas import DEFAULT_MAX_DOCUMENT_TOKENS, measure_kv_bytes_per_token
from ragkv.testing import document_tokens, fill_index_disk, free_index_disk
from tests.helpers import musique_samples, stories_model


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [c["text"] for s in musique_samples(4) for c in s["ctxs"]]


def _rag(path, embedder, quotas: Quotas | None = None, **kw) -> RAG:
    kw.setdefault("store", f"file://{path / 'kv'}?codec=raw")
    return RAG(stories_model(), path, embedder=embedder, chunk_tokens=32, quotas=quotas, **kw)


def _state(rag: RAG) -> dict:
    """Everything an ingest could leave behind: documents and chunks of every collection, stored KV
    blobs, write-ahead intents, KV computed so far."""
    return {
        "docs": {c: rag.list_documents(c) for c in ("default", "t", "u")},
        "chunks": len(rag.index),
        "blobs": sorted(rag.store.keys()),
        "intents": rag.index.intents(),
        "computed": rag.counters.get("computed", 0),
        "usage": {c: rag.usage(c) for c in ("default", "t", "u")},
    }


# ---- the library ----------------------------------------------------------------------------------------
def test_quotas_are_checked_and_default_to_a_document_bound():
    q = Quotas()
    assert q.max_document_tokens == DEFAULT_MAX_DOCUMENT_TOKENS == 131_072
    assert q.max_collection_tokens is None and q.max_collection_kv_bytes is None
    assert not q.limits_collections and Quotas(max_collection_kv_bytes=1).limits_collections
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ValueError):
            Quotas(max_collection_tokens=bad)
    assert Quotas(max_document_tokens=None).max_document_tokens is None


@pytest.mark.slow  # a RAG over the tiny model: several ingests
def test_a_document_over_its_quota_refuses_the_whole_call_and_writes_nothing(tmp_path, embedder, texts):
    """One document over ``max_document_tokens`` among others that fit: 413-kind refusal naming it,
    and nothing of the call is written: no chunk, no blob, no intent, no KV even computed."""
    rag = _rag(tmp_path, embedder, Quotas(max_document_tokens=150))
    rag.ingest([Document(texts[0][:200], "kept")], show_progress=False, collection="t")
    before = _state(rag)
    big = texts[1][:400]
    fits, after = texts[2][:200], texts[3][:200]
    assert document_tokens(rag, big) > 150 >= max(document_tokens(rag, fits), document_tokens(rag, after))
    with pytest.raises(QuotaExceededError) as ei:
        rag.ingest(
            [Document(fits, "fits"), Document(big, "big"), Document(after, "after")],
            show_progress=False,
            collection="t",
        )
    e = ei.value
    assert (e.status, e.limit, e.value, e.document, e.collection) == (
        413,
        "max_document_tokens",
        150,
        "big",
        "t",
    )
    assert (
        e.requested == document_tokens(rag, big)
        and "'big'" in str(e)
        and "max_document_tokens (150)" in str(e)
    )
    assert e.details() == {
        "limit": "max_document_tokens",
        "limit_value": 150,
        "requested": e.requested,
        "collection": "t",
        "document": "big",
    }
    assert _state(rag) == before
    assert rag.quota_refusals == {"max_document_tokens": 1}
    rag.quotas = Quotas(max_document_tokens=None)  # unlimited: the same call goes through
    rep = rag.ingest([Document(big, "big")], show_progress=False, collection="t")
    assert rep.documents_added == 1 and rag.usage("t").tokens == before["usage"]["t"].tokens + e.requested
    rag.close()


@pytest.mark.slow  # a RAG over the tiny model: several ingests
def test_collection_token_quota_counts_a_replacement_once_and_collections_apart(tmp_path, embedder, texts):
    rag = _rag(tmp_path, embedder)
    a, b = texts[0][:300], texts[1][:300]
    ta, tb = document_tokens(rag, a), document_tokens(rag, b)
    rag.ingest([Document(a, "a")], show_progress=False, collection="t")
    assert rag.usage("t").tokens == ta and rag.usage("t").documents == 1
    limit = ta + tb - 1
    rag.quotas = Quotas(max_collection_tokens=limit)
    before = _state(rag)
    with pytest.raises(QuotaExceededError) as ei:
        rag.ingest([Document(b, "b")], show_progress=False, collection="t")
    e = ei.value
    assert (e.status, e.limit, e.value, e.usage, e.requested) == (
        429,
        "max_collection_tokens",
        limit,
        ta,
        ta + tb,
    )
    assert f"now {ta:,}" in str(e) and f"({limit:,})" in str(e) and "'t'" in str(e)
    assert _state(rag) == before  # nothing written, nothing computed

    # another collection has its own usage
    assert rag.ingest([Document(b, "b")], show_progress=False, collection="u").documents_added == 1
    assert rag.usage("u").tokens == tb and rag.usage("t").tokens == ta

    # replacing "a" with a text about as long: old + new would be over the limit, the result is not
    a2 = texts[2][:300]
    ta2 = document_tokens(rag, a2)
    assert ta + ta2 > limit >= ta2
    rep = rag.ingest([Document(a2, "a")], show_progress=False, collection="t")
    assert rep.documents_added == 1 and rag.usage("t").tokens == ta2 and rag.usage("t").documents == 1

    # a limit lowered below the usage: a shrinking replacement passes, a growing one does not
    rag.quotas = Quotas(max_collection_tokens=ta2 // 2)
    shorter = a2[: len(a2) * 2 // 3]
    assert ta2 // 2 < document_tokens(rag, shorter) < ta2
    rag.ingest([Document(shorter, "a")], show_progress=False, collection="t")
    with pytest.raises(QuotaExceededError):
        rag.ingest([Document(a2, "a")], show_progress=False, collection="t")
    # a delete always goes, and frees the room
    rag.delete_document("a", "t")
    assert rag.usage("t").tokens == 0 and rag.usage("t").chunks == 0
    rag.quotas = Quotas(max_collection_tokens=limit)
    assert rag.ingest([Document(b, "b")], show_progress=False, collection="t").documents_added == 1
    assert rag.quota_refusals == {"max_collection_tokens": 2}
    rag.close()


@pytest.mark.slow  # a RAG over the tiny model: several ingests
def test_collection_kv_bytes_quota_counts_a_shared_chunk_once(tmp_path, embedder, texts):
    """Stored KV bytes: a collection's distinct chunk keys x bytes per token. The same text under a
    second id shares every blob: tokens double, KV bytes do not, so it passes a KV limit already met."""
    per = 1000
    rag = _rag(tmp_path, embedder, Quotas(kv_bytes_per_token=per))
    x = texts[0][:300]
    tx = document_tokens(rag, x)
    rag.ingest([Document(x, "x")], show_progress=False, collection="t")
    assert rag.usage("t").kv_bytes == tx * per
    rag.quotas = Quotas(max_collection_kv_bytes=tx * per, kv_bytes_per_token=per)
    rep = rag.ingest([Document(x, "x-again")], show_progress=False, collection="t")
    u = rag.usage("t")
    assert rep.documents_added == 1 and (u.tokens, u.kv_tokens, u.kv_bytes) == (2 * tx, tx, tx * per)
    before = _state(rag)
    z = texts[1][:200]
    with pytest.raises(QuotaExceededError) as ei:
        rag.ingest([Document(z, "z")], show_progress=False, collection="t")
    e = ei.value
    assert (e.status, e.limit, e.usage) == (429, "max_collection_kv_bytes", tx * per)
    assert e.requested == (tx + document_tokens(rag, z)) * per and "bytes of stored KV" in str(e)
    assert _state(rag) == before
    # deleting one of the two sharers frees no KV bytes; deleting both does
    rag.delete_document("x", "t")
    assert rag.usage("t").kv_bytes == tx * per
    rag.delete_document("x-again", "t")
    assert rag.usage("t").kv_bytes == 0
    rag.close()


def test_kept_counts_match_the_chunk_table_through_random_changes(tmp_path):
    """The per-collection counts a ChunkIndex keeps (commits and deletes update them) and the counts
    it predicts for a commit (``usage_after``) equal a fresh count of the chunk table, through random
    adds, replacements and deletes across collections sharing KV keys."""
    dim = 8
    idx = ChunkIndex(tmp_path / "index", dim)
    rng = random.Random(4)
    colls = ["a", "b"]
    for c in colls:  # nothing there: zeros, and nothing kept (any name may be asked for)
        assert idx.usage(c).chunks == 0 and c not in idx._usage

    def doc_chunks(n: int):
        out = []
        for seq in range(n):
            k = rng.randrange(12)  # a small key space: keys repeat inside and across collections
            out.append((seq, f"text {k}", list(range(k + 1)), f"key-{k}"))
        return out

    for step in range(60):
        coll = rng.choice(colls)
        ids = idx.document_ids(coll)
        if ids and rng.random() < 0.25:
            idx.delete_document(rng.choice(ids), coll)
        else:
            doc_id = rng.choice(ids) if ids and rng.random() < 0.5 else f"d{step}"
            chunks = doc_chunks(rng.randrange(1, 5))
            predicted = idx.usage_after(coll, [doc_id], [(c[3], len(c[2])) for c in chunks])
            vecs = np.random.default_rng(step).standard_normal((len(chunks), dim)).astype(np.float32)
            idx.add_document(doc_id, f"sha-{step}", {}, chunks, vecs, coll)
            assert idx.usage(coll) == predicted, step
        for c in colls:
            assert idx.usage(c) == idx._count(c), (step, c)
    assert idx.usage("a").kv_tokens < idx.usage("a").tokens  # keys did repeat
    idx.close()


@pytest.mark.slow  # a RAG over the tiny model: several ingests
def test_measured_kv_bytes_per_token_is_what_stored_chunks_take(tmp_path, embedder, texts):
    """The measured bytes per token: what a full chunk's blob takes, per token, with the raw codec
    (fixed width: to the byte, but for the header's digits) and the default stepz (entropy coded: close)."""
    model = stories_model()
    for codec, tol in (("raw", 0.01), ("stepz", 0.15)):
        d = tmp_path / codec
        rag = _rag(d, embedder, store=f"file://{d / 'kv'}?codec={codec}")
        per = rag.kv_bytes_per_token()
        assert per == measure_kv_bytes_per_token(model, rag.store, 32)
        rag.ingest([Document(texts[0][:600], "d")], show_progress=False)
        full = [r for r in rag.index.chunks_of("d") if len(r.token_ids) >= 30]
        assert len(full) >= 3
        for r in full:
            actual = rag.store.header(r.kv_key).total_size / len(r.token_ids)
            assert abs(actual - per) <= tol * per, (codec, actual, per)
        u = rag.usage()
        assert u.kv_bytes == u.kv_tokens * per and u.kv_tokens == u.tokens
        rag.close()
    geom = model.config
    raw_values = 2 * geom.num_layers * geom.num_kv_heads * geom.head_dim * 4
    assert measure_kv_bytes_per_token(model, object(), 32) == raw_values  # no codec: in-memory size


def test_a_full_disk_after_the_commit_is_not_an_error(tmp_path, embedder, texts, monkeypatch):
    """The commit succeeded; then the FAISS snapshot write meets ENOSPC (the kernel's: its temporary
    file is a link to /dev/full) and deleting replaced KV meets a full SQLite: the ingest still returns
    its report (the service: 200, not a 500), the documents are listed and retrievable, no
    half-written snapshot is left, and the next commit catches up."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    rag = _rag(tmp_path, embedder)
    rag.ingest([Document(texts[0][:150], "a")], show_progress=False)
    rag.index.snapshot_every = 1
    tmp = rag.index._faiss_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.symlink_to("/dev/full")

    def disk_full(*_):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(rag.index, "settle_intents", disk_full)
    rep = rag.ingest([Document(texts[1][:150], "a"), Document(texts[2][:150], "b")], show_progress=False)
    monkeypatch.undo()
    assert rep.documents_added == 2 and rag.list_documents() == ["a", "b"]
    assert not tmp.exists() and not tmp.is_symlink() and not list(rag.index.dir.glob("*.tmp"))
    assert rag.index.intents()  # the replaced chunks' KV: still listed, deleted next time
    assert rag.retrieve(texts[2][:100], 1)[0].doc_id == "b"
    rag.ingest([Document(texts[3][:100], "c")], show_progress=False)
    assert rag.index.intents() == [] and rag.index._faiss_path.exists()
    rag.close()


def test_a_full_disk_during_the_commit_rolls_back_whole_and_loses_nothing(tmp_path, embedder, texts):
    """The index's SQLite meets a full disk inside the commit: the ingest raises IndexFullError (an
    OSError with ENOSPC) after rolling back, the documents already there stay listed and retrievable,
    the KV the failed ingest stored is deleted (no orphan), and once space is freed the same ingest
    succeeds. (Before: SQLite's own rollback made the ROLLBACK fail and mask the error; a 500.)"""
    import errno

    from ragkv.rag import IndexFullError

    rag = _rag(tmp_path, embedder)
    rag.ingest([Document(texts[0][:150], "a")], show_progress=False)
    before = _state(rag)
    fill_index_disk(rag.index)
    with pytest.raises(IndexFullError) as e:
        rag.ingest([Document(texts[1] * 3, "b")], show_progress=False)
    assert e.value.errno == errno.ENOSPC and "nothing of this change was committed" in str(e.value)
    assert rag.list_documents() == ["a"] and len(rag.index) == before["chunks"]
    assert sorted(rag.store.keys()) == before["blobs"]  # the failed ingest's KV: settled, not orphaned
    assert rag.retrieve(texts[0][:100], 1)[0].doc_id == "a"
    free_index_disk(rag.index)
    rep = rag.ingest([Document(texts[1] * 3, "b")], show_progress=False)
    assert rep.documents_added == 1 and rag.list_documents() == ["a", "b"]
    assert rag.index.intents() == [] and all(rag.index.references(k) for k in rag.store.keys())
    rag.close()


# ---- the service -----------------------------------------------------------------------------------------
