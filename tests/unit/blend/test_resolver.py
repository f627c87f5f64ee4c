"""The one chunk-KV resolver: every query path gets chunk KV from it, and writes back by its owner's policy."""

from __future__ import annotations

import ast
import threading

import pytest

from ragkv import LLM
from ragkv.blend import (
    DEFAULT_RATIO,  # tests of blending mechanics: an explicit ratio (outside the fidelity gate)
    ChunkNotFoundError,
    ChunkResolver,
)
from ragkv.engine import Engine, EngineConfig
from ragkv.generate import SamplingParams
from ragkv.rag import RAG
from ragkv.store import MemoryStore
from tests.helpers import PACKAGE_FOLDERS, REPO, source_files, stories_model


@pytest.fixture
def rag(tmp_path, embedder, one_thread):
    r = RAG(LLM(stories_model()), tmp_path, embedder=embedder, chunk_tokens=64, top_k=3, ratio=DEFAULT_RATIO)
    r.ingest([{"id": "d", "text": "Tom had a big red kite. " * 20}], show_progress=False)
    yield r
    r.close()


def _deleted_while_computing(rag, run) -> None:
    """Drop the stored KV of a document's chunks, hold the write-back thread, run a query through
    ``run(recs)`` (it recomputes them and queues write-backs), delete the document, release."""
    recs = rag.index.chunks_of("d")
    for r in recs:
        rag.store.delete(r.kv_key)
    gate = threading.Event()
    rag.resolver._writer.submit(gate.wait)
    run(recs)
    rag.delete_document("d")
    gate.set()
    rag.flush()


def test_engine_of_a_rag_cannot_resurrect_a_deleted_documents_kv(rag):
    """Bug: the engine had its own provider that stored whatever it computed, unguarded, so a chunk
    deleted while an engine query ran got its KV back (and nothing ever collected it)."""

    def run(recs):
        with Engine(rag.model, EngineConfig(num_blocks=200), resolver=rag.resolver) as eng:
            out = eng.generate(
                [
                    {
                        "prefix": [1],
                        "chunks": [list(r.token_ids) for r in recs],
                        "question": [5, 6],
                        "params": SamplingParams(max_new_tokens=2),
                    }
                ]
            )
        assert len(out[0].token_ids) == 2

    _deleted_while_computing(rag, run)
    assert rag.store.keys() == []


def test_llm_of_a_rag_writes_back_by_the_rags_policy(rag):
    """``rag.llm`` shares the RAG's resolver: its computed KV is guarded by the index too."""

    def run(recs):
        rag.llm.generate([1], [list(r.token_ids) for r in recs], [5, 6], max_new_tokens=2)

    _deleted_while_computing(rag, run)
    assert rag.store.keys() == []


def test_bare_resolver_memory_store_and_compute_order():
    model = stories_model()
    store = MemoryStore()
    res = ChunkResolver(model, store, background_writes=False, cache_bytes=0)
    ids = [5, 6, 7, 8]
    kv = res.kv(ids)  # not stored: computed, then written back (a bare store's policy: always)
    assert res.counters["computed"] == 1 and store.contains(kv.key)
    again = res.kv(ids)  # no memory cache: read from the store
    assert res.counters["kv_hits"] == 1 and res.counters["computed"] == 1
    assert again.k.equal(kv.k)
    items = res.items([ids, [9, 10, 11]])
    assert items.hits == 1 and len(items.computed) == 1
    with pytest.raises(ChunkNotFoundError):
        res.stored_kv("ab" * 32)
    with pytest.raises(ChunkNotFoundError):
        res.kv([12, 13], compute_missing=False)


def test_a_key_that_is_not_the_chunks_content_key_is_never_looked_up():
    model = stories_model()
    store = MemoryStore()
    res = ChunkResolver(model, store, background_writes=False)
    other = res.kv([20, 21, 22])  # stored under its own key
    items = res.items([([5, 6, 7], other.key)])  # a caller names another chunk's key
    assert items.hits == 0 and items.computed[0].token_ids.tolist() == [5, 6, 7]


def test_programming_errors_in_write_back_are_logged_not_swallowed(caplog):
    model = stories_model()

    def broken(_kv):
        raise TypeError("a bug")

    res = ChunkResolver(model, MemoryStore(), write_back=broken, background_writes=False)
    res.compute([5, 6, 7])
    assert res.counters["write_back_failures"] == 1
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)


