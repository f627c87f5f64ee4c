"""Crash test: ``kill -9`` at random points of an ingest, then check that nothing acknowledged is lost.

A child process ingests synthetic documents one call at a time into a data directory and prints
``ACK <id>`` after each ``RAG.ingest`` returns (the acknowledgement a client would get). The parent
kills it with SIGKILL after a random number of acknowledgements plus a random delay (so the kill
lands anywhere: computing KV, embedding, inside the commit, writing a snapshot ...), re-opens the
directory (start-up recovery runs), and checks:

* every acknowledged document is listed, whole (its chunks are exactly those of a fresh split) and
  retrievable (searching with a chunk's own text finds that chunk);
* every listed document is whole (nothing half-written is listed);
* no orphans: no temporary files in the index or the store, no stored KV blob that no chunk uses,
  no write-ahead intent left over.

After the rounds, a last child finishes the ingest and the answers to a few questions (greedy) are
compared with those of a clean ingest of the same documents in a fresh directory.

    python -m eval.faults                 # 5 rounds, 40 documents
    python -m eval.faults --soak          # 20 rounds, 100 documents (docs/BENCHMARKS.md)

Ends with one JSON line. ``apps/tests/test_faults.py`` runs a few rounds in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragkv.testing import WORDS  # noqa: F401  (eval.bench_ingest_load's words)
from ragkv.testing import synthetic_docs as make_docs

REPO = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 64


def default_model() -> str:
    """The repository's tiny stories model: kill -9 rounds test the index and store, not the model."""
    from eval.prompts import TINY_MODEL

    return str(TINY_MODEL)


def make_rag(data: Path, model: str, embedder=None):
    """The RAG every process of this test uses (same chunking, so answers can be compared)."""
    from ragkv import LLM
    from ragkv.rag import RAG, Embedder

    return RAG(
        LLM(model), data, embedder=embedder or Embedder(), chunk_tokens=CHUNK_TOKENS, top_k=3, ingest_batch=4
    )


# ---- the child -----------------------------------------------------------------------------------
def child(data: Path, model: str, n_docs: int, seed: int) -> None:
    """Ingest the documents one call at a time, acknowledging each on stdout."""
    import torch

    torch.set_num_threads(1)
    rag = make_rag(data, model)
    print("READY", flush=True)
    for d in make_docs(n_docs, seed):
        if not rag.index.has_document(d["id"]):
            print(f"START {d['id']}", flush=True)  # a new document: the parent aims its kills at these
        rag.ingest([d], show_progress=False)
        print(f"ACK {d['id']}", flush=True)
    rag.close()
    print("DONE", flush=True)


class _LogLines:
    """A forked child's output as it arrives: the lines of its log file, until the child exits."""

    def __init__(self, path: Path, proc) -> None:
        self.file = path.open()
        self.proc = proc

    def __iter__(self):
        pending = ""
        while True:
            part = self.file.readline()
            if part:
                pending += part
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                continue
            if self.proc.poll() is not None:  # exited: what it wrote last, then the end
                yield from (pending + self.file.read()).splitlines(keepends=True)
                return
            time.sleep(0.005)

    def read(self) -> str:
        return self.file.read()

    def close(self) -> None:
        self.file.close()


class _ForkedChild:
    """The child forked from the test harness's fork server (:func:`eval.harness.fork_module`: the
    imports done once) with the ``Popen`` calls :func:`kill_round` and :func:`run` use; its output
    is read from its log file as it grows."""

    def __init__(self, proc, log: Path) -> None:
        self.proc = proc
        self.stdout = _LogLines(log, proc)

    def __getattr__(self, name: str):
        return getattr(self.proc, name)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.proc.wait(timeout)
        out = "".join(self.stdout)
        self.stdout.close()
        return out, None


