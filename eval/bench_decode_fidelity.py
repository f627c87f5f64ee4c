"""Fidelity of decode on the GGUF's own blocks: the same greedy answer as float32 decode?

    python -m eval.bench_decode_fidelity [--splits short-musique,short-2wikimqa] [--samples 0:100] \\
        [--max-new-tokens 32] [--threads 2] [--out runs/decode_fidelity]

Per question (the evaluation's prompts, as ``eval.bench_fidelity`` builds them): one full prefill
(float32 weights: prefill never changes), then a greedy answer decoded on float32 weights and one on
the GGUF file's blocks (``decode_weights="gguf"``). Recorded: whether the two answers are the same
(normalized text, and token for token), the first decoded position where the tokens part, the
first decode step's KL divergence (float32 || gguf; the first answer token comes from prefill and
is the same in both), and each answer's gold recall. The summary gives the same-answer rate with a
95% Wilson interval (the noise floor it is held to: bf16 full prefill keeps 81% of float32's greedy
answers). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from eval.bench_fidelity import SPLITS
from eval.fit import PassageFitter, fit_prompt
from eval.prompts import PromptBuilder, chat_frame, get_spec, load_samples
from ragkv.blend import prefill
from ragkv.generate import SamplingParams, decode_step, generate, load_prompt, make_cache
from ragkv.metrics import normalize_answer
from ragkv.metrics.text import answer_recall, max_over_golds
from ragkv.model import DEFAULT_MODEL, load_model


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``k / n``."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (round(c - h, 4), round(c + h, 4))


def first_step_kl(model, res, packed) -> float:
    """KL(float32 || gguf) of the first decode step's next-token distribution (same prompt, same token)."""
    tok = int(res.logits.argmax())
    n = res.kv.num_tokens
    out = []
    for tensors in (None, packed):
        model.set_decode_weights(tensors)
        cache = make_cache(model, capacity=n + 2)
        load_prompt(cache, res)
        out.append(torch.log_softmax(decode_step(model, cache, tok, n).double(), -1))
    a, b = out
    return float((a.exp() * (a - b)).sum())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--splits", default="short-musique,short-2wikimqa")
    ap.add_argument("--samples", default="0:100", help="range of samples per split, START:END")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/decode_fidelity")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, decode_weights="gguf")
    if model.decode_weights != "gguf":
        raise SystemExit(f"no GGUF decode weights for {args.model}: {model.decode_weights_note}")
    from ragkv.model.gguf import gguf_source
    from ragkv.model.loader import cached_lowbit_weights, resolve_model_dir

    folder = resolve_model_dir(args.model)  # the blocks, by name, to switch decode weights per answer
    packed = cached_lowbit_weights(folder, gguf_source(folder))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    lo, hi = (int(x) for x in args.samples.split(":"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    t_start = time.perf_counter()
    for split in args.splits.split(","):
        dataset, num_chunks, chunk_tokens = SPLITS[split]
        spec = get_spec(dataset)
        builder = PromptBuilder(model, chat_frame(model.tokenizer, True), spec.prefix, spec.query)
        fitter = PassageFitter(model.encode, chunk_tokens)
        for s in load_samples(spec)[lo:hi]:
            order = None
            if num_chunks is not None:
                order = list(range(len(s.texts)))
                random.Random(1_000_003 + s.index).shuffle(order)
            p = fit_prompt(builder, fitter, s, num_chunks, order)
            res = prefill(model, p.prefix, p.chunks, p.suffix, "full")
            gens = {}
            for name, tensors in (("float32", None), ("gguf", packed)):
                model.set_decode_weights(tensors)
                gens[name] = generate(model, res, params)
            a, b = gens["float32"], gens["gguf"]
            split_at = next(
                (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None
            )
            rec = {
                "split": split,
                "index": s.index,
                "prompt_tokens": res.kv.num_tokens,
                "same_text": normalize_answer(a.text) == normalize_answer(b.text),
                "same_tokens": a.token_ids == b.token_ids,
                "first_diff": split_at,
                "kl_step1": first_step_kl(model, res, packed),
                "recall_float32": max_over_golds(answer_recall, a.text, s.answers),
                "recall_gguf": max_over_golds(answer_recall, b.text, s.answers),
                "tpot_float32_s": a.timings["tpot_s"],
                "tpot_gguf_s": b.timings["tpot_s"],
                "answer_float32": a.text,
                "answer_gguf": b.text,
            }
            records.append(rec)
            done = len(records)
            same = sum(r["same_text"] for r in records)
            print(
                f"[{done}] {split} #{s.index}: same={rec['same_text']} kl1={rec['kl_step1']:.2e} "
                f"({same}/{done} same, {time.perf_counter() - t_start:.0f} s)",
                flush=True,
            )
    model.set_decode_weights(packed)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    n = len(records)
    k = sum(r["same_text"] for r in records)
    kt = sum(r["same_tokens"] for r in records)
    kls = sorted(r["kl_step1"] for r in records)
    summary = {
        "bench": "decode_fidelity",
        "model": args.model,
        "splits": args.splits,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "n": n,
        "same_answer": round(k / max(1, n), 4),
        "same_answer_ci95": wilson(k, n),
        "same_tokens": round(kt / max(1, n), 4),
        "same_tokens_ci95": wilson(kt, n),
        "kl_step1_median": kls[n // 2] if n else None,
        "kl_step1_max": kls[-1] if n else None,
        "recall_float32": round(sum(r["recall_float32"] for r in records) / max(1, n), 4),
        "recall_gguf": round(sum(r["recall_gguf"] for r in records) / max(1, n), 4),
        "noise_floor_same_answer": 0.81,
    }
    for key, v in summary.items():
        print(f"{key:>24}: {v}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
