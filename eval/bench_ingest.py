"""Ingest throughput: the Ray Data pipeline against the single-process ingest on the same passages, and
the prefill bound (issue 53).

On ``--docs`` unique MuSiQue and 2WikiMQA passages (``data/``; ``--synthetic N`` adds N synthetic ones),
each arm ingests into a fresh data folder (split, embed, chunk KV into the store, the KV tree's first
level, commit), ``--repeats`` times, side by side:

* ``single``: :meth:`ragkv.rag.RAG.ingest` in this process;
* ``ray``: :func:`ragkv.rag.distributed.ingest_dataset` on a local Ray of ``--cpus`` CPUs (one chunk-KV
  actor, one embedding actor), end to end: actors start (each loads the model) within the timed run;
  ``ray_startup_s`` is the same pipeline on one document (the fixed cost), and ``ray_steady_docs_per_s``
  the rate once it is paid;
* ``prefill bound``: the model's forward passes ingest needs on the same chunks, no I/O, no embedding
  (each chunk's KV, and its exact pass after the cached prompt head): the ceiling.

Then, once each (``--no-faults`` skips them): a Ray run whose chunk-KV worker is killed (``kill -9``)
mid-way (documents acknowledged and lost), and ``ragkv-server ingest --ray`` killed mid-way and started
again (documents acknowledged before the kill and lost, chunks computed twice: computed by the second run
although stored before it started). Prints a table and ends with one JSON line.

    nice -n 10 python -m eval.bench_ingest --docs 24 --repeats 3          # the default model
    nice -n 10 python -m eval.bench_ingest --model models/stories260k --docs 60   # the tiny model
    python -m eval.bench_ingest --cpus 16 --kv-actors 8 --threads 2 --docs 2000    # scaling on a larger machine

Goal (issue 53): ``ray_over_single >= 0.9`` on 2 cores, ``ray_over_prefill_bound`` within 1.3x;
killed worker / killed driver: 0 acknowledged documents lost, 0 chunks computed twice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ragkv.cli import set_threads
from ragkv.model.registry import DEFAULT_MODEL
from ragkv.testing import committed_documents, data_dir, descendants_named, synthetic_docs


def passages(n: int, synthetic: int = 0) -> list[dict]:
    """The first ``n`` unique passages of the MuSiQue and 2WikiMQA samples, then ``synthetic`` more."""
    seen: dict[str, None] = {}
    for name in ("musique_s.json", "wikimqa_s_clean.json"):
        for s in json.loads((data_dir() / name).read_text()):
            for c in s["ctxs"]:
                seen.setdefault(c["text"].strip(), None)
    texts = list(seen)[:n]
    docs = [{"id": f"p{i}", "text": t} for i, t in enumerate(texts)]
    return docs + [{"id": f"syn{i}", "text": d["text"]} for i, d in enumerate(synthetic_docs(synthetic))]


class Bench:
    """The model and embedder loaded once; each run gets a fresh data folder under ``work``."""

    def __init__(self, model: str, work: Path, threads: str = "auto"):
        from ragkv.llm import LLM
        from ragkv.rag import Embedder

        self.work = work
        self.model = LLM(model).model
        set_threads(threads, self.model.config.hidden_size)  # both arms (the Ray workers take this count)
        self.embedder = Embedder()
        self.n = 0

    def rag(self):
        from ragkv.llm import LLM
        from ragkv.rag import RAG

        self.n += 1
        # 512-token chunks (the default), fewer on a model of a short context (the tiny one: 128)
        chunk = min(512, self.model.config.max_position // 4)
        return RAG(LLM(self.model), self.work / f"run-{self.n}", embedder=self.embedder, chunk_tokens=chunk)

    def single(self, docs: list[dict]) -> float:
        rag = self.rag()
        t0 = time.perf_counter()
        rep = rag.ingest(docs, show_progress=False)
        rag.kv_tree.flush()  # the first level's pages written, as the pipeline's workers wait for them
        dt = time.perf_counter() - t0
        assert rep.documents_added == len(docs), rep
        rag.close()
        return dt

    def ray(self, docs: list[dict], **kw) -> tuple[float, object]:
        from ragkv.rag.distributed import ingest_dataset

        rag = self.rag()
        t0 = time.perf_counter()
        rep = ingest_dataset(docs, rag, show_progress=False, **kw)
        dt = time.perf_counter() - t0
        rag.close()
        return dt, rep

    def prefill_bound(self, docs: list[dict]) -> tuple[float, int]:
        """Seconds of the forward passes ingest runs on these documents' chunks (chunk KV, then the
        exact pass after the cached head), no store, no embedding; and the chunk tokens."""
        from ragkv.blend.exact import exact_prefill
        from ragkv.blend.kvtree import KVTree
        from ragkv.model.forward import compute_chunk_kv
        from ragkv.rag import split_tokens

        rag = self.rag()
        head, _ = rag.answers.prompt_parts("?")
        chunks = [
            list(c.token_ids)
            for d in docs
            for c in split_tokens(self.model.tokenizer, d["text"], rag.chunk_tokens)
        ]
        rag.close()
        tree = KVTree(1 << 30, store=None)
        with torch.inference_mode():
            exact_prefill(self.model, head + chunks[0], tree, boundaries=[len(head)])  # the head, cached
            t0 = time.perf_counter()
            for ids in chunks:
                compute_chunk_kv(self.model, ids)
                exact_prefill(self.model, head + ids, tree, boundaries=[len(head)], commit_answer=False)
            dt = time.perf_counter() - t0
        return dt, sum(len(c) for c in chunks)


def killed_worker_run(b: Bench, docs: list[dict]) -> dict:
    """A Ray run whose chunk-KV worker is killed once it has stored some KV."""
    from ragkv.rag.distributed import ingest_dataset

    rag = b.rag()
    out: dict = {}
    t = threading.Thread(
        target=lambda: out.update(
            rep=ingest_dataset(docs, rag, batch_size=2, commit_every=4, show_progress=False)
        )
    )
    t.start()
    killed = 0
    while t.is_alive() and not killed:
        pids = descendants_named("ChunkKV")  # the local Ray's chunk-KV worker
        if pids and len(rag.store.keys()) >= 3:
            os.kill(pids[0], signal.SIGKILL)
            killed = 1
        time.sleep(0.05)
    t.join()
    committed = set(rag.list_documents())
    rag.close()
    rep = out["rep"]
    return {
        "killed_workers": killed,
        "acked": len(rep.doc_ids),
        "lost": len({d["id"] for d in docs} - committed),
        "errors": len(rep.errors),
    }


def killed_driver_run(model: str, docs: list[dict], work: Path, address: str) -> dict:
    """``ragkv-server ingest --ray`` killed (``kill -9``) once some documents are committed, then run
    again: acknowledged documents lost, and chunks the second run computed though stored before it."""
    data, kv = work / "driver" / "data", work / "driver" / "kv"
    f = work / "driver.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cmd = [sys.executable, "-m", "ragkv_server.cli", "ingest", str(f), "--ray", "--address", address, "-q"]
    cmd += [
        "--data-dir",
        str(data),
        "--store",
        f"file://{kv}?codec=raw",
        "--model",
        model,
        "--commit-every",
        "2",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and committed_documents(data) < 2:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked = committed_documents(data)
    time.sleep(5.0)  # the dead driver's workers go with its job
    stored = {p.name for p in kv.glob("??/*.kvb")}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    new = {p.name for p in kv.glob("??/*.kvb")} - stored
    return {
        "driver_acked_before_kill": acked,
        "driver_lost": acked - rep["documents_unchanged"],
        "computed_twice": max(0, rep["kv_computed"] - len(new)),
        "driver_restart_added": rep["documents_added"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--synthetic", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument(
        "--threads",
        default="auto",
        help="torch threads of both arms (auto: torch's default; 1 on a machine others load: two "
        "threads on two busy cores spin in OpenMP barriers)",
    )
    ap.add_argument(
        "--kv-actors",
        type=int,
        default=1,
        help="chunk-KV actors of the Ray arm (scaling: one per --threads x cores)",
    )
    ap.add_argument("--no-faults", action="store_true")
    args = ap.parse_args(argv)
    import ray

    load_before = os.getloadavg()
    docs = passages(args.docs, args.synthetic)
    work = Path(tempfile.mkdtemp(prefix="ragkv-bench-ingest-"))
    try:
        b = Bench(args.model, work, args.threads)
        ray.init(
            num_cpus=args.cpus, object_store_memory=300 << 20, include_dashboard=False, log_to_driver=False
        )
        b.single(docs[:2])  # warm-up: the exactness self-check, the embedder's first call
        bound_s, tokens = b.prefill_bound(docs)
        startup_s, _ = b.ray(docs[:1], kv_actors=args.kv_actors)
        single_s, ray_s = [], []
        for r in range(args.repeats):  # side by side, alternating
            single_s.append(b.single(docs))
            dt, rep = b.ray(docs, kv_actors=args.kv_actors)
            assert rep.documents_added == len(docs) and not rep.errors, rep
            ray_s.append(dt)
            print(f"repeat {r + 1}: single {single_s[-1]:.1f} s, ray {ray_s[-1]:.1f} s", flush=True)
        single, rayt = statistics.median(single_s), statistics.median(ray_s)
        n = len(docs)
        res = {
            "model": args.model,
            "documents": n,
            "chunk_tokens": tokens,
            "repeats": args.repeats,
            "cpus": args.cpus,
            "threads": torch.get_num_threads(),
            "kv_actors": args.kv_actors,
            "single_s": round(single, 2),
            "ray_s": round(rayt, 2),
            "ray_startup_s": round(startup_s, 2),
            "prefill_bound_s": round(bound_s, 2),
            "single_docs_per_s": round(n / single, 3),
            "ray_docs_per_s": round(n / rayt, 3),
            "ray_steady_docs_per_s": round(n / max(rayt - startup_s, 1e-9), 3),
            "prefill_bound_docs_per_s": round(n / bound_s, 3),
            "single_tokens_per_s": round(tokens / single, 1),
            "ray_tokens_per_s": round(tokens / rayt, 1),
            "ray_over_single": round(single / rayt, 3),
            "ray_steady_over_single": round(single / max(rayt - startup_s, 1e-9), 3),
            "ray_over_prefill_bound": round(rayt / bound_s, 3),
            "single_over_prefill_bound": round(single / bound_s, 3),
        }
        if not args.no_faults:
            res.update(killed_worker_run(b, docs))
            res.update(killed_driver_run(args.model, docs, work, ray.get_runtime_context().gcs_address))
        ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_avg_before"] = [round(x, 2) for x in load_before]
    res["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(
        f"\n{n} documents, {tokens} chunk tokens, medians of {args.repeats} ({args.model}, {args.cpus} Ray CPUs)"
    )
    print(f"{'arm':<16}{'seconds':>10}{'docs/s':>10}{'tokens/s':>11}")
    print(f"{'single':<16}{single:>10.2f}{n / single:>10.2f}{tokens / single:>11.1f}")
    print(f"{'ray':<16}{rayt:>10.2f}{n / rayt:>10.2f}{tokens / rayt:>11.1f}")
    print(f"{'ray (steady)':<16}{rayt - startup_s:>10.2f}{res['ray_steady_docs_per_s']:>10.2f}")
    print(f"{'prefill bound':<16}{bound_s:>10.2f}{n / bound_s:>10.2f}{tokens / bound_s:>11.1f}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
