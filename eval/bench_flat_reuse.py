"""Transparent reuse on the real model: a flat prompt formatted a framework's way vs ragkv's explicit chunks.

For each MuSiQue question, its passages are ingested (one document each), then answered three ways
by the same ``ragkv.LLM``: ``full`` (flat prompt, everything prefilled), ``flat`` (the same flat
prompt in blend mode: the stored chunks are found inside it, :mod:`ragkv.blend.locate`) and
``explicit`` (the same prompt *text*, with each passage's span given as a stored chunk: its tokens
are the chunk's own, the text around them tokenized apart, through ``RAG.job(..., locate=False)``).
``prompt_ids_equal`` says whether the flat prompt tokenized to exactly the explicit ids (it differs
only where a token would cross a chunk's edge); where they are equal, the two prefills are the same
job. It also reports the share of chunk tokens reused from stored KV, whether the greedy answers
agree, TTFT, and the locator's own time on the flat prompt and on a prompt with no stored chunk (vs
full prefill). Ends with one JSON line.

Before 2026-11-24 (fourth session) ``explicit`` was ``LLM.generate(prefix, chunks=..., question)``,
which joins the parts with its own blank lines and no separator between chunks: another prompt
text, so its answer could equal the flat one's only by chance.

    python -m eval.bench_flat_reuse --questions 8 --passages 5 [--format langchain|llamaindex]

``--via framework`` drives the frameworks' own standard paths instead (:mod:`eval.standard_paths`,
run as a child process):
LlamaIndex's ``VectorStoreIndex.from_documents(...).as_query_engine(llm=RagkvLlamaLLM(...))`` and
LangChain's LCEL chain ``retriever | format_docs | prompt | ChatRagkv | StrOutputParser`` over a
plain ``InMemoryVectorStore``, each question's passages its corpus (all of them retrieved), each way
the framework runs (sync, stream, async). What the framework handed ragkv's wrapper is recorded by
the framework's own hooks; per answer it prints the share of the context's tokens taken from stored
KV (the wrapper's ``num_reused_rows``) and whether the answer equals the explicit form's (the same
prompt text, each stored chunk in it given as itself, ``RAG.job(locate=False)``). ``--docs joined``
makes each question one long document of its passages (the frameworks' splitters cut it elsewhere
than ragkv); ``--split ragkv`` builds the framework's store with ``RagkvNodeParser`` /
``RagkvTextSplitter`` (its documents are ragkv's chunks)::

    python -m eval.bench_flat_reuse --via framework --format both --questions 4 --passages 5 \
        [--docs joined] [--split ragkv] [--kinds sync,stream,async]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from eval.prompts import DATA_DIR
from ragkv import LLM, RequestSettings
from ragkv.blend.locate import Located
from ragkv.generate import SamplingParams
from ragkv.model.chat import chat_parts
from ragkv.rag import RAG
from ragkv.rag.generation import Generated

INSTRUCTION = "Answer the question using the passages.\n\n"
SEPARATOR = "\n\n"  # LangChain's usual format_docs joins page contents with a blank line


@dataclass
class Outcome:
    """One generation of a job: its greedy tokens, TTFT, prefill statistics and the job itself."""

    token_ids: list[int]
    ttft_s: float
    stats: dict
    job: object


def run(rag: RAG, job) -> Outcome:
    """Complete ``job`` through the RAG's one generation path; TTFT = time to the first token event."""
    t0, ttft, done = time.perf_counter(), None, None
    for item in rag.generate(job):
        if isinstance(item, Generated):
            done = item
        elif ttft is None:
            ttft = time.perf_counter() - t0
    return Outcome(done.token_ids, ttft if ttft is not None else time.perf_counter() - t0, done.stats, job)


def frame(fmt: str, question: str) -> tuple[str, str]:
    """The text before and after the joined passages: a LangChain-style chain's, or LlamaIndex's own
    default question-answering template (``as_query_engine``'s, nodes joined by blank lines)."""
    if fmt == "langchain":
        return INSTRUCTION, f"\n\nQuestion: {question}"
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT

    mark = "\x00CONTEXT\x00"
    head, tail = DEFAULT_TEXT_QA_PROMPT.format(context_str=mark, query_str=question).split(mark)
    return head, tail


