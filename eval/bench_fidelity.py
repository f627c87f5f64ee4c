"""Blend fidelity on the trained shared model: first-token KL / agreement and attention deviation vs full.

Protocol of the foundation issue's prototype: BOS as prefix, ``--chunks`` chunks of ``--chunk-tokens``
tokens that the model samples itself (in-distribution text), ``--prompts`` prompts, modes reuse and
blend at several ratios. Ends with one JSON line.

    python -m eval.bench_fidelity [--prompts 20 --chunks 4 --chunk-tokens 80 --ratios 0.05,0.15,0.3,1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics

from eval.prompts import TINY_MODEL
from ragkv.blend import BlendSchedule, prefill
from ragkv.generate import SamplingParams, generate
from ragkv.kv import compute_chunk_kv
from ragkv.metrics import attention_deviation, first_token_agreement, first_token_kl
from ragkv.model import load_model


def sample_chunks(model, n: int, length: int, seed: int) -> list[list[int]]:
    out = []
    for i in range(n):
        res = prefill(model, [model.config.bos_token_id], [], [], "full")
        params = SamplingParams(
            max_new_tokens=length, temperature=1.0, seed=seed * 1000 + i, stop_token_ids=()
        )
        out.append(generate(model, res, params).token_ids[:length])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(TINY_MODEL))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=80)
    ap.add_argument("--ratios", default="0.05,0.15,0.3,1.0")
    ap.add_argument("--deviation", default="v", choices=["k", "v", "kv"])
    ap.add_argument("--suffix", default=" Then")
    ap.add_argument("--fresh-check-kv", action="store_true", help="paper-style: check layers keep fresh KV")
    args = ap.parse_args(argv)
    model = load_model(args.model)
    ratios = [float(r) for r in args.ratios.split(",")]
    modes = ["reuse"] + [f"blend@{r:g}" for r in ratios]
    kl = {m: [] for m in modes}
    agree = {m: [] for m in modes}
    dev = {m: [] for m in modes}
    for p in range(args.prompts):
        kvs = [compute_chunk_kv(model, c) for c in sample_chunks(model, args.chunks, args.chunk_tokens, p)]
        pre, suf = [model.config.bos_token_id], model.encode(args.suffix)
        full = prefill(model, pre, kvs, suf, "full", probe_suffix=True)
        for m in modes:
            if m == "reuse":
                res = prefill(model, pre, kvs, suf, "reuse", probe_suffix=True)
            else:
                sched = BlendSchedule.single(
                    float(m.split("@")[1]), deviation=args.deviation, fresh_check_kv=args.fresh_check_kv
                )
                res = prefill(model, pre, kvs, suf, "blend", schedule=sched, probe_suffix=True)
            kl[m].append(first_token_kl(full.logits, res.logits))
            agree[m].append(first_token_agreement(full.logits, res.logits))
            dev[m].append(attention_deviation(full.attn_probs, res.attn_probs))
    print(
        f"{args.prompts} prompts x {args.chunks} chunks x {args.chunk_tokens} tokens, deviation={args.deviation}"
    )
    print(f"{'mode':12s} {'mean KL':>10s} {'agreement':>10s}  mean attention deviation per layer")
    out = {}
    for m in modes:
        per_layer = [statistics.mean(d[i] for d in dev[m]) for i in range(model.config.num_layers)]
        print(
            f"{m:12s} {statistics.mean(kl[m]):10.6f} {statistics.mean(agree[m]):10.2%}  "
            + " ".join(f"{x:.4f}" for x in per_layer)
        )
        key = m.replace("@", "_")
        out[f"{key}_kl"] = round(statistics.mean(kl[m]), 7)
        out[f"{key}_agreement"] = round(statistics.mean(agree[m]), 4)
        out[f"{key}_attn_dev"] = [round(x, 5) for x in per_layer]
    out["blend_kl_over_reuse_kl"] = (
        round(out["blend_0.15_kl"] / max(out["reuse_kl"], 1e-12), 4) if "blend_0.15_kl" in out else None
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
