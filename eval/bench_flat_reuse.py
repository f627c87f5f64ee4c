"""Transparent reuse on the real model: a flat prompt formatted the LangChain way vs ragkv's explicit chunks.

For each MuSiQue question, its passages are ingested (one document each), then answered three ways
by the same ``ragkv.LLM``: ``full`` (flat prompt, everything prefilled), ``flat`` (the same flat
prompt in blend mode: the stored chunks are found inside it, :mod:`ragkv.blend.locate`) and
``explicit`` (the passages given as ``chunks=``). It reports the share of chunk tokens reused from
stored KV, whether the greedy answers agree, TTFT, and the locator's own time on the flat prompt
and on a prompt with no stored chunk (vs full prefill). Ends with one JSON line.

    python -m eval.bench_flat_reuse --questions 8 --passages 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from eval.prompts import DATA_DIR
from ragkv import LLM
from ragkv.rag import RAG


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--passages", type=int, default=5, help="passages per question")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    samples = json.loads((DATA_DIR / "musique_s.json").read_text())[: args.questions]
    llm = LLM()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        rag = RAG(llm, d, chunk_tokens=512)
        for i, s in enumerate(samples):
            texts = [f"{c['title']}\n{c['text']}" for c in s["ctxs"][: args.passages]]
            rag.ingest([{"id": f"q{i}p{j}", "text": t} for j, t in enumerate(texts)], show_progress=False)
            recs = [r for j in range(len(texts)) for r in rag.index.chunks_of(f"q{i}p{j}")]
            context = "\n\n".join(r.text for r in recs)  # LangChain's usual format_docs
            flat = f"Answer the question using the passages.\n\n{context}\n\nQuestion: {s['question']}"
            out = {}
            for name, kw in (
                ("full", dict(prefix="", chunks=[], question=flat, mode="full")),
                ("flat", dict(prefix="", chunks=[], question=flat, mode="blend")),
                (
                    "explicit",
                    dict(
                        prefix="Answer the question using the passages.\n\n",
                        chunks=[r.text for r in recs],
                        question=f"\n\nQuestion: {s['question']}",
                        mode="blend",
                    ),
                ),
            ):
                a = llm.generate(**kw, max_new_tokens=args.max_new_tokens)
                out[name] = a
            chunk_tokens = sum(len(r.token_ids) for r in recs)
            ids = llm.model.encode(flat)
            loc = rag.chunk_locator()
            t0 = time.perf_counter()
            loc.find(ids)
            t_find = time.perf_counter() - t0
            t0 = time.perf_counter()
            loc.find([t + 7 for t in ids])  # a prompt of the same length with no stored chunk
            t_none = time.perf_counter() - t0
            row = {
                "question": i,
                "prompt_tokens": out["full"].stats["num_tokens"],
                "reused_share": out["flat"].stats["num_reused_rows"] / chunk_tokens,
                "located_chunks": out["flat"].stats.get("located_chunks", 0),
                "chunks": len(recs),
                "flat_same_as_explicit": out["flat"].token_ids == out["explicit"].token_ids,
                "flat_same_as_full": out["flat"].token_ids == out["full"].token_ids,
                "explicit_same_as_full": out["explicit"].token_ids == out["full"].token_ids,
                "ttft_full_s": out["full"].ttft_s,
                "ttft_flat_s": out["flat"].ttft_s,
                "ttft_explicit_s": out["explicit"].ttft_s,
                "locate_s": t_find,
                "locate_no_chunk_over_full": t_none / out["full"].ttft_s,
            }
            rows.append(row)
            print(
                f"q{i}: {row['prompt_tokens']} tokens, reused {row['reused_share']:.2f} of chunk tokens "
                f"({row['located_chunks']}/{row['chunks']} chunks), flat==explicit {row['flat_same_as_explicit']}, "
                f"flat==full {row['flat_same_as_full']}, explicit==full {row['explicit_same_as_full']}, TTFT full "
                f"{row['ttft_full_s']:.2f} s flat {row['ttft_flat_s']:.2f} s explicit {row['ttft_explicit_s']:.2f} s",
                flush=True,
            )
        rag.close()

    def mean(k):
        return statistics.fmean(float(r[k]) for r in rows)

    summary = {
        "questions": len(rows),
        "reused_share_mean": mean("reused_share"),
        "reused_share_min": min(r["reused_share"] for r in rows),
        "flat_same_as_explicit": mean("flat_same_as_explicit"),
        "flat_same_as_full": mean("flat_same_as_full"),
        "explicit_same_as_full": mean("explicit_same_as_full"),
        "ttft_full_median_s": statistics.median(r["ttft_full_s"] for r in rows),
        "ttft_flat_median_s": statistics.median(r["ttft_flat_s"] for r in rows),
        "ttft_explicit_median_s": statistics.median(r["ttft_explicit_s"] for r in rows),
        "locate_no_chunk_over_full_max": max(r["locate_no_chunk_over_full"] for r in rows),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
