"""Prefill benchmark: full vs prefix vs reuse vs blend@r vs transformers' own full prefill.

A random-initialised Llama-style model big enough that compute dominates on CPU (default 32 layers,
hidden 512, GQA 8/2 heads), prompt = BOS + 6 chunks x 512 tokens + a 32-token question, all chunk
KV already in memory. Medians of ``--runs`` runs, all modes interleaved in one process.

    python -m eval.bench_prefill [--layers 32 --hidden 512 --chunks 6 --chunk-tokens 512 --runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eval.prompts import DATA_DIR
from ragkv.blend import BlendSchedule, PrefixCache, prefill
from ragkv.model import load_model, random_hf_config, random_model
from ragkv.model.forward import compute_chunk_kv
from ragkv.model.loader import hf_state_dict, resolve_model_dir


def bench_model(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int, seed: int = 0):
    over = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=8192,
    )
    return random_model("llama", seed=seed, **over), random_hf_config("llama", **over)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=None,
        help="a real checkpoint (name, GGUF, folder) with MuSiQue passages as chunks; default: a random "
        "Llama of the --layers/--hidden/... shape with random token chunks",
    )
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' baseline")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # on a shared machine, 1 thread avoids OpenMP spin stalls

    torch.manual_seed(0)
    if args.model:
        model = load_model(args.model)
        sample = json.loads((DATA_DIR / "musique_s.json").read_text())[0]
        chunks = [model.encode(c["text"])[: args.chunk_tokens] for c in sample["ctxs"][: args.chunks]]
        question = model.encode(" Question: " + sample["question"] + "\nAnswer:")[: args.question_tokens]
        prefix = [model.config.bos_token_id]
    else:
        model, hf_cfg = bench_model(
            args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab
        )
        g = torch.Generator().manual_seed(1)
        chunks = [
            torch.randint(3, args.vocab, (args.chunk_tokens,), generator=g).tolist()
            for _ in range(args.chunks)
        ]
        question = torch.randint(3, args.vocab, (args.question_tokens,), generator=g).tolist()
        prefix = [1]
    kvs = [compute_chunk_kv(model, c) for c in chunks]
    pc = PrefixCache(max_bytes=1 << 40)
    prefill(model, prefix, chunks[:1], [], "prefix", prefix_cache=pc)  # first chunk's head cached
    schedule = BlendSchedule.single(args.ratio)
    n_tokens = len(prefix) + sum(map(len, chunks)) + len(question)

    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        if args.model:
            folder = resolve_model_dir(args.model)
            hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32)
        else:
            hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").eval()
            hf.load_state_dict(hf_state_dict(model), strict=False)
        hf.eval()
    ids_all = torch.tensor(prefix + [t for c in chunks for t in c] + question)

    def run_hf():
        with torch.inference_mode():
            return hf(ids_all[None], use_cache=True, logits_to_keep=1).logits

    cases = {
        "full": lambda: prefill(model, prefix, chunks, question, "full"),
        "prefix": lambda: prefill(
            model, prefix, chunks, question, "prefix", prefix_cache=pc, prefix_cache_insert=False
        ),
        "reuse": lambda: prefill(model, prefix, kvs, question, "reuse"),
        "blend": lambda: prefill(model, prefix, kvs, question, "blend", schedule=schedule),
    }
    if hf is not None:
        cases["hf_full"] = run_hf
    times: dict[str, list[float]] = {k: [] for k in cases}
    stats = {}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.runs):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            if name == "blend":
                stats = out.stats
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model: {args.model or 'random'}: {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
        f"heads {model.config.num_heads}/{model.config.num_kv_heads}, "
        f"prompt {n_tokens} tokens ({len(chunks)} x {args.chunk_tokens} + {len(question)}), "
        f"threads {torch.get_num_threads()}, runs {args.runs}"
    )
    print(f"{'mode':10s} {'median s':>10s} {'min s':>8s} {'speedup vs full':>16s}")
    for k, v in med.items():
        print(f"{k:10s} {v:10.3f} {min(times[k]):8.3f} {med['full'] / v:16.2f}")
    recompute_ratio = stats["recompute_fraction"]
    print(
        f"blend recomputed rows per layer: {stats['recomputed_per_layer'][:3]}... "
        f"(overall fraction of full compute rows {recompute_ratio:.3f})"
    )
    result = {
        "full_s": round(med["full"], 4),
        "prefix_s": round(med["prefix"], 4),
        "reuse_s": round(med["reuse"], 4),
        "blend_s": round(med["blend"], 4),
        "hf_full_s": round(med["hf_full"], 4) if "hf_full" in med else None,
        "speedup_blend_vs_full": round(med["full"] / med["blend"], 3),
        "speedup_reuse_vs_full": round(med["full"] / med["reuse"], 3),
        "full_over_hf_full": round(med["full"] / med["hf_full"], 3) if "hf_full" in med else None,
        "recompute_ratio": args.ratio,
        "recompute_fraction_rows": round(recompute_ratio, 4),
        "model": args.model or f"random-llama-{args.layers}x{args.hidden}",
        "tokens": n_tokens,
        "runs": args.runs,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
