"""``ragkv`` command line: ``demo`` (and, as the project grows, ingest / ask / serve / eval)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

DEFAULT_SHARED = Path(os.environ.get("RAGKV_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))


def _demo(args) -> int:
    """Blend passages of a few MuSiQue samples and print full vs blend answers and TTFT side by side."""
    from ragkv import LLM

    data = json.loads(Path(args.data).read_text())[: args.samples]
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    m = llm.model
    print(
        f"model {args.model} ({m.config.model_type}, {m.config.num_layers} layers, context "
        f"{m.config.max_position}); {args.chunks} passages per question, cut to fit the context"
    )
    print(f"blending self-check: {'passed' if llm.gate.ok else 'FAILED (falls back to full)'}")
    prefix = "You will be asked a question after reading several passages. Answer within 5 words.\n\n"
    # 1) ingest: cut each sample's passages to fit the context and precompute their KV once
    prompts = []
    for s in data:
        question = m.encode(f"Question: {s['question']}\nAnswer:")[-64:]
        budget = (
            m.config.max_position - args.max_new_tokens - len(m.encode(prefix, add_bos=True)) - len(question)
        )
        per_chunk = max(8, budget // args.chunks)
        chunks = [m.encode(c["text"] + "\n\n")[:per_chunk] for c in s["ctxs"][: args.chunks]]
        for c in chunks:
            llm.chunk_kv(c)
        prompts.append((s, chunks, question))
    print(f"ingested {sum(len(p[1]) for p in prompts)} passages (chunk KV computed once, kept in memory)")
    # 2) ask: every question answered with full prefill and with blended reused KV
    rows = []
    for i, (s, chunks, question) in enumerate(prompts):
        out = {}
        for mode in ("full", "blend"):
            out[mode] = llm.generate(
                prefix, chunks, question, mode=mode, ratio=args.ratio, max_new_tokens=args.max_new_tokens
            )
        rows.append(out)
        print(f"\n[{i}] {s['question']}  (gold: {s['answers'][0] if s['answers'] else '?'})")
        for mode, a in out.items():
            print(f"  {mode:5s} TTFT {a.ttft_s * 1000:8.1f} ms  {a.text.strip()[:70]!r}")
    import statistics

    t_full = statistics.median(r["full"].ttft_s for r in rows)
    t_blend = statistics.median(r["blend"].ttft_s for r in rows)
    print(f"\nmedian TTFT: full {t_full * 1000:.1f} ms, blend {t_blend * 1000:.1f} ms")
    print(
        json.dumps(
            {
                "samples": len(rows),
                "ttft_full_median_s": round(t_full, 4),
                "ttft_blend_median_s": round(t_blend, 4),
            }
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ragkv", description="RAG with reused, blended chunk KV.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="blend MuSiQue passages and compare full vs blend")
    d.add_argument(
        "--model",
        default=str(DEFAULT_SHARED / "models" / "stories260k"),
        help="local folder or hub id of a Llama/Mistral/Qwen2 checkpoint",
    )
    d.add_argument("--data", default=str(DEFAULT_SHARED / "data" / "musique_s.json"))
    d.add_argument("--samples", type=int, default=5)
    d.add_argument("--chunks", type=int, default=4)
    d.add_argument("--ratio", type=float, default=0.15)
    d.add_argument("--max-new-tokens", type=int, default=16)
    d.add_argument("--dtype", default="float32")
    d.add_argument("--device", default="cpu")
    d.set_defaults(func=_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
