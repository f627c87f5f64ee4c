"""Quotas through the service (issue 24, item 4): 413 / 429 ``quota_exceeded`` before an ingest writes
anything, usage per collection, 507 on a full index disk that leaves the service serving, and the
settings that name the quotas. The library's quotas: tests/unit/rag/test_quotas.py."""

from __future__ import annotations

import json

import pytest
from helpers_service import metric, tiny_settings

from ragkv.rag import RAG, Quotas
from ragkv.testing import (
    bearer,
    document_tokens,
    fill_index_disk,
    free_index_disk,
    musique_samples,
    stories_model,
)

W_KEY = "write-all-0123456789abcdef"  # every collection
A_KEY = "write-a-0123456789abcdef"  # collection a only
RB_KEY = "read-b-0123456789abcdef"  # read-only, collection b only


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [c["text"] for s in musique_samples(4) for c in s["ctxs"]]


def test_the_service_answers_507_on_a_full_index_disk_and_keeps_serving(tmp_path, embedder, texts):
    """Through the app: an ingest (or a delete) whose index write meets a full disk is 507
    ``insufficient_storage`` with no internal path in the body; the documents already there are
    still listed and answered; the same request succeeds once space is freed."""
    from fastapi.testclient import TestClient

    from ragkv_server.config import Settings
    from ragkv_server.server import create_app
    from ragkv_server.service import Service

    store = f"file://{tmp_path / 'kv'}?codec=raw"
    rag = RAG(stories_model(), tmp_path, embedder=embedder, chunk_tokens=32, store=store)
    s = Settings(max_new_tokens=2, allowed_hosts=["testserver"])
    svc = Service(s, rag)
    svc.start()
    c = TestClient(create_app(s, svc), base_url="http://testserver")
    try:
        assert (
            c.post("/v1/documents", json={"documents": [{"id": "a", "text": texts[0][:150]}]}).status_code
            == 200
        )
        fill_index_disk(rag.index)
        r = c.post("/v1/documents", json={"documents": [{"id": "b", "text": texts[1] * 3}]})
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["type"] == "insufficient_storage" and str(tmp_path) not in r.text
        assert c.get("/v1/documents").json()["ids"] == ["a"]
        r = c.post("/v1/query", json={"question": "What is the series?", "top_k": 1})
        assert r.status_code == 200 and r.json()["sources"][0]["doc_id"] == "a"
        free_index_disk(rag.index)
        r = c.post("/v1/documents", json={"documents": [{"id": "b", "text": texts[1] * 3}]})
        assert r.status_code == 200 and c.get("/v1/documents").json()["ids"] == ["a", "b"]
    finally:
        c.close()
        svc.close()
        rag.close()


def test_settings_name_the_quotas(monkeypatch):
    from ragkv_server.config import Settings, load_settings

    assert Settings().quotas() == Quotas()
    monkeypatch.setenv("RAGKV_MAX_DOCUMENT_TOKENS", "none")
    monkeypatch.setenv("RAGKV_MAX_COLLECTION_TOKENS", "5000000")
    monkeypatch.setenv("RAGKV_MAX_COLLECTION_KV_BYTES", "2GiB")
    q = load_settings().quotas()
    assert q == Quotas(None, 5_000_000, 2 << 30)
    monkeypatch.setenv("RAGKV_MAX_COLLECTION_TOKENS", "0")
    with pytest.raises(ValueError):
        load_settings()


def _quota_error(r, code: int) -> dict:
    """The error body of a quota refusal: status ``code``, ``quota_exceeded``, no Retry-After."""
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["type"] == "quota_exceeded" and err["code"] == code and "retry-after" not in r.headers
    return err