# the modules allowed to read chunk KV from a store or compute it (everything else asks the resolver)
KV_READERS = {
    "ragkv/blend/resolver.py",  # the resolver
    "ragkv/model/forward.py",  # compute_chunk_kv itself
    "ragkv/blend/gate.py",  # the self-check's own probe chunks, not a prompt's
    "ragkv/model/rope_energy.py",  # calibration KV (RoPE key-block energies of demo chunks), not a prompt's
    "ragkv/fidelity/measure.py",  # the fidelity report's calibration prompts, measured apart from any store
    "ragkv/adapter/train.py",  # the adapter's training prompts, computed apart from any store
    "ragkv/rag/quotas.py",  # one sample chunk's KV, to measure the codec's bytes per token for quotas
    "ragkv/blend/pipeline.py",  # StoredChunk: the lazy reader the resolver hands out
    "ragkv/blend/kvtree.py",  # the exact KV tree's own store pages (prompt prefixes), not chunk KV
    "integrations/vllm/ragkv_vllm/connector.py",  # runs inside vLLM's worker, over vLLM's paged KV
}


def test_only_the_resolver_reads_or_computes_chunk_kv():
    """One resolver: no other module of the library, the service or the integrations calls
    ``compute_chunk_kv``, builds a ``StoredChunk`` or reads whole chunk KV with ``store.get``."""
    bad = []
    for folder in PACKAGE_FOLDERS:  # the core and every distribution; a missing folder fails here
        for f in source_files(folder):
            rel = f.relative_to(REPO).as_posix()
            if rel in KV_READERS:
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                store_get = (
                    name == "get"
                    and isinstance(fn, ast.Attribute)
                    and isinstance(fn.value, ast.Attribute)
                    and fn.value.attr == "store"
                )
                if name in ("compute_chunk_kv", "StoredChunk") or store_get:
                    bad.append(f"{rel}:{node.lineno} {name}")
    assert not bad, bad


# ---- KV lifecycle: collection and the size bound ---------------------------------------------------
def test_collect_garbage_deletes_only_unreferenced_kv(rag):
    from ragkv.model.forward import compute_chunk_kv

    kept = set(rag.store.keys())
    assert kept and kept == {r.kv_key for r in rag.index.all_chunks()}
    stray = compute_chunk_kv(rag.model, [7, 8, 9])  # e.g. a cache written by another path
    pending = compute_chunk_kv(rag.model, [10, 11])  # an ingest's KV before its commit
    rag.store.put(stray)
    rag.store.put(pending)
    rag.index.add_intents([pending.key])
    dry = rag.collect_garbage(dry_run=True)
    assert dry["unreferenced"] == 1 and dry["deleted"] == 0 and rag.store.contains(stray.key)
    rep = rag.collect_garbage()
    assert rep["deleted"] == 1 and rep["bytes_freed"] > 0
    assert set(rag.store.keys()) == kept | {pending.key}


def test_bounded_store_evicts_unreferenced_first_and_refuses_rather_than_drop_referenced(tmp_path):
    from ragkv.model.forward import compute_chunk_kv
    from ragkv.store import LocalDirStore

    model = stories_model()
    kvs = [compute_chunk_kv(model, [5 + i, 6, 7, 8]) for i in range(4)]
    probe = LocalDirStore(tmp_path / "probe")
    probe.put(kvs[0])
    size = probe.nbytes()  # one blob (all four have the same shape)
    store = LocalDirStore(tmp_path / "kv", max_bytes=int(size * 2.5))
    pinned = {kvs[0].key, kvs[1].key}
    store.pinned = pinned.__contains__
    assert store.put(kvs[0]) and store.put(kvs[1])  # two referenced blobs fit
    assert not store.put(kvs[2])  # a third only fits by dropping referenced KV: refused, clearly
    assert store.stats()["full"] == 1 and set(store.keys()) == pinned
    pinned.discard(kvs[0].key)  # its document was deleted: now it may go
    assert store.put(kvs[3])
    assert set(store.keys()) == {kvs[1].key, kvs[3].key} and store.stats()["evictions"] == 1


def test_default_store_of_a_rag_is_bounded_and_pinned_by_its_index(rag):
    from ragkv.store import DEFAULT_FILE_STORE_MAX_BYTES

    assert rag.store.max_bytes == DEFAULT_FILE_STORE_MAX_BYTES
    key = rag.index.chunks_of("d")[0].kv_key
    assert rag.store.pinned(key) and not rag.store.pinned("ab" * 32)


# ---- the gate wherever blending can happen ------------------------------------------------------------
def test_a_bare_model_is_gated_before_its_first_blend():
    """Bug: ``ragkv.load_model`` + ``ragkv.prefill`` (and ``Engine("name")``) blended with no self-check."""
    from ragkv.blend import prefill
    from ragkv.blend.gate import gate_report, gate_state
    from ragkv.model import load_model
    from ragkv.model.forward import compute_chunk_kv
    from tests.helpers import stories_path

    model = load_model(str(stories_path()))
    assert gate_state(model) == "pending"
    prefill(model, [1, 5], [[6, 7, 8]], [9], "full")  # full prefill needs no gate
    assert gate_state(model) == "pending"
    prefill(model, [1, 5], [compute_chunk_kv(model, [6, 7, 8])], [9], "blend")
    assert gate_state(model) == "passed" and gate_report(model).ok