def explicit_prompt(llm: LLM, recs, head: str, tail: str) -> tuple[list[int], list[Located]]:
    """The flat prompt's text with each chunk's span given: the chunks' own token ids, the rest apart."""
    pre, post = chat_parts(llm.model, head, tail)
    sep = llm.model.encode(SEPARATOR)
    ids, spans = list(pre), []
    for i, r in enumerate(recs):
        if i:
            ids += sep
        toks = tuple(r.token_ids)
        spans.append(Located(r.kv_key, toks, len(ids), 0, len(toks)))
        ids += toks
    return ids + post, spans


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--passages", type=int, default=5, help="passages per question")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--format",
        choices=["langchain", "llamaindex", "both"],
        default="langchain",
        help="the framework's prompt (both: --via framework only)",
    )
    ap.add_argument(
        "--via",
        choices=["job", "framework"],
        default="job",
        help="job: a prompt built here imitating the framework, through RAG.job; framework: the "
        "framework's own standard path (query engine / LCEL chain) with ragkv's wrapper",
    )
    ap.add_argument("--docs", choices=["passages", "joined"], default="passages", help="--via framework")
    ap.add_argument("--split", choices=["default", "ragkv"], default="default", help="--via framework")
    ap.add_argument("--kinds", default="sync,stream,async", help="--via framework: how each path runs")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.via == "framework":
        return framework_main(args)
    if args.format == "both":
        ap.error("--format both needs --via framework")
    samples = json.loads((DATA_DIR / "musique_s.json").read_text())[: args.questions]
    llm = LLM()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        rag = RAG(llm, d, chunk_tokens=args.chunk_tokens)
        for i, s in enumerate(samples):
            texts = [f"{c['title']}\n{c['text']}" for c in s["ctxs"][: args.passages]]
            rag.ingest([{"id": f"q{i}p{j}", "text": t} for j, t in enumerate(texts)], show_progress=False)
            recs = [r for j in range(len(texts)) for r in rag.index.chunks_of(f"q{i}p{j}")]
            context = SEPARATOR.join(r.text for r in recs)
            head, tail = frame(args.format, s["question"])
            flat = f"{head}{context}{tail}"
            ids_flat = sum(llm.tokenize_prompt("", [], flat)[::2], [])  # the template around the flat text
            ids_explicit, spans = explicit_prompt(llm, recs, head, tail)
            out = {
                "full": run(rag, rag.job(ids_flat, [], RequestSettings("full"), params=params)),
                "flat": run(rag, rag.job(ids_flat, [], RequestSettings("blend"), params=params)),
                "explicit": run(
                    rag, rag.job(ids_explicit, spans, RequestSettings("blend"), params=params, locate=False)
                ),
            }
            chunk_tokens = sum(len(r.token_ids) for r in recs)
            ids = ids_flat
            loc = rag.chunk_locator()
            t0 = time.perf_counter()
            loc.find(ids)
            t_find = time.perf_counter() - t0
            t0 = time.perf_counter()
            loc.find([t + 7 for t in ids])  # a prompt of the same length with no stored chunk
            t_none = time.perf_counter() - t0
            row = {
                "question": i,
                "prompt_tokens": len(ids_flat),
                "reused_share": sum(c.hi - c.lo for c in out["flat"].job.chunks) / chunk_tokens,
                "located_chunks": len({c.key for c in out["flat"].job.chunks}),
                "chunks": len(recs),
                "prompt_ids_equal": ids_flat == ids_explicit,
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
                f"({row['located_chunks']}/{row['chunks']} chunks), same ids {row['prompt_ids_equal']}, flat==explicit {row['flat_same_as_explicit']}, "
                f"flat==full {row['flat_same_as_full']}, explicit==full {row['explicit_same_as_full']}, TTFT full "
                f"{row['ttft_full_s']:.2f} s flat {row['ttft_flat_s']:.2f} s explicit {row['ttft_explicit_s']:.2f} s",
                flush=True,
            )
        rag.close()

    def mean(k):
        return statistics.fmean(float(r[k]) for r in rows)

    summary = {
        "format": args.format,
        "questions": len(rows),
        "reused_share_mean": mean("reused_share"),
        "reused_share_min": min(r["reused_share"] for r in rows),
        "prompt_ids_equal": mean("prompt_ids_equal"),
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


def framework_main(args) -> int:
    """``--via framework``: :mod:`eval.standard_paths` in a child process (eval measures the
    library; the framework integrations are an edge it does not import), its output passed through."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "eval.standard_paths"]
    for name in ("format", "questions", "passages", "max_new_tokens", "threads", "docs", "split", "kinds"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--chunk-tokens", str(args.chunk_tokens)]
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
