"""The service under faults and hostile clients: kill -9 during ingest, a 32-client delete/query race
against a real server, queue deadlines, cancellation, bounded shutdown, API keys, Host checks, strict
input, store integrity. Traffic only to loopback; everything bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from ragkv import LLM
from ragkv.blend import DEFAULT_RATIO
from ragkv.rag import RAG, ChunkIndex, IngestCancelled
from ragkv.store import LocalDirStore
from ragkv.store import blob as blobfmt
from ragkv.testing import stories_model, synthetic_docs
from ragkv_server.config import Settings
from ragkv_server.service import ClientGoneError, Service, UnavailableError

W_KEY = "write-key-0123456789abcdef"
R_KEY = "read-key-0123456789abcdef"


def _rag(path: Path, embedder, **kw) -> RAG:
    kw.setdefault("ratio", DEFAULT_RATIO)  # blending mechanics: an explicit ratio (outside the fidelity gate)
    kw.setdefault("chunk_tokens", 64)
    kw.setdefault("top_k", 3)
    return RAG(LLM(stories_model()), path, embedder=embedder, **kw)


# ---- kill -9 during ingest ---------------------------------------------------------------------------


# ---- the index: recovery and incremental persistence -----------------------------------------------
def _vecs(n: int, dim: int = 8, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _chunks(doc: str, n: int) -> list:
    return [(i, f"{doc} part {i}", [1, 2, i + 3], f"key-{doc}-{i}") for i in range(n)]


def test_index_add_does_not_rewrite_the_faiss_file_and_restart_finds_everything(tmp_path):
    idx = ChunkIndex(tmp_path, 8, snapshot_every=10_000)
    idx.add_document("a", "sha-a", {}, _chunks("a", 3), _vecs(3))
    idx.snapshot()
    mtime = (tmp_path / "vectors.faiss").stat().st_mtime_ns
    ids_b = idx.add_document("b", "sha-b", {}, _chunks("b", 2), _vecs(2, seed=1))
    idx.delete_document("a")
    assert (tmp_path / "vectors.faiss").stat().st_mtime_ns == mtime  # O(new chunks): no full rewrite
    idx.db.close()  # as after kill -9: no close(), no snapshot
    (tmp_path / "vectors.faiss.123.tmp").write_bytes(b"half a snapshot")
    again = ChunkIndex(tmp_path, 8)
    assert again.document_ids() == ["b"] and len(again) == 2 and again.num_documents == 1
    assert {r.chunk_id for r in again.search(_vecs(2, seed=1)[0], 5)} == set(ids_b)
    assert not list(tmp_path.glob("*.tmp"))
    again.close()


def test_index_from_before_the_fix_drops_a_half_written_document(tmp_path):
    """The old layout: chunk rows without vectors, FAISS saved after the SQLite commit; a crash in
    between left a document listed but never retrieved. Start-up now migrates and removes it."""
    import faiss

    idx = ChunkIndex(tmp_path, 8)
    idx.add_document("whole", "s1", {}, _chunks("whole", 2), _vecs(2))
    idx.add_document("half", "s2", {}, _chunks("half", 2), _vecs(2, seed=3))
    whole_ids = [r.chunk_id for r in idx.chunks_of("whole")]
    old = faiss.IndexIDMap2(faiss.IndexFlatIP(8))
    old.add_with_ids(_vecs(2), np.asarray(whole_ids, dtype=np.int64))  # "half" never reached FAISS
    idx.close()
    faiss.write_index(old, str(tmp_path / "vectors.faiss"))
    db = sqlite3.connect(tmp_path / "chunks.sqlite")
    db.execute("UPDATE chunks SET vector=NULL")
    db.commit()
    db.close()
    again = ChunkIndex(tmp_path, 8)
    assert again.document_ids() == ["whole"]
    assert {r.chunk_id for r in again.search(_vecs(2)[0], 5)} == set(whole_ids)
    assert set(again.intents()) == {"key-half-0", "key-half-1"}  # their KV is deleted by the RAG
    again.close()


# ---- RAG: atomic ingest, deletes and write-backs, wrong-key blobs -------------------------------------
def test_multi_document_ingest_is_all_or_none_and_leaves_no_kv(tmp_path, embedder, one_thread):
    rag = _rag(tmp_path, embedder, ingest_batch=1)
    docs = [
        {"id": "one", "text": synthetic_docs(1, 1)[0]["text"]},
        {"id": "two", "text": "Lily ran. " * 60},
    ]
    from ragkv.rag import split_tokens

    n_one = len(split_tokens(rag.model.tokenizer, docs[0]["text"], rag.chunk_tokens))

    def cancel() -> bool:  # cancelled while the second document is being processed
        return len(rag.store.keys()) > n_one

    with pytest.raises(IngestCancelled):
        rag.ingest(docs, show_progress=False, cancel=cancel)
    assert rag.index.document_ids() == [] and len(rag.index) == 0
    assert rag.store.keys() == [] and rag.index.intents() == []
    rep = rag.ingest(docs, show_progress=False)
    assert rep.documents_added == 2 and rag.index.document_ids() == ["one", "two"]
    assert set(rag.store.keys()) == {r.kv_key for r in rag.index.all_chunks()}
    rag.close()


def test_write_back_cannot_resurrect_a_deleted_documents_kv(tmp_path, embedder, one_thread):
    rag = _rag(tmp_path, embedder)
    rag.ingest([{"id": "d", "text": "Tom had a big red kite. " * 20}], show_progress=False)
    recs = rag.index.chunks_of("d")
    for r in recs:
        rag.store.delete(r.kv_key)
    gate = threading.Event()
    rag.resolver._writer.submit(gate.wait)  # hold the writer: the write-backs queue behind it
    rag.answer("kite?", chunks=recs, max_new_tokens=2)  # misses: recomputed, write-backs queued
    rag.delete_document("d")
    gate.set()
    rag.flush()
    assert rag.store.keys() == []
    rag.close()


def test_blob_under_the_wrong_key_is_treated_as_corrupt_and_rewritten(tmp_path, embedder, one_thread):
    rag = _rag(tmp_path, embedder)
    rag.ingest(
        [
            {"id": "a", "text": "The cat sat on the mat. " * 3},
            {"id": "b", "text": "A dog ran in the park. " * 3},
        ],
        show_progress=False,
    )
    (ra,), (rb,) = rag.index.chunks_of("a"), rag.index.chunks_of("b")
    store: LocalDirStore = rag.store
    shutil.copyfile(store.path_of(rb.kv_key), store.path_of(ra.kv_key))  # a valid blob, of chunk b
    assert store.header(ra.kv_key) is None and store.known_corrupt(ra.kv_key)
    first = rag.answer("cat?", chunks=[ra], max_new_tokens=3)
    assert first.stats["kv_hits"] == 0
    rag.flush()
    assert store.header(ra.kv_key).key == ra.kv_key  # rewritten by the write-back
    second = rag.answer("cat?", chunks=[ra], max_new_tokens=3)
    assert second.stats["kv_hits"] == 1 and second.text == first.text
    rag.close()


# ---- the service: deadlines, cancellation, shutdown ---------------------------------------------------
def _settings(**kw) -> Settings:
    return Settings(**{"queue_timeout_s": 0.5, "shutdown_timeout_s": 0.5, **kw})


@pytest.mark.slow  # fault injection
def test_queue_deadline_is_enforced_while_waiting_and_the_work_is_dropped():
    """A request queued behind a running ingest gets 503 once it has waited ``queue_timeout_s`` (the
    service's own reckoning: "waited 0.5 s"), while that ingest is still running (the test holds it),
    not when it ends; the queued work is dropped and never starts, though the worker goes on to the
    next job. Ordering, not a stopwatch."""
    svc = Service(_settings())
    started, release = threading.Event(), threading.Event()
    ran, after = [], []

    async def main() -> tuple[str, bool]:
        slow = asyncio.ensure_future(svc.run_ingest(lambda c: started.set() or release.wait(60)))
        assert await asyncio.to_thread(started.wait, 60)  # the one ingest worker is busy
        with pytest.raises(UnavailableError, match="waited") as refused:
            await svc.run_ingest(lambda c: ran.append(1))
        held = not release.is_set() and not slow.done()
        release.set()
        assert await slow
        # one worker, first in first out: the dropped job was taken (and skipped) before this one ran
        await svc.run_ingest(lambda c: after.append(1))
        return str(refused.value), held

    message, held = asyncio.run(main())
    assert held  # the 503 came while the slow ingest was still running
    waited = float(re.search(r"waited ([0-9.]+) s", message)[1])
    assert waited >= 0.5 and "limit 0.5 s" in message  # never before the deadline
    assert ran == [] and after == [1]  # dropped, never started
    assert svc.ingests.pending == 0
    assert svc.close()


def test_client_that_goes_away_cancels_its_ingest():
    """A client that leaves while its ingest runs gets ClientGoneError, and the running work is told
    to stop (its cancel event), as the ingest checks between its steps."""
    svc = Service(_settings(queue_timeout_s=60))
    started, seen = threading.Event(), threading.Event()

    def work(cancel: threading.Event) -> None:
        started.set()
        assert cancel.wait(60), "never cancelled"
        seen.set()
        raise IngestCancelled("stopped")

    async def main():
        async def gone() -> bool:
            return started.is_set()  # the client leaves once its ingest is running

        with pytest.raises(ClientGoneError):
            await svc.run_ingest(work, gone)

    asyncio.run(main())
    assert seen.wait(60)
    assert svc.close()


def test_shutdown_is_bounded_even_if_work_does_not_stop():
    """``close(timeout)`` gives up on work that ignores its cancel: it returns False while that work
    is still running (the test holds it until close has returned), instead of waiting for it; the
    work, once let go, still ends cleanly, and nothing new is accepted. (``eval.bench_timing``
    times close(0.5) itself.)"""
    svc = Service(_settings())
    started, release = threading.Event(), threading.Event()

    async def main() -> tuple[bool, bool]:
        task = asyncio.ensure_future(svc.run_ingest(lambda c: started.set() or release.wait(120)))
        assert await asyncio.to_thread(started.wait, 60)
        # a generous deadline against hanging; what is checked is that close returns before the work
        finished = await asyncio.wait_for(asyncio.to_thread(svc.close, 0.5), 60)
        held = not release.is_set() and not task.done()
        release.set()
        assert await asyncio.wait_for(task, 60)  # the work that would not stop still ends cleanly
        with pytest.raises(UnavailableError):  # and nothing new is accepted
            await svc.run_ingest(lambda c: None)
        return finished, held

    finished, held = asyncio.run(main())
    assert not finished and held


# ---- a store outage: answers go on, warnings are throttled ------------------------------------------
@pytest.mark.slow  # fault injection
def test_store_outage_warnings_are_throttled_with_a_count(tmp_path, embedder, make_redis_server, caplog):
    """Redis killed under queries, OpenAI-compatible completions (``save``) and an ingest: every chunk
    fails to load and to store, every answer still comes, and each kind of warning is logged once per
    interval; the next one after the interval carries the count of those held back."""
    import logging

    from fastapi.testclient import TestClient

    from ragkv.remote.client import build_prompt
    from ragkv.store.redis_store import RedisStore
    from ragkv_server.server import create_app

    redis = make_redis_server()
    store = RedisStore(redis.url, prefix="outage:", down_backoff_s=0.2, warn_every_s=60.0, socket_timeout=1.0)
    rag = _rag(tmp_path, embedder, store=store)
    rag._warn.every_s = 60.0
    docs = synthetic_docs(3, seed=21)
    rag.ingest(docs, show_progress=False)
    recs = [r for d in docs for r in rag.index.chunks_of(d["id"])][:4]
    s = Settings(max_new_tokens=2, allowed_hosts=["testserver"])
    svc = Service(s, rag)
    svc.start()
    client = TestClient(create_app(s, svc), base_url="http://testserver")
    prompt, params = build_prompt(
        [rag.model.config.bos_token_id], [(r.kv_key, r.token_ids) for r in recs], [9]
    )
    rag.resolver._warn.every_s = 60.0
    redis.kill()
    try:
        with caplog.at_level(logging.WARNING):
            codes = []
            for _ in range(12):
                codes.append(
                    client.post(
                        "/v1/query",
                        json={"question": "Which river?", "chunk_ids": [r.chunk_id for r in recs]},
                    ).status_code
                )
                codes.append(
                    client.post(
                        "/v1/completions",
                        json={"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params},
                    ).status_code
                )
            doc = {"id": "during-outage", "text": synthetic_docs(1, seed=22)[0]["text"]}
            codes.append(client.post("/v1/documents", json={"documents": [doc]}).status_code)
            rag.flush()  # the write-backs of the recomputed chunks (they fail too)
            burst = [r for r in caplog.records if r.name.startswith("ragkv")]
            rag._warn.every_s = 0.0  # the interval is over: the next write-back failure reports the count
            client.post("/v1/query", json={"question": "Which river?", "chunk_ids": [recs[0].chunk_id]})
            rag.flush()
        assert codes == [200] * len(codes)
        failures = store.stats()["errors"]
        assert failures >= 12 * 2 * len(recs)  # every chunk of every request failed, at least once
        kinds = sorted({r.getMessage().split(" ")[0] for r in burst})
        assert len(burst) <= 4, [r.getMessage() for r in burst]  # one per kind: store, write-back, ingest
        assert kinds, "the outage was not reported at all"
        summary = [r.getMessage() for r in caplog.records[len(burst) :] if "suppressed" in r.getMessage()]
        assert summary and "write-back" in summary[0], [r.getMessage() for r in caplog.records]
        held = int(summary[0].split("[")[1].split()[0])
        assert held >= 12 * len(recs) - 1
    finally:
        client.close()
        rag.close()


# ---- the app in process: API keys, Host checks, 405, strict input -----------------------------------
@pytest.fixture(scope="module")
def app_factory(tmp_path_factory, embedder):
    from fastapi.testclient import TestClient

    from ragkv_server.server import create_app

    rag = _rag(tmp_path_factory.mktemp("app"), embedder)
    made = []

    def make(**kw) -> TestClient:
        kw.setdefault("allowed_hosts", ["testserver", "127.0.0.1"])
        s = Settings(max_new_tokens=4, max_prompt_chars=200, **kw)
        svc = Service(s, rag)
        svc.start()  # the RAG is given: this only picks the backend (no lifespan: the RAG is shared)
        client = TestClient(create_app(s, svc), base_url="http://testserver")
        made.append(client)
        return client

    yield make
    rag.close()


def test_healthz_answers_while_every_worker_is_held(tmp_path, embedder, one_thread):
    """Health never queues behind queries or ingest: with every query worker and the ingest worker
    held by the test (and one more query queued), ``/healthz`` answers 200 and reports them. An
    ordering witness; the end-to-end test under 32 clients keeps only a loose bound on its latency."""
    from ragkv_server.server import create_app

    rag = _rag(tmp_path, embedder)
    s = Settings(max_concurrency=2, allowed_hosts=["testserver"])
    svc = Service(s, rag)
    svc.start()
    app = create_app(s, svc)
    release, started = threading.Event(), threading.Semaphore(0)

    def held(wait: float):
        started.release()
        release.wait(60)
        yield "done"

    async def query() -> list:
        return [x async for x in svc.run_stream(held)]

    async def main() -> tuple[int, dict]:
        work = [asyncio.ensure_future(query()) for _ in range(s.max_concurrency + 1)]
        work.append(asyncio.ensure_future(svc.run_ingest(lambda c: started.release() or release.wait(60))))
        for _ in range(s.max_concurrency + 1):  # both query workers and the ingest worker are busy
            assert await asyncio.to_thread(started.acquire, True, 60)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
                r = await c.get("/healthz")
        finally:
            release.set()
        assert [await w for w in work] == [["done"]] * (s.max_concurrency + 1) + [True]
        return r.status_code, r.json()

    try:
        status, body = asyncio.run(main())
    finally:
        svc.close()
    assert status == 200 and body["running"] == s.max_concurrency and body["queued"] == 1, body


def test_writes_need_a_write_key_when_keys_are_configured(app_factory, one_thread):
    c = app_factory(api_keys=[W_KEY], read_api_keys=[R_KEY])
    doc = {"documents": [{"id": "k1", "text": "Sam saw a small bird. " * 4}]}
    r = c.post("/v1/documents", json=doc)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert (
        c.post("/v1/documents", json=doc, headers={"Authorization": "Bearer nope-nope-nope-nope"}).status_code
        == 401
    )
    assert c.post("/v1/documents", json=doc, headers={"X-API-Key": R_KEY}).status_code == 403
    assert c.delete("/v1/documents/k1", headers={"Authorization": f"Bearer {R_KEY}"}).status_code == 403
    assert c.delete("/v1/documents/k1").status_code == 401
    assert c.post("/v1/documents", json=doc, headers={"Authorization": f"Bearer {W_KEY}"}).status_code == 200
    # with keys configured, reads need a key too (issue 24: require_key_for_reads is ignored)
    assert c.get("/v1/documents").status_code == 401
    assert c.get("/v1/documents", headers={"X-API-Key": R_KEY}).json()["ids"] == ["k1"]
    q = {"question": "bird?", "max_tokens": 2}
    assert c.post("/v1/query", json=q).status_code == 401
    assert c.post("/v1/query", json=q, headers={"X-API-Key": R_KEY}).status_code == 200
    assert c.delete("/v1/documents/k1", headers={"X-API-Key": W_KEY}).status_code == 200
    assert c.get("/healthz").status_code == 200  # liveness stays open
    scheme = c.get("/openapi.json").json()["components"]["securitySchemes"]
    assert {"HTTPBearer", "APIKeyHeader"} <= set(scheme)


def test_host_header_allow_list_and_405_allow(app_factory):
    c = app_factory()
    assert c.get("/healthz").status_code == 200
    assert c.get("/healthz", headers={"Host": "rebind.attacker.example"}).status_code == 400
    r = c.put("/v1/documents", json={})
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} >= {"GET", "POST"}
    assert r.json()["error"]["type"] == "method_not_allowed"


def test_loose_types_are_refused_not_coerced(app_factory):
    c = app_factory()
    for body in (
        {"question": "x", "stream": 0},
        {"question": "x", "temperature": False},
        {"question": "x", "top_k": "2"},
        {"question": "x", "max_tokens": 2.0},
    ):
        assert c.post("/v1/query", json=body).status_code == 422, body
    for body in ({"prompt": [False]}, {"prompt": [1, 2], "stream": 0}, {"prompt": "y" * 201}):
        assert c.post("/v1/completions", json=body).status_code == 400, body  # OpenAI / vLLM: 400
    assert c.post("/v1/query", json={"question": "x", "temperature": 0, "max_tokens": 2}).status_code == 200


def test_non_loopback_without_keys_warns(caplog):
    from ragkv_server.server import warn_exposure

    with caplog.at_level("WARNING", logger="ragkv.server"):
        warn_exposure(Settings(host="0.0.0.0"))
        warn_exposure(Settings(host="0.0.0.0", api_keys=[W_KEY]))
        warn_exposure(Settings(host="127.0.0.1"))
    assert sum("without API keys" in r.message for r in caplog.records) == 1


# ---- a real server: slow clients, and 32 clients racing deletes with queries ------------------------
def _slow_client_is_cut(base: str) -> float:
    """Seconds until the server closes a connection that never finishes its request head."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and nothing more
        t0 = time.perf_counter()
        s.settimeout(30)
        try:
            while s.recv(1024):
                pass
        except (ConnectionResetError, TimeoutError):
            pass
        return time.perf_counter() - t0


def _read_until_closed(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    try:
        while piece := s.recv(65536):
            data += piece
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def _closed_by_server(s: socket.socket, wait: float) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_slow_bodies_get_408_and_half_open_connections_cannot_starve_healthz(tmp_path):
    """A body that stops arriving gets 408 (and the connection closed) within ``body_timeout_s``;
    connections that never send their request head are capped (the oldest closed), so they never fill
    uvicorn's connection limit: /healthz on a fresh connection keeps answering 200."""
    from helpers_service import running_server

    env = {
        "RAGKV_BODY_TIMEOUT_S": "1.5",
        "RAGKV_HEADER_TIMEOUT_S": "60",  # the cap, not the head deadline, closes them here
        "RAGKV_MAX_PENDING_CONNECTIONS": "8",
        "RAGKV_MAX_CONNECTIONS": "24",
    }
    with running_server(tmp_path, **env) as base:
        host, port = base.removeprefix("http://").split(":")
        addr = (host, int(port))
        for path, ctype, part in (
            ("/v1/query", "application/json", b'{"question": "Where'),
            ("/v1/documents", "application/x-ndjson", b'{"id": "slow", "text": "Once'),
        ):
            with socket.create_connection(addr, timeout=10) as s:
                head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
                s.sendall(f"{head}Content-Length: 400\r\n\r\n".encode() + part)
                t0 = time.perf_counter()
                reply = _read_until_closed(s, 30)
                took = time.perf_counter() - t0
            assert reply.startswith(b"HTTP/1.1 408 "), (path, reply[:300])
            assert b"request_timeout" in reply and 1.2 < took < 15, (path, took)  # 1.5 s: 10x
        socks = []
        try:
            for _ in range(20):
                s = socket.create_connection(addr, timeout=10)
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and nothing more
                socks.append(s)
            time.sleep(0.5)
            closed = [_closed_by_server(s, 0.3) for s in socks]
            assert closed == [True] * 12 + [False] * 8, closed  # the oldest went first
            worst = 0.0
            for _ in range(4):  # the attack goes on: 40 more half-open connections, well over 24
                for _ in range(10):
                    s = socket.create_connection(addr, timeout=10)
                    s.sendall(b"GET /healthz HTTP/1.1\r\n")
                    socks.append(s)
                t0 = time.perf_counter()
                r = httpx.get(base + "/healthz", timeout=10)  # a fresh connection each time
                worst = max(worst, time.perf_counter() - t0)
                assert r.status_code == 200, r.text
            assert worst < 2.0  # loose: the machine is shared; without the cap these were 503s
        finally:
            for s in socks:
                s.close()


@pytest.mark.slow
def test_32_clients_race_deletes_and_queries_against_a_serial_reference(tmp_path, one_thread):
    from helpers_service import running_server

    stable = [{"id": f"st-{i}", "text": d["text"]} for i, d in enumerate(synthetic_docs(4, seed=11))]
    churn = [{"id": f"ch-{i}", "text": d["text"]} for i, d in enumerate(synthetic_docs(8, seed=12))]
    extra = {"RAGKV_MAX_QUEUE": "64", "RAGKV_HEADER_TIMEOUT_S": "1.5", "RAGKV_QUEUE_TIMEOUT_S": "120"}
    with running_server(tmp_path, **extra) as base, httpx.Client(base_url=base, timeout=120) as c:
        assert 1.0 < _slow_client_is_cut(base) < 15  # header timeout 1.5 s: 10x
        r = c.post("/v1/documents", json={"documents": stable})
        assert r.status_code == 200, r.text
        stable_ids = {d["id"]: d["chunk_ids"] for d in r.json()["documents"]}
        specs = [
            {"question": f"What is record {i}?", "chunk_ids": stable_ids[f"st-{i}"][:2], "max_tokens": 6}
            for i in range(4)
        ] + [{"question": "Where is the harbor?", "max_tokens": 6}]  # retrieval over the stable documents
        serial = [c.post("/v1/query", json=s).json() for s in specs]
        # (answer, source chunk ids): a retrieval that meets a churn document has other sources, and is
        # then compared on its sources only being stable or churn documents
        reference = [(b["answer"], [x["chunk_id"] for x in b["sources"]]) for b in serial]
        churn_chunks: dict[str, list[int]] = {}
        lock = threading.Lock()
        errors: list[str] = []
        health_s: list[float] = []
        stop = threading.Event()

        def health() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                ok = httpx.get(base + "/healthz", timeout=30).status_code == 200
                health_s.append(time.perf_counter() - t0 if ok else 99.0)
                time.sleep(0.2)

        def client(i: int) -> list[tuple[int, str, str]]:
            rng = random.Random(i)
            out = []
            with httpx.Client(base_url=base, timeout=120) as h:
                for s in rng.sample(range(len(specs)), 3):
                    r = h.post("/v1/query", json=specs[s])
                    out.append(
                        (r.status_code, "spec", r.json().get("answer") if r.status_code == 200 else r.text)
                    )
                    if r.status_code != 200:
                        continue
                    got = (r.json()["answer"], [x["chunk_id"] for x in r.json()["sources"]])
                    if got[1] == reference[s][1] and got[0] != reference[s][0]:
                        errors.append(
                            f"client {i}: spec {s} answered {got[0]!r}, serially {reference[s][0]!r}"
                        )
                    if got[1] != reference[s][1]:
                        other = {x["doc_id"] for x in r.json()["sources"]} - set(stable_ids)
                        if not all(d.startswith("ch-") for d in other) or "chunk_ids" in specs[s]:
                            errors.append(
                                f"client {i}: spec {s} sources {got[1]} vs serial {reference[s][1]}"
                            )
                doc = churn[i % len(churn)]
                if i < len(churn):  # 8 clients own a churn document: ingest, query, delete
                    r = h.post("/v1/documents", json={"documents": [doc]})
                    out.append((r.status_code, "ingest", r.text[:200]))
                    with lock:
                        churn_chunks[doc["id"]] = r.json()["documents"][0]["chunk_ids"]
                    time.sleep(rng.uniform(0, 0.3))
                    r = h.delete(f"/v1/documents/{doc['id']}")
                    out.append((r.status_code, "delete", r.text[:200]))
                else:  # the others query churn documents that may be deleted under them
                    with lock:
                        ids = churn_chunks.get(doc["id"])
                    if ids:
                        r = h.post(
                            "/v1/query", json={"question": "Tell me.", "chunk_ids": ids[:2], "max_tokens": 4}
                        )
                        out.append((r.status_code, "race", r.text[:200]))
                    r = h.post("/v1/query", json={"question": "Which canyon?", "max_tokens": 4})
                    out.append((r.status_code, "retrieve", r.text[:200]))
            return out

        watcher = threading.Thread(target=health)
        watcher.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            results = [x for part in pool.map(client, range(32)) for x in part]
        elapsed = time.perf_counter() - t0
        stop.set()
        watcher.join()
        bad = [x for x in results if x[0] != 200 and not (x[1] == "race" and x[0] == 404)]
        assert not bad, bad[:5]
        assert not errors, errors[:5]
        assert c.get("/v1/documents").json()["ids"] == sorted(stable_ids)
        print(
            json.dumps(
                {
                    "requests": len(results),
                    "seconds": round(elapsed, 1),
                    "race_404": sum(x[0] == 404 for x in results),
                    "healthz_max_s": round(max(health_s), 3),
                }
            )
        )
        # health never queues behind queries or ingest (test_healthz_answers_while_every_worker_is_held
        # checks that by ordering); here only a regression of kind: the measuring client shares this
        # process (and its GIL) with the 32 load threads on 2 cores, and a busy machine stretches it
        # (2.3 s seen at load average 7, niced): 25 s is 10x that
        assert max(health_s) < 25.0
    # the server has exited (its write-backs flushed): no KV of a deleted document came back
    db = sqlite3.connect(tmp_path / "data" / "index" / "chunks.sqlite")
    used = {k for (k,) in db.execute("SELECT kv_key FROM chunks")}
    db.close()
    stored = {p.name[: -len(".kvb")] for p in (tmp_path / "data" / "kv").glob("??/*.kvb")}
    assert stored <= used, f"{len(stored - used)} KV blobs of deleted documents are stored"


def test_store_header_read_checks_the_key(tmp_path, one_thread):
    """Every read path, the header included, refuses a blob stored under another chunk's key."""
    from ragkv.model.forward import compute_chunk_kv
    from ragkv.store import MemoryStore, TieredStore

    model = stories_model()
    a, b = compute_chunk_kv(model, [5, 6, 7]), compute_chunk_kv(model, [8, 9])
    for store in (LocalDirStore(tmp_path / "s"), MemoryStore()):
        store.put(b)
        store._write(a.key, blobfmt.encode_chunk(b, store.codec), True)
        assert store.header(a.key) is None and store.known_corrupt(a.key)
        assert store.put(a) and store.header(a.key).key == a.key  # rewritten, not skipped
        store.close()
    backend = LocalDirStore(tmp_path / "t")
    tiered = TieredStore(backend)
    backend.put(b)
    backend._write(a.key, blobfmt.encode_chunk(b, backend.codec), True)
    assert tiered.header(a.key) is None
    assert tiered.put(a) and backend.header(a.key).key == a.key
    tiered.close()


# ---- the ingest-load benchmark at smoke size ---------------------------------------------------------


# ---- disk full during KV writes -----------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB filesystem (tmpfs): the kernel answers writes past it with ENOSPC."""
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_kv_writes_leaves_documents_indexed_and_answerable(
    tmp_path, small_disk, embedder, one_thread
):
    """ENOSPC from the kernel while chunk KV is written: the ingest still indexes every document,
    reports the KV it could not store (not a 500), leaves no partial file, and questions over the
    documents whose KV did not fit are answered (their KV recomputed)."""
    from fastapi.testclient import TestClient

    from ragkv_server.server import create_app

    store = LocalDirStore(small_disk, max_bytes=None)  # no cap of ours: the disk is the limit
    rag = _rag(tmp_path / "data", embedder, store=store)
    s = Settings(max_new_tokens=4, allowed_hosts=["testserver"])
    svc = Service(s, rag)
    svc.start()
    client = TestClient(create_app(s, svc), base_url="http://testserver")
    try:
        words = ["kite", "cat", "tower", "boat", "tree", "ball", "dog", "moon"]
        docs = [
            {"id": f"d{i}", "text": f"Sam saw a {w} by the river. It was big and red. " * 12}
            for i, w in enumerate(words)
        ]
        r = client.post("/v1/documents", json={"documents": docs})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["documents_added"] == len(docs) and body["kv_not_stored"] > 0
        assert body["kv_not_stored"] < body["kv_computed"]  # some fitted before the disk filled
        assert store.stats()["put_errors"] >= body["kv_not_stored"]
        assert set(rag.index.document_ids()) == {d["id"] for d in docs}
        assert not list(small_disk.rglob("*.tmp"))  # a failed write leaves no partial blob
        missing = [c for c in rag.index.all_chunks() if not store.contains(c.kv_key)]
        assert missing
        r = client.post(
            "/v1/query", json={"question": "What did Sam see?", "chunk_ids": [missing[0].chunk_id]}
        )
        assert r.status_code == 200, r.text
        assert (
            r.json()["sources"][0]["doc_id"] == missing[0].doc_id
            and r.json()["usage"]["completion_tokens"] > 0
        )
    finally:
        client.close()
        rag.close()


# ---- corrupt exact KV tree pages ------------------------------------------------------------------------
def test_corrupt_tree_pages_are_recomputed_and_counted_on_metrics(tmp_path, embedder, one_thread):
    """Issue 54 (the soak flips and truncates stored tree pages): after a restart a request whose
    prompt's pages are all damaged in the store answers as full prefill does, and ``/metrics`` counts
    the pages the store refused (``ragkv_kv_tree{figure="store_pages_corrupt"}``; before, a corrupt
    page was only a miss, so a soak could not tell damaged pages were read and refused)."""
    from fastapi.testclient import TestClient
    from helpers_service import metric

    from ragkv_server.server import create_app

    text = " ".join(d["text"] for d in synthetic_docs(1, seed=4))[:600]
    messages = [{"role": "user", "content": f"{text}\n\nWhat is the record about?"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}

    def serve(extra: dict | None = None) -> tuple[dict, str]:
        rag = RAG(LLM(stories_model()), tmp_path / "data", embedder=embedder, chunk_tokens=64, top_k=3)
        rag.kv_tree.clear()  # a restart: nothing in RAM, the pages in the store
        s = Settings(max_new_tokens=6, allowed_hosts=["testserver"])
        svc = Service(s, rag)
        svc.start()
        try:
            with TestClient(create_app(s, svc), base_url="http://testserver") as c:
                r = c.post("/v1/chat/completions", json={**body, **(extra or {})})
                assert r.status_code == 200, r.text
                out = r.json()
                rag.kv_tree.flush()
                return out, c.get("/metrics").text
        finally:
            rag.close()

    first, _ = serve()
    assert first["ragkv"]["stats"]["mode"] == "prefix"
    pages = sorted((tmp_path / "data" / "kv" / "tree").glob("??/*.kvb"))
    assert len(pages) >= 2
    for i, page in enumerate(pages):  # flip bytes in half of them, truncate the others
        raw = bytearray(page.read_bytes())
        if i % 2:
            raw[len(raw) // 2 : len(raw) // 2 + 4] = bytes(
                b ^ 0xFF for b in raw[len(raw) // 2 : len(raw) // 2 + 4]
            )
            page.write_bytes(bytes(raw))
        else:
            page.write_bytes(bytes(raw[: len(raw) // 3]))
    again, metrics = serve()
    assert again["ragkv"]["stats"]["store_tokens"] == 0  # nothing read from a damaged page
    assert metric(metrics, "ragkv_kv_tree", figure="store_pages_corrupt") >= 1
    full, _ = serve({"ragkv": {"mode": "full"}})
    assert again["prompt_token_ids"] == full["prompt_token_ids"] == first["prompt_token_ids"]
    assert (
        again["choices"][0]["token_ids"]
        == full["choices"][0]["token_ids"]
        == first["choices"][0]["token_ids"]
    )
