"""Ingest as a Ray Data pipeline (ragkv.rag.distributed): the same index and KV as the single-process
ingest, a re-run that computes nothing, bad input reported per document, a killed worker and a restarted
Redis mid-run. The pipeline tests start a local Ray (2 CPUs, a small object store) and stop it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ragkv.llm import LLM
from ragkv.rag import RAG, Quotas
from ragkv.rag.distributed import (
    CHUNK_DEFAULTS,
    Split,
    WorkerSpec,
    ingest_dataset,
    normalize_rows,
    parse_jsonl_lines,
    read_parquet_files,
    read_text_files,
)
from ragkv.rag.first_level import first_level_stored
from ragkv.store import store_from_url
from ragkv.testing import descendants_named, fill_index_disk, free_index_disk, musique_docs, stories_model

ray = pytest.importorskip("ray")


def _rag(data_dir: Path, embedder, store=None, **kw) -> RAG:
    return RAG(LLM(stories_model()), data_dir, store=store, embedder=embedder, chunk_tokens=64, **kw)


# ---- the steps, on their own (no Ray) -------------------------------------------------------------------
def test_reading_steps_turn_bad_input_into_per_document_errors(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("Lily had a red ball.")
    bad.write_bytes(b"\xff\xfe not utf-8")
    got = read_text_files(pd.DataFrame({"path": [str(good), str(bad), str(tmp_path / "missing.txt")]}))
    assert list(got["doc_id"]) == ["good", "bad", "missing"]
    assert got["text"][0] == "Lily had a red ball." and got["error"][0] == ""
    assert "unreadable file" in got["error"][1] and "unreadable file" in got["error"][2]
    lines = ['{"id": "a", "text": "x", "metadata": {"k": 1}}', "not json", "[1, 2]", '"plain"']
    got = parse_jsonl_lines(pd.DataFrame({"text": lines, "path": ["f.jsonl"] * 4}))
    assert got["doc_id"][0] == "a" and json.loads(got["metadata"][0]) == {"k": 1} and not got["error"][0]
    assert "not JSON" in got["error"][1] and "not a document" in got["error"][2]
    assert got["text"][3] == "plain" and not got["error"][3]
    pd.DataFrame({"id": ["p0", "p1"], "text": ["one", "two"]}).to_parquet(tmp_path / "t.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    got = read_parquet_files(
        pd.DataFrame({"path": [str(tmp_path / "t.parquet"), str(tmp_path / "broken.parquet")]})
    )
    assert list(got["doc_id"]) == ["p0", "p1", ""] and list(got["text"][:2]) == ["one", "two"]
    assert "unreadable file" in got["error"][2] and got["source"][2].endswith("broken.parquet")
    got = normalize_rows(pd.DataFrame({"text": ["t"], "metadata": ['{"a": 2}']}))
    assert got["doc_id"][0] == "" and json.loads(got["metadata"][0]) == {"a": 2}


def test_split_step_is_the_single_ingests_split(tmp_path):
    """Chunks, token ids and KV keys as ``RAG.ingest`` makes them; a document over the size limit, an
    empty one and an already committed one are rows that say so."""
    from ragkv.kv.chunk import chunk_key
    from ragkv.rag import split_tokens
    from ragkv.rag.index import text_sha

    m = stories_model()
    text = "Lily had a red ball. She liked to play with it in the park. " * 12
    split = Split(
        m.tokenizer, 64, 0, m.fingerprint, Quotas(max_document_tokens=150), "default", {"old": text_sha("x")}
    )
    rows = [
        {"doc_id": "d", "text": "Lily had a red ball.", "metadata": "{}", "source": "", "error": ""},
        {"doc_id": "big", "text": text, "metadata": "{}", "source": "", "error": ""},
        {"doc_id": "e", "text": "  ", "metadata": "{}", "source": "", "error": ""},
        {"doc_id": "old", "text": "x", "metadata": "{}", "source": "", "error": ""},
        {"doc_id": "r", "text": "", "metadata": "{}", "source": "f", "error": "unreadable file: gone"},
    ]
    out = split(pd.DataFrame(rows))
    assert list(out.columns) == list(CHUNK_DEFAULTS)
    by = {d: out[out["doc_id"] == d] for d in ("d", "big", "e", "old", "r")}
    want = split_tokens(m.tokenizer, "Lily had a red ball.", 64)
    assert list(by["d"]["status"]) == ["chunk"] * len(want)
    assert [np.frombuffer(t, dtype=np.int32).tolist() for t in by["d"]["token_ids"]] == [
        list(c.token_ids) for c in want
    ]
    assert list(by["d"]["kv_key"]) == [chunk_key(list(c.token_ids), m.fingerprint) for c in want]
    assert list(by["big"]["status"]) == ["error"] and "max_document_tokens" in by["big"]["error"].iloc[0]
    assert list(by["e"]["status"]) == ["error"] and "non-empty" in by["e"]["error"].iloc[0]
    assert list(by["old"]["status"]) == ["unchanged"]
    assert list(by["r"]["status"]) == ["error"] and by["r"]["error"].iloc[0] == "unreadable file: gone"


# ---- the pipeline on a local Ray ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs and a small object store for this module, stopped after it."""
    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _write_inputs(folder: Path, docs: list[dict]) -> None:
    """The documents as JSONL (a third), Parquet (a third) and text files (the rest)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(docs) // 3
    (folder / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:n]))
    pd.DataFrame([{"id": d["id"], "text": d["text"]} for d in docs[n : 2 * n]]).to_parquet(
        folder / "b.parquet"
    )
    for d in docs[2 * n :]:
        (folder / f"{d['id']}.txt").write_text(d["text"])


def _index_rows(rag: RAG) -> dict:
    return {(r.doc_id, r.seq): (r.text, r.token_ids, r.kv_key) for r in rag.index.all_chunks()}


@pytest.mark.slow  # a local Ray
def test_pipeline_matches_single_process_ingest_and_reruns_compute_nothing(
    tmp_path, local_ray, one_thread, embedder
):
    docs = musique_docs(2, chars=300)
    _write_inputs(tmp_path / "in", docs)
    single = _rag(tmp_path / "single", embedder)
    single.ingest(docs, show_progress=False)
    rag = _rag(tmp_path / "ray", embedder)
    rep = ingest_dataset(tmp_path / "in", rag, show_progress=False)
    assert not rep.errors and sorted(rep.doc_ids) == sorted(d["id"] for d in docs)
    assert rep.documents_added == len(docs) and rep.chunks_added == len(single.index)
    assert rep.kv_computed == len({r.kv_key for r in single.index.all_chunks()})
    assert _index_rows(rag) == _index_rows(single)  # same chunks, token ids and KV keys
    for a in rag.index.all_chunks():  # the same embeddings (another process: within float noise)
        b = single.index.chunks_with_key(a.kv_key)[0]
        va = rag.index.vectors.reconstruct(a.chunk_id)
        vb = single.index.vectors.reconstruct(b.chunk_id)
        assert float(va @ vb) > 0.999
    head, _ = rag.answers.prompt_parts("?")
    for r in rag.index.all_chunks():  # stored KV equals the single ingest's, and the first level is stored
        got = rag.store.get(r.kv_key, rag.corpus.model.fingerprint)
        want = single.store.get(r.kv_key, single.corpus.model.fingerprint)
        assert got is not None and want is not None and got.token_ids.tolist() == r.token_ids
        assert first_level_stored(rag.model, rag.kv_tree, head, r.token_ids)
    q = "Where was the author educated?"
    assert [c.kv_key for c in rag.retrieve(q, 3)] == [c.kv_key for c in single.retrieve(q, 3)]
    # the first level is read from the store: a first chunk's exact pages are hits in a fresh tree
    ans = rag.answer(q, mode="prefix", max_new_tokens=2)
    assert ans.stats["cached_tokens"] >= 32 and ans.stats["store_tokens"] >= 32, ans.stats

    again = ingest_dataset(tmp_path / "in", rag, show_progress=False)
    assert again.documents_unchanged == len(docs) and again.documents_added == 0
    assert again.kv_computed == again.first_level_computed == 0 and not again.errors
    single.close()
    rag.close()


@pytest.mark.slow  # a local Ray
def test_pipeline_reports_bad_input_and_ingests_the_rest(tmp_path, local_ray, one_thread, embedder):
    docs = musique_docs(1, chars=200)
    folder = tmp_path / "in"
    _write_inputs(folder, docs)
    (folder / "bad.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    (folder / "c.jsonl").write_text('{"id": "huge", "text": "' + "word " * 400 + '"}\nnot json\n')
    rag = _rag(tmp_path / "data", embedder, quotas=Quotas(max_document_tokens=300))
    rep = ingest_dataset([folder, tmp_path / "missing.txt"], rag, show_progress=False)
    errors = {(e["doc_id"], e["error"].split(":")[0]) for e in rep.errors}
    assert ("bad", "unreadable file") in errors and ("missing", "unreadable file") in errors
    assert ("huge", "quota exceeded") in errors and ("", "not JSON") in errors and len(errors) == 4
    assert sorted(rep.doc_ids) == sorted(d["id"] for d in docs) == rag.list_documents()
    rag.close()


@pytest.mark.slow  # a local Ray
def test_pipeline_holds_the_collection_quota_document_by_document(tmp_path, local_ray, one_thread, embedder):
    """A collection token quota that fits some of the documents: those are committed, each of the others
    is a per-document refusal in the report (the single-process ingest's limit, on the Ray path too)."""
    from ragkv.rag import split_tokens

    docs = musique_docs(2, chars=200)
    probe = _rag(tmp_path / "probe", embedder)
    tokens = {
        d["id"]: sum(len(c.token_ids) for c in split_tokens(probe.model.tokenizer, d["text"], 64, 0))
        for d in docs
    }
    probe.close()
    cap = sum(tokens.values()) // 2
    rag = _rag(tmp_path / "data", embedder, quotas=Quotas(max_collection_tokens=cap))
    ds = ray.data.from_items([{"id": d["id"], "text": d["text"]} for d in docs])
    rep = ingest_dataset(ds, rag, show_progress=False)
    refused = {e["doc_id"] for e in rep.errors}
    assert refused and all("quota exceeded" in e["error"] for e in rep.errors)
    assert sorted(rep.doc_ids) == rag.list_documents() and set(rep.doc_ids) | refused == set(tokens)
    assert sum(tokens[i] for i in rep.doc_ids) <= cap < sum(tokens.values())
    assert rag.usage().tokens <= cap and rag.quota_refusals.get("max_collection_tokens")
    rag.close()


@pytest.mark.slow  # a local Ray, and a Dataset given
def test_pipeline_takes_any_ray_dataset(tmp_path, local_ray, one_thread, embedder):
    docs = musique_docs(1, chars=200)
    rag = _rag(tmp_path / "data", embedder)
    ds = ray.data.from_items(
        [{"id": d["id"], "text": d["text"], "metadata": {"n": i}} for i, d in enumerate(docs)]
    )
    rep = ingest_dataset(ds, rag, collection="c", show_progress=False)
    assert sorted(rep.doc_ids) == rag.list_documents("c") == sorted(d["id"] for d in docs)
    assert rag.chunks_by_id([rag.index.chunks_of(docs[1]["id"], "c")[0].chunk_id], "c")[0].metadata == {
        "n": 1
    }
    rag.close()


def _run_in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["rep"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


@pytest.mark.slow  # a local Ray, a worker killed
def test_a_killed_worker_is_replaced_and_nothing_is_lost(tmp_path, local_ray, one_thread, embedder):
    docs = musique_docs(6, per_sample=10, chars=300)
    rag = _rag(tmp_path / "data", embedder)
    t, out = _run_in_thread(
        lambda: ingest_dataset(docs, rag, batch_size=2, commit_every=4, show_progress=False)
    )
    killed = None
    deadline = time.monotonic() + 300
    while t.is_alive() and time.monotonic() < deadline and killed is None:
        pids = descendants_named("ChunkKV")
        if pids and len(rag.store.keys()) >= 5:  # the actor is computing: kill it mid-run
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    t.join(600)
    assert killed is not None, "the chunk-KV worker was never seen running"
    rep = out.get("rep")
    assert rep is not None, out.get("error")
    assert not rep.errors and sorted(rep.doc_ids) == sorted(d["id"] for d in docs) == rag.list_documents()
    dead = f"{os.uname().nodename}:{killed}"
    assert any(w != dead for w in rep.workers)  # Ray started another worker, which did the rest
    # and what the dead one had stored was found, not computed again (or it delivered its rows first)
    assert dead in rep.workers or rep.kv_already_stored + rep.first_level_stored > 0
    keys = {r.kv_key for r in rag.index.all_chunks()}
    assert keys <= set(rag.store.keys())  # every committed chunk's KV is stored
    assert rep.kv_computed + rep.kv_already_stored == rep.chunks_added
    rag.close()


@pytest.mark.slow  # a local Ray, Redis killed and restarted
def test_redis_restarted_mid_run_serves_nothing_half_written(
    tmp_path, local_ray, one_thread, embedder, make_redis_server
):
    server = make_redis_server()
    url = f"{server.url}?prefix=t:"
    docs = musique_docs(6, per_sample=10, chars=300)
    rag = _rag(tmp_path / "data", embedder, store=store_from_url(url))
    spec = WorkerSpec.of(rag, url)
    t, out = _run_in_thread(lambda: ingest_dataset(docs, rag, spec, batch_size=2, show_progress=False))
    restarted = False
    deadline = time.monotonic() + 300
    while t.is_alive() and time.monotonic() < deadline and not restarted:
        if len(rag.store.keys()) >= 5:
            server.kill()  # no persistence: what it held is gone
            time.sleep(0.5)
            server.start()
            restarted = True
        time.sleep(0.05)
    t.join(600)
    assert restarted
    rep = out.get("rep")
    assert rep is not None, out.get("error")
    assert not rep.errors and sorted(rep.doc_ids) == sorted(d["id"] for d in docs) == rag.list_documents()
    # KV a write met Redis down for is reported (recomputed when used), never counted as stored
    assert rep.kv_computed + rep.kv_already_stored + rep.kv_not_stored == rep.chunks_added
    assert rep.first_level_computed + rep.first_level_stored + rep.first_level_not_stored == rep.chunks_added
    fp = rag.corpus.model.fingerprint
    by_key = {r.kv_key: r.token_ids for r in rag.index.all_chunks()}
    for key in rag.store.keys():  # every blob the store holds is whole and the chunk it claims
        kv = rag.store.get(key, fp)
        assert kv is not None and kv.token_ids.tolist() == by_key[key]
    # what the restart lost is recomputed when used, never wrong: every answer works
    ans = rag.answer("Where was the author educated?", mode="prefix", max_new_tokens=2)
    assert ans.stats["num_tokens"] > 0
    rag.close()


@pytest.mark.slow  # a local Ray
def test_a_full_index_disk_is_each_documents_error_and_a_rerun_commits_them(
    tmp_path, local_ray, one_thread, embedder
):
    """Documents are acknowledged only once committed: a commit that meets a full disk makes each of
    its documents an error (nothing indexed); once space is freed a re-run commits them and computes no
    chunk KV again (the workers stored it)."""
    docs = musique_docs(1, chars=200)
    ids = sorted(d["id"] for d in docs)
    rag = _rag(tmp_path / "data", embedder)
    fill_index_disk(rag.index)
    rep = ingest_dataset(docs, rag, show_progress=False)
    assert rep.documents_added == 0 and rep.doc_ids == [] and rag.list_documents() == []
    assert sorted(e["doc_id"] for e in rep.errors) == ids
    assert all("not committed" in e["error"] and "disk is full" in e["error"] for e in rep.errors)
    free_index_disk(rag.index)
    again = ingest_dataset(docs, rag, show_progress=False)
    assert sorted(again.doc_ids) == ids == rag.list_documents() and not again.errors
    assert again.kv_computed == 0 and again.kv_already_stored == again.chunks_added > 0
    rag.close()