@pytest.mark.slow  # builds the service's RAG (model, embedder, stepz store) and ingests over HTTP
def test_the_service_refuses_over_quota_ingests_and_shows_usage_per_collection(tmp_path, texts):
    """Through the app: a document over ``max_document_tokens`` is 413 and a collection that would go
    over ``max_collection_tokens`` 429, both ``quota_exceeded`` with the limit, usage and request in
    ``details``, no ``Retry-After``, and nothing of the request written. ``GET
    /v1/collections/{name}/usage`` shows a collection's usage and limits, only to keys that may use it;
    ``/metrics`` counts refusals by limit (bounded labels: no collection names)."""
    from fastapi.testclient import TestClient

    from ragkv_server.server import create_app
    from ragkv_server.service import Service, build_rag

    s = tiny_settings(
        tmp_path / "data",
        max_document_tokens=150,
        max_collection_tokens=300,
        api_keys=[W_KEY, {"key": A_KEY, "collections": ["a"]}],
        read_api_keys=[{"key": RB_KEY, "collections": ["b"]}],
    )
    rag = build_rag(s)
    assert rag.quotas == Quotas(150, 300, None)
    svc = Service(s, rag)
    svc.start()
    c = TestClient(create_app(s, svc), base_url="http://testserver")
    try:
        d1, d2, d3 = texts[0][:200], texts[1][:200], texts[2][:200]
        t1, t2, t3 = (document_tokens(rag, t) for t in (d1, d2, d3))
        assert max(t1, t2, t3) <= 150 and t1 + t2 <= 300 < t1 + t2 + t3
        r = c.post("/v1/documents", json={"documents": [{"id": "d1", "text": d1}]}, headers=bearer(A_KEY))
        assert r.status_code == 200, r.text
        blobs = sorted(rag.store.keys())

        # a document over max_document_tokens, next to one that fits: 413, nothing ingested
        big = texts[3][:600]
        body = {"documents": [{"id": "d2", "text": d2}, {"id": "big", "text": big}]}
        r = c.post("/v1/documents", json=body, headers=bearer(A_KEY))
        err = _quota_error(r, 413)
        assert err["details"] == {
            "limit": "max_document_tokens",
            "limit_value": 150,
            "requested": document_tokens(rag, big),
            "collection": "a",
            "document": "big",
        }
        assert "max_document_tokens" in err["message"] and "nothing of this request" in err["message"]
        assert c.get("/v1/documents", headers=bearer(A_KEY)).json()["ids"] == ["d1"]
        assert sorted(rag.store.keys()) == blobs and rag.index.intents() == []

        # the collection's token quota: d2 fits, d3 would take it over (NDJSON upload: the same)
        r = c.post("/v1/documents", json={"documents": [{"id": "d2", "text": d2}]}, headers=bearer(A_KEY))
        assert r.status_code == 200, r.text
        blobs = sorted(rag.store.keys())
        ndjson = json.dumps({"id": "d3", "text": d3}) + "\n"
        r = c.post(
            "/v1/documents",
            content=ndjson,
            headers={**bearer(A_KEY), "Content-Type": "application/x-ndjson"},
        )
        err = _quota_error(r, 429)
        assert err["details"] == {
            "limit": "max_collection_tokens",
            "limit_value": 300,
            "requested": t1 + t2 + t3,
            "usage": t1 + t2,
            "collection": "a",
        }
        assert f"now {t1 + t2:,}" in err["message"] and "(300)" in err["message"]
        assert c.get("/v1/documents", headers=bearer(A_KEY)).json()["ids"] == ["d1", "d2"]
        assert sorted(rag.store.keys()) == blobs
        # another collection has room of its own
        r = c.post(
            "/v1/documents", json={"documents": [{"id": "d3", "text": d3}]}, headers=bearer(W_KEY, "b")
        )
        assert r.status_code == 200, r.text

        # usage: the collection's own numbers, only to keys that may use it
        r = c.get("/v1/collections/a/usage", headers=bearer(A_KEY))
        assert r.status_code == 200, r.text
        u, want = r.json(), rag.usage("a")
        assert u == {
            "collection": "a",
            "documents": 2,
            "chunks": want.chunks,
            "tokens": t1 + t2,
            "kv_bytes": (t1 + t2) * want.kv_bytes_per_token,
            "kv_bytes_per_token": want.kv_bytes_per_token,
            "limits": {
                "max_document_tokens": 150,
                "max_collection_tokens": 300,
                "max_collection_kv_bytes": None,
            },
        }
        assert 0 < want.kv_bytes_per_token < 2 * rag.model.config.num_layers * 1000  # stepz, not raw
        assert c.get("/v1/collections/b/usage", headers=bearer(RB_KEY)).json()["tokens"] == t3
        assert c.get("/v1/collections/b/usage", headers=bearer(W_KEY)).json()["documents"] == 1
        for key, name in ((A_KEY, "b"), (A_KEY, "no-such"), (RB_KEY, "a"), (RB_KEY, "default")):
            r = c.get(f"/v1/collections/{name}/usage", headers=bearer(key))
            assert r.status_code == 403, (key, name, r.text)
            assert "tokens" not in r.text
        assert c.get("/v1/collections/a/usage").status_code == 401
        assert c.get("/v1/collections/a%20b/usage", headers=bearer(W_KEY)).status_code == 422
        empty = c.get("/v1/collections/never-used/usage", headers=bearer(W_KEY)).json()
        assert (empty["documents"], empty["tokens"], empty["kv_bytes"]) == (0, 0, 0)

        metrics = c.get("/metrics", headers=bearer(W_KEY)).text
        assert metric(metrics, "ragkv_quota_refusals", limit="max_document_tokens") == 1
        assert metric(metrics, "ragkv_quota_refusals", limit="max_collection_tokens") == 1
        assert metric(metrics, "ragkv_quota_refusals", limit="max_collection_kv_bytes") == 0
        assert metric(metrics, "ragkv_collections") == 2 and '"a"' not in metrics
    finally:
        c.close()
        rag.close()
