"""Index persistence cost: adding one small document to a large index (85K chunks by default).

Builds a :class:`ragkv.rag.ChunkIndex` of ``--chunks`` chunks with random 384-dimensional vectors (the
MiniLM size), then adds ``--adds`` one-document, ``--doc-chunks``-chunk documents one at a time and
times each ``add_document`` (the SQLite transaction with its vectors, fsynced, plus the in-memory FAISS
add). For comparison it times what the old index did on every add: rewriting the whole FAISS file;
and the periodic snapshot the new index writes every ``max(4096, chunks / 8)`` changes. Also the
start-up time (snapshot read + reconciliation with SQLite). Ends with one JSON line.

    python -m eval.bench_index                # 85,000 chunks
    python -m eval.bench_index --chunks 20000 # quicker
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _doc(i: int, n: int, rng: np.random.Generator, dim: int):
    from ragkv.rag.index import PendingDocument

    chunks = [
        (s, f"document {i} chunk {s} " + "lorem ipsum " * 20, list(range(s, s + 64)), f"k{i:07d}{s:04d}")
        for s in range(n)
    ]
    return PendingDocument(f"doc-{i}", f"sha-{i}", {"n": i}, chunks, _vectors(rng, n, dim))


def main(argv: list[str] | None = None) -> dict:
    from ragkv.rag import ChunkIndex

    ap = argparse.ArgumentParser(prog="python -m eval.bench_index", description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=85_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--adds", type=int, default=30)
    ap.add_argument("--doc-chunks", type=int, default=4)
    ap.add_argument("--dir", type=Path, help="work directory (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ragkv-bench-index-"))
    rng = np.random.default_rng(0)
    try:
        idx = ChunkIndex(work / "index", args.dim)
        t0 = time.perf_counter()
        per_doc, i = 100, 0
        while len(idx) < args.chunks:
            batch = [
                _doc(i + j, min(per_doc, args.chunks - len(idx) - j * per_doc), rng, args.dim)
                for j in range(50)
            ]
            batch = [d for d in batch if d.chunks]
            idx.commit(batch)
            i += len(batch)
        idx.snapshot()
        build_s = time.perf_counter() - t0
        print(f"built {len(idx)} chunks in {build_s:.1f} s")
        adds = []
        for k in range(args.adds):
            d = _doc(10_000_000 + k, args.doc_chunks, rng, args.dim)
            t = time.perf_counter()
            idx.add_document(d.doc_id, d.sha, d.metadata, d.chunks, d.vectors)
            adds.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        idx.delete_document(f"doc-{10_000_000}")
        delete_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        idx.snapshot()
        snapshot_ms = (time.perf_counter() - t) * 1000
        import faiss

        t = time.perf_counter()
        faiss.write_index(idx.vectors, str(work / "old-style.faiss"))  # what every add used to cost
        rewrite_ms = (time.perf_counter() - t) * 1000
        every = max(4096, len(idx) // 8)
        # kill-like reopen: a few adds after the snapshot are only in SQLite
        for k in range(5):
            d = _doc(20_000_000 + k, args.doc_chunks, rng, args.dim)
            idx.commit([d])
        idx.db.close()
        t = time.perf_counter()
        again = ChunkIndex(work / "index", args.dim)
        startup_s = time.perf_counter() - t
        assert len(again) == len(idx) and again.vectors.ntotal == len(idx)
        again.close()
        adds_sorted = sorted(adds)
        out = {
            "chunks": len(idx),
            "doc_chunks": args.doc_chunks,
            "add_ms_median": round(statistics.median(adds), 2),
            "add_ms_p95": round(adds_sorted[int(0.95 * (len(adds) - 1))], 2),
            "add_ms_max": round(max(adds), 2),
            "delete_ms": round(delete_ms, 1),
            "snapshot_ms": round(snapshot_ms, 1),
            "snapshot_every_changes": every,
            "amortized_snapshot_ms_per_add": round(snapshot_ms * args.doc_chunks / every, 2),
            "old_full_rewrite_ms": round(rewrite_ms, 1),
            "startup_s": round(startup_s, 2),
            "build_s": round(build_s, 1),
        }
        print(
            f"add one {args.doc_chunks}-chunk document to {len(idx)} chunks: median {out['add_ms_median']} ms, "
            f"p95 {out['add_ms_p95']} ms, max {out['add_ms_max']} ms (SQLite transaction, fsynced, + FAISS add)"
        )
        print(
            f"delete one document: {out['delete_ms']} ms (FAISS remove_ids compacts the flat index in memory)"
        )
        print(
            f"snapshot every {every} changes: {out['snapshot_ms']} ms "
            f"(~{out['amortized_snapshot_ms_per_add']} ms per add amortized); "
            f"old full rewrite on every add: {out['old_full_rewrite_ms']} ms"
        )
        print(f"start-up (snapshot + reconcile with SQLite): {out['startup_s']} s")
        print(json.dumps(out))
        return out
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
