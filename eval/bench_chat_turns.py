"""Multi-turn RAG chat on the library route: ragkv's default (the exact KV tree) against full prefill and
llama.cpp's prompt cache on the same token ids (issue 52; a script, not a timed test).

    python -m eval.bench_chat_turns [--conversations 2] [--threads 2] [--max-new-tokens 24]

Each conversation: a system message and a user message with 4 MuSiQue passages and the question, then 4
follow-ups, rendered by the model's chat template. Per turn, interleaved: ``LLM.generate(ids, mode="full")``,
``LLM.generate(ids)`` (the default), and ``llama-cpp-python`` (same GGUF, same threads, one ``Llama`` whose
prompt cache reuses the longest common prefix, as llama-server does; TTFT to its first token; skipped
with a note when the package is missing: ``pip install -e .[llamacpp]``). Prints a row per turn and ends
with one JSON line: medians over turns 2-5, the default's speed-up over full and over llama.cpp, the
share of same greedy answers as full, and the cached share of the prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import ragkv
from eval.harness import REPO
from ragkv.model.registry import gguf_path

FOLLOW_UPS = ["Why?", "Can you say that in one sentence?", "Which passage says so?", "Anything else?"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = ragkv.LLM()
    tok = llm.model.tokenizer
    try:
        from llama_cpp import Llama

        lc = Llama(
            model_path=str(gguf_path("smollm2-135m-instruct")),
            n_threads=args.threads,
            n_ctx=8192,
            verbose=False,
        )
    except ImportError:
        print("llama.cpp column skipped: pip install -e .[llamacpp] (builds llama.cpp, ~8 min on 2 cores)")
        lc = None
    data = json.loads((REPO / "data" / "musique_s.json").read_text())
    rows = []
    for conv in range(args.conversations):
        s = data[conv]
        passages = "\n\n".join(c["text"] for c in s["ctxs"][:4])
        msgs = [
            {"role": "system", "content": f"Session {conv}. Answer using the passages."},
            {"role": "user", "content": passages + "\n\nQuestion: " + s["question"]},
        ]
        if lc is not None:
            lc.reset()
        for turn in range(5):
            enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            ids = list(enc["input_ids"])
            full = llm.generate(ids, [], [], mode="full", max_new_tokens=args.max_new_tokens)
            got = llm.generate(ids, [], [], max_new_tokens=args.max_new_tokens)
            t_lc = None
            if lc is not None:
                t0 = time.perf_counter()
                it = lc.generate(ids, temp=0.0)  # the longest common prefix with what it holds is reused
                out = [next(it)]
                t_lc = time.perf_counter() - t0
                for _ in range(args.max_new_tokens - 1):  # its cache then holds the answer too
                    x = next(it)
                    if x == lc.token_eos():
                        break
                    out.append(x)
            row = dict(
                conv=conv, turn=turn + 1, n=len(ids), full=full.ttft_s, default=got.ttft_s, llamacpp=t_lc
            )
            row.update(cached=got.stats["cached_tokens"], same=got.token_ids == full.token_ids)
            rows.append(row)
            print(row, flush=True)
            msgs += [
                {"role": "assistant", "content": got.text},
                {"role": "user", "content": FOLLOW_UPS[turn % 4]},
            ]
    late = [r for r in rows if r["turn"] >= 2]
    summary = {k: statistics.median(r[k] for r in late) for k in ("full", "default")}
    summary["default_over_full"] = statistics.median(r["full"] / r["default"] for r in late)
    if lc is not None:
        summary["llamacpp"] = statistics.median(r["llamacpp"] for r in late)
        summary["default_over_llamacpp"] = statistics.median(r["llamacpp"] / r["default"] for r in late)
    summary["same_as_full"] = sum(r["same"] for r in rows) / len(rows)
    summary["cached_share"] = statistics.median(r["cached"] / r["n"] for r in late)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
