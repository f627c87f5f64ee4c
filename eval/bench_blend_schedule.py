"""Blend schedules on a real model: first-token KL and output F1 vs full, against recompute and TTFT.

For each sample (CacheBlend's prompts, eval.prompts; passages cut to ``--chunk-tokens``), full
prefill is the reference; ``reuse`` and every schedule in ``--schedules`` run on the same stored
passage KV, modes interleaved per sample. A schedule is written ``LAYERS:RATIOS[:DEV][:fresh]``,
e.g. ``1:0.15`` (CacheBlend's single check layer), ``1,2,4:0.3,0.2,0.15`` (gradual filtering),
``1:0.15:kv``. Prints a table and ends with one JSON line.

    python -m eval.bench_blend_schedule --dataset musique --limit 4 --num-chunks 10 --chunk-tokens 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from eval.fit import PassageFitter, fit_prompt
from eval.prompts import PromptBuilder, chat_frame, get_spec, load_samples
from ragkv.blend import BlendSchedule, prefill
from ragkv.generate import SamplingParams, generate
from ragkv.metrics import first_token_agreement, first_token_kl, token_f1
from ragkv.model import DEFAULT_MODEL, load_model
from ragkv.model.forward import compute_chunk_kv

DEFAULT_SCHEDULES = (
    "1:0.15",
    "1:0.15:k",
    "1:0.15:kv",
    "2:0.15",
    "3:0.15",
    "1,2,4:0.3,0.2,0.15",
    "1,3,8:0.3,0.2,0.15",
    "1,2,3,4,6,8:0.4,0.3,0.25,0.2,0.17,0.15",
    "1:0.15:v:fresh",
    "1:0.3",
    "1,3,8:0.45,0.35,0.3",
)


def parse_schedule(text: str) -> BlendSchedule:
    """``LAYERS:RATIOS[:DEV][:fresh]`` -> BlendSchedule."""
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError(f"bad schedule {text!r}; use LAYERS:RATIOS[:DEV][:fresh]")
    layers = tuple(int(x) for x in parts[0].split(","))
    ratios = tuple(float(x) for x in parts[1].split(","))
    dev = parts[2] if len(parts) > 2 else "v"
    fresh = len(parts) > 3 and parts[3] == "fresh"
    return BlendSchedule(layers, ratios, dev, fresh_check_kv=fresh, selector="kdev", offset="none")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dataset", default="musique")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0, help="skip the first N samples")
    ap.add_argument("--num-chunks", type=int, default=10)
    ap.add_argument("--chunk-tokens", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--schedules", default=";".join(DEFAULT_SCHEDULES), help="';'-separated")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model)
    spec = get_spec(args.dataset)
    samples = load_samples(spec)[args.offset : args.offset + args.limit]
    builder = PromptBuilder(model, chat_frame(model.tokenizer), spec.prefix, spec.query)
    fitter = PassageFitter(model.encode, args.chunk_tokens)
    scheds = {s: parse_schedule(s) for s in args.schedules.split(";") if s}
    labels = ["reuse", *scheds]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    rows: dict[str, dict[str, list]] = {
        lab: {"kl": [], "agree": [], "f1": [], "rec": [], "t": []} for lab in labels
    }
    t_full = []
    for i, s in enumerate(samples):
        p = fit_prompt(builder, fitter, s, args.num_chunks)
        kvs = [compute_chunk_kv(model, c) for c in p.chunks]
        t0 = time.perf_counter()
        full = prefill(model, p.prefix, p.chunks, p.suffix, "full")
        t_full.append(time.perf_counter() - t0)
        full_text = generate(model, full, params).text
        for lab in labels:
            t0 = time.perf_counter()
            if lab == "reuse":
                res = prefill(model, p.prefix, kvs, p.suffix, "reuse")
            else:
                res = prefill(model, p.prefix, kvs, p.suffix, "blend", schedule=scheds[lab])
            dt = time.perf_counter() - t0
            r = rows[lab]
            r["t"].append(dt)
            r["kl"].append(first_token_kl(full.logits, res.logits))
            r["agree"].append(float(first_token_agreement(full.logits, res.logits)))
            r["f1"].append(token_f1(generate(model, res, params).text, full_text))
            r["rec"].append(res.stats["recompute_fraction"])
        print(
            f"sample {i + 1}/{len(samples)}: {full.stats['num_tokens']} tokens, full {t_full[-1]:.2f} s",
            file=sys.stderr,
        )
    reuse_kl = statistics.fmean(rows["reuse"]["kl"])
    tf = statistics.median(t_full)
    out = {}
    print(
        f"{'schedule':42s} {'KL':>8s} {'KL/reuse':>8s} {'agree':>6s} {'F1 vs full':>10s} {'recompute':>9s} {'speedup':>8s}"
    )
    for lab in labels:
        r = rows[lab]
        a = {
            "kl": statistics.fmean(r["kl"]),
            "kl_vs_reuse": statistics.fmean(r["kl"]) / reuse_kl if reuse_kl else None,
            "agreement": statistics.fmean(r["agree"]),
            "output_f1_vs_full": statistics.fmean(r["f1"]),
            "recompute_fraction": statistics.fmean(r["rec"]),
            "speedup_vs_full": tf / statistics.median(r["t"]),
        }
        out[lab] = a
        print(
            f"{lab:42s} {a['kl']:8.4f} {a['kl_vs_reuse']:8.2f} {a['agreement']:6.2f} {a['output_f1_vs_full']:10.3f} "
            f"{a['recompute_fraction']:9.3f} {a['speedup_vs_full']:8.2f}"
        )
    result = {
        "model": args.model,
        "dataset": args.dataset,
        "samples": len(samples),
        "num_chunks": args.num_chunks,
        "chunk_tokens": args.chunk_tokens,
        "ttft_full_median_s": tf,
        "schedules": out,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