def _spawn(data: Path, model: str, n_docs: int, seed: int, fork: bool = False):
    """The child: a fresh interpreter, or (``fork``) a fork of the harness's fork server, which is
    killed the same way but skips ~8 s of imports (the test suite's choice)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = ["child", "--data", str(data), "--model", model, "--docs", str(n_docs), "--seed", str(seed)]
    if fork:
        from eval.harness import fork_module

        log = data.parent / f"child-{time.monotonic_ns()}.log"  # beside the data directory, not in it
        return _ForkedChild(fork_module("eval.faults", argv, env, log), log)
    return subprocess.Popen(
        [sys.executable, "-m", "eval.faults", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def kill_round(
    data: Path,
    model: str,
    n_docs: int,
    seed: int,
    rng: random.Random,
    acked: set[str],
    spread: int,
    fork: bool = False,
) -> dict:
    """One child, SIGKILLed a random delay (0-120 ms: anywhere in that ingest, its commit, or just
    after it) after it starts the ingest of a random one of the next new documents."""
    remaining = n_docs - len(acked)
    target = rng.randint(0, max(0, min(remaining - 1, spread)))  # new documents ingested before the kill
    delay = rng.uniform(0.0, 0.12)
    proc = _spawn(data, model, n_docs, seed, fork)
    started = 0
    killed = False
    try:
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "ACK":
                acked.add(rest)
            elif word == "DONE":
                break
            elif word == "START":
                started += 1
            if word == "START" and started > target:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
    finally:
        if proc.poll() is None and not killed:
            proc.kill()
        proc.wait()
        # lines the child printed before dying still count: a client would have received them
        for line in proc.stdout.read().splitlines():
            word, _, rest = line.strip().partition(" ")
            if word == "ACK":
                acked.add(rest)
        proc.stdout.close()
    return {
        "new_docs_before_kill": target,
        "delay_s": round(delay, 3),
        "killed": killed,
        "acked_total": len(acked),
    }


# ---- checks --------------------------------------------------------------------------------------
def verify(data: Path, model_rag_factory, docs: dict[str, dict], acked: set[str]) -> dict:
    """Open the directory (recovery runs) and count lost, half-written and orphaned things."""
    from ragkv.rag import split_tokens

    rag = model_rag_factory(data)
    try:
        listed = set(rag.index.document_ids())
        lost = sorted(acked - listed)
        broken, unretrievable = [], []
        for doc_id in sorted(listed):
            recs = rag.index.chunks_of(doc_id)
            want = split_tokens(rag.model.tokenizer, docs[doc_id]["text"], rag.chunk_tokens, rag.overlap)
            if [r.token_ids for r in recs] != [list(c.token_ids) for c in want]:
                broken.append(doc_id)
                continue
            probe = recs[len(recs) // 2]
            hits = rag.index.search(rag.embedder.embed([probe.text])[0], 3)
            if probe.chunk_id not in {h.chunk_id for h in hits}:
                unretrievable.append(doc_id)
        used = {r.kv_key for r in rag.index.all_chunks()}
        kv_root = data / "kv"
        on_disk = {p.name[: -len(".kvb")] for p in kv_root.glob("??/*.kvb")}
        tmp_files = [str(p) for p in (data / "index").glob("*.tmp")] + [
            str(p) for p in kv_root.glob("??/.*.tmp")
        ]
        out = {
            "listed": len(listed),
            "lost": lost,
            "half_written": broken,
            "unretrievable": unretrievable,
            "orphan_kv": len(on_disk - used),
            "orphan_tmp": tmp_files,
            "intents_left": len(rag.index.intents()),
            "missing_kv": len(used - on_disk),
        }
    finally:
        rag.close()
    return out


def answers(rag, questions: list[str]) -> list[tuple[str, list[tuple[str, int]]]]:
    """Greedy answers and their sources as (doc id, seq): comparable across directories."""
    out = []
    for q in questions:
        a = rag.answer(q, max_new_tokens=6, temperature=0.0)
        out.append((a.text, [(s.doc_id, s.seq) for s in a.sources]))
    return out


def run(
    rounds: int,
    n_docs: int,
    seed: int = 0,
    model: str | None = None,
    workdir: Path | None = None,
    fork: bool = False,
) -> dict:
    """Kill rounds, the checks after each, a final full ingest, and the comparison with a clean one.
    ``fork``: children forked from a fork server (:func:`_spawn`) instead of fresh interpreters."""
    import torch

    from ragkv.rag import Embedder

    torch.set_num_threads(1)
    model = model or default_model()
    own = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="ragkv-faults-"))
    emb = Embedder()
    docs = {d["id"]: d for d in make_docs(n_docs, seed)}
    data = workdir / "crashed"
    rng = random.Random(seed + 1)
    acked: set[str] = set()
    per_round = []
    totals = {
        "lost": 0,
        "half_written": 0,
        "unretrievable": 0,
        "orphan_kv": 0,
        "orphan_tmp": 0,
        "intents_left": 0,
    }
    t0 = time.perf_counter()
    for i in range(rounds):
        spread = max(1, 2 * n_docs // rounds - 1)
        r = kill_round(data, model, n_docs, seed, rng, acked, spread, fork)
        v = verify(data, lambda d: make_rag(d, model, emb), docs, acked)
        for k in totals:
            totals[k] += len(v[k]) if isinstance(v[k], list) else v[k]
        per_round.append({**r, **{k: v[k] for k in ("listed", "orphan_kv", "intents_left")}})
        print(
            f"round {i + 1:2d}: killed={r['killed']} {r['delay_s']:.3f} s into new document {r['new_docs_before_kill'] + 1}; "
            f"acked {len(acked)}, listed {v['listed']}, lost {len(v['lost'])}, half-written {len(v['half_written'])}, "
            f"unretrievable {len(v['unretrievable'])}, orphan kv {v['orphan_kv']}, tmp {len(v['orphan_tmp'])}",
            flush=True,
        )
    # finish the ingest (no kill), then compare with a clean ingest
    proc = _spawn(data, model, n_docs, seed, fork)
    out_text, _ = proc.communicate(timeout=1800)
    finished = "DONE" in out_text
    final = verify(data, lambda d: make_rag(d, model, emb), docs, set(docs))
    questions = [docs[k]["text"].split(". ")[1] + "?" for k in sorted(docs)[:: max(1, n_docs // 4)]]
    crashed = make_rag(data, model, emb)
    try:
        got = answers(crashed, questions)
    finally:
        crashed.close()
    clean = make_rag(workdir / "clean", model, emb)
    try:
        clean.ingest(list(docs.values()), show_progress=False)
        want = answers(clean, questions)
    finally:
        clean.close()
    identical = got == want
    result = {
        "rounds": rounds,
        "documents": n_docs,
        "kills": sum(r["killed"] for r in per_round),
        "acknowledged_lost": totals["lost"],
        "half_written_listed": totals["half_written"],
        "unretrievable": totals["unretrievable"],
        "orphan_kv_blobs": totals["orphan_kv"],
        "orphan_tmp_files": totals["orphan_tmp"],
        "intents_left": totals["intents_left"],
        "final_complete": finished
        and final["listed"] == n_docs
        and not final["lost"]
        and not final["half_written"],
        "answers_identical_to_clean": identical,
        "questions": len(questions),
        "seconds": round(time.perf_counter() - t0, 1),
        "per_round": per_round,
    }
    if own:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(prog="python -m eval.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("role", nargs="?", default="parent", choices=["parent", "child"])
    ap.add_argument("--soak", action="store_true", help="20 rounds of a 100-document ingest")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model folder (default: the service's default model)")
    ap.add_argument("--data", type=Path, help="child: the data directory")
    args = ap.parse_args(argv)
    if args.role == "child":
        child(args.data, args.model or default_model(), args.docs, args.seed)
        return None
    rounds, n_docs = (20, 100) if args.soak else (args.rounds, args.docs)
    res = run(rounds, n_docs, args.seed, args.model)
    print(
        f"{res['kills']} kills over {rounds} rounds of a {n_docs}-document ingest: "
        f"{res['acknowledged_lost']} acknowledged documents lost, {res['half_written_listed']} half-written listed, "
        f"{res['orphan_kv_blobs']} orphan KV blobs, {res['orphan_tmp_files']} orphan temp files; "
        f"answers identical to a clean ingest: {res['answers_identical_to_clean']} ({res['seconds']} s)"
    )
    print(json.dumps({k: v for k, v in res.items() if k != "per_round"}))
    return res


if __name__ == "__main__":
    main()
