"""Ingest a QA set's passages with ragkv (chunk KV stored), then ask its questions through a vLLM server.

Used by ``serve_and_query.sh`` (a GPU machine with vLLM and the ragkv plugin)::

    python -m ragkv_vllm.examples.rag_vllm ingest --model M --dtype bfloat16 --device cuda \
        --data-dir DIR --store file:///path/kv --dataset musique_s.json -n 20
    python -m ragkv_vllm.examples.rag_vllm query --model M --dtype bfloat16 --data-dir DIR \
        --store file:///path/kv --dataset musique_s.json -n 20 --url http://127.0.0.1:8000

``query`` asks every question twice, ``full`` (no KV reuse: vLLM prefills everything) and ``blend``
(the connector blends the stored chunk KV), streaming the answers, prints per-question answers, F1,
time to first token and server seconds, and ends with one JSON line. It loads the model on CPU only
for tokenization (prompt parts). ``--url`` may also be a ragkv service (``python -m ragkv_server.server``),
which serves the same ``/v1/completions`` with ``kv_transfer_params`` in process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _rag(args, device: str):
    from ragkv.llm import LLM
    from ragkv.rag import RAG

    llm = LLM(args.model, dtype=args.dtype, device=device, self_check_on_load=False)
    return RAG(llm, args.data_dir, store=args.store, top_k=args.k, chunk_tokens=args.chunk_tokens)


def _items(args) -> list[dict]:
    with open(args.dataset) as f:
        return json.load(f)[: args.n]


def ingest(args) -> int:
    from ragkv.rag import Document

    rag = _rag(args, args.device)
    docs = {}
    for item in _items(args):
        for c in item["ctxs"]:
            text = f"{c['title']}\n{c['text']}".strip()
            doc = Document(text)
            docs[doc.id] = doc
    t0 = time.perf_counter()
    rep = rag.ingest(list(docs.values()))
    print(
        f"ingested {len(docs)} passages: {rep.chunks_added} chunks, {rep.kv_computed} KV computed, "
        f"{rep.kv_already_stored} already stored, {time.perf_counter() - t0:.1f} s"
    )
    rag.close()
    return 0


def query(args) -> int:
    from ragkv.metrics import max_over_golds, token_f1
    from ragkv.remote.client import VllmClient, VllmGenerator

    rag = _rag(args, "cpu")
    rag.generator = VllmGenerator(VllmClient(args.url, timeout=600))
    rows = []
    for item in _items(args):
        q, golds = item["question"], item["answers"]
        chunks = rag.retrieve(q, args.k)
        res = {}
        for mode in ("full", "blend"):
            ans = rag.answer(
                q, mode=mode, ratio=args.ratio, chunks=chunks, max_new_tokens=args.max_new_tokens
            )
            f1 = max_over_golds(token_f1, ans.text, golds)
            res[mode] = (ans.text.strip(), f1, ans.timings["server_s"], ans.timings["ttft_s"])
        rows.append(res)
        print(
            f"Q: {q}\n  gold: {golds[0]!r}\n  full : {res['full'][0]!r} (F1 {res['full'][1]:.2f}, "
            f"{res['full'][2]:.3f} s)\n  blend: {res['blend'][0]!r} (F1 {res['blend'][1]:.2f}, {res['blend'][2]:.3f} s)"
        )
    f1 = {m: statistics.mean(r[m][1] for r in rows) for m in ("full", "blend")}
    sec = {m: statistics.median(r[m][2] for r in rows) for m in ("full", "blend")}
    ttft = {m: statistics.median(r[m][3] for r in rows) for m in ("full", "blend")}
    print(f"{'mode':6} {'mean F1':>8} {'median TTFT s':>14} {'median server s':>16}")
    for m in ("full", "blend"):
        print(f"{m:6} {f1[m]:8.3f} {ttft[m]:14.3f} {sec[m]:16.3f}")
    print(
        json.dumps(
            {
                "n": len(rows),
                "f1_full": f1["full"],
                "f1_blend": f1["blend"],
                "server_s_full": sec["full"],
                "server_s_blend": sec["blend"],
                "ttft_s_full": ttft["full"],
                "ttft_s_blend": ttft["blend"],
                "speedup_ttft": ttft["full"] / ttft["blend"] if ttft["blend"] else None,
                "speedup_server_s": sec["full"] / sec["blend"] if sec["blend"] else None,
            }
        )
    )
    rag.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("ingest", "query"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    args = ap.parse_args(argv)
    return ingest(args) if args.command == "ingest" else query(args)


if __name__ == "__main__":
    sys.exit(main())
