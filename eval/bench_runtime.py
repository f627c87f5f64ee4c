"""One runtime? Single-request TTFT and TPOT of the engine (:mod:`ragkv.engine`) against
``ragkv.generate.stream`` (per-sequence caches, what ``ragkv.LLM`` and the RAG's threads decode with).

Both prefill the same prompt (``prefix + chunks + question``, chunks given as token ids, mode
``full`` so no store or gate is involved) with the same :func:`ragkv.blend.prefill`, then decode
greedily ``--tokens`` tokens, dense (``fp16``: the model's dtype) and HACK (2-bit) attention.
TTFT: request start to the first token; TPOT: mean time per token after it. Each figure is the
median of ``--runs`` after one warm-up. Ends with one JSON line (``engine_vs_stream``: engine /
stream, per attention and figure; <= 1.05 is "within 5%").

    python -m eval.bench_runtime                      # the default model if cached, else the tiny one
    python -m eval.bench_runtime --runs 3 --tokens 16 --prompt-tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _prompt(model, n_tokens: int, n_chunks: int = 4) -> tuple[list[int], list[list[int]], list[int]]:
    """A ``prefix + chunks + question`` prompt of about ``n_tokens`` token ids (deterministic)."""
    g = torch.Generator().manual_seed(0)
    lo = 3 if model.config.vocab_size > 3 else 0
    hi = min(model.config.vocab_size, 30000)
    per = max(1, (n_tokens - 24) // n_chunks)

    def rand(n: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    bos = [model.config.bos_token_id] if model.config.bos_token_id is not None else []
    return bos + rand(16), [rand(per) for _ in range(n_chunks)], rand(8)


def run_stream(model, prompt, tokens: int, attention: str) -> tuple[float, float]:
    """TTFT and TPOT (seconds) of prefill + ``generate.stream`` (what ``LLM.generate`` runs)."""
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, stream

    pre, chs, q = prompt
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=())
    t0 = time.perf_counter()
    res = prefill(model, pre, chs, q, "full")
    stamps = []
    for ev in stream(model, res, params, attention=attention):
        if ev.is_token:
            stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def run_engine(engine, prompt, tokens: int) -> tuple[float, float]:
    """TTFT and TPOT (seconds) of one request alone in ``engine`` (driven in this thread)."""
    from ragkv.generate import SamplingParams

    pre, chs, q = prompt
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=())
    out = engine.submit(pre, chs, q, params, mode="full").result()
    m = out.metrics
    return m.ttft_s, m.tpot_s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="a model name or path (default: the default model if cached)"
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded per request")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--attention", default="fp16,hack")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ragkv.engine import Engine, EngineConfig
    from ragkv.model import load_model
    from ragkv.model.registry import DEFAULT_MODEL

    name = args.model
    if name is None:
        try:
            model = load_model(DEFAULT_MODEL)
            name = DEFAULT_MODEL
        except Exception as e:  # not cached (offline): the tiny model of the checkout
            from eval.prompts import TINY_MODEL

            print(f"default model unavailable ({type(e).__name__}); using the tiny model")
            name = str(TINY_MODEL)
            model = load_model(name)
    else:
        model = load_model(name)
    prompt = _prompt(model, args.prompt_tokens)
    n_prompt = len(prompt[0]) + sum(map(len, prompt[1])) + len(prompt[2])
    print(f"model {model.name}: prompt {n_prompt} tokens, {args.tokens} decoded, {args.runs} runs")
    figures: dict = {}
    for attention in [a.strip() for a in args.attention.split(",") if a.strip()]:
        per_layer = -(-(n_prompt + args.tokens + 1) // 16) + 1  # blocks of one sequence, per layer
        blocks = 2 * model.config.num_layers * per_layer
        engine = Engine(model, EngineConfig(num_blocks=blocks, attention=attention))
        for path, fn in (
            ("stream", lambda a=attention: run_stream(model, prompt, args.tokens, a)),
            ("engine", lambda e=engine: run_engine(e, prompt, args.tokens)),
        ):
            fn()  # warm-up
            ttft, tpot = zip(*(fn() for _ in range(args.runs)), strict=True)
            figures[f"{attention}/{path}"] = {
                "ttft_s": statistics.median(ttft),
                "tpot_s": statistics.median(tpot),
            }
            f = figures[f"{attention}/{path}"]
            print(
                f"{attention:5s} {path:6s} TTFT {f['ttft_s'] * 1e3:8.1f} ms  TPOT {f['tpot_s'] * 1e3:7.2f} ms"
            )
        engine.shutdown()
    ratio = {
        a: {k: figures[f"{a}/engine"][k] / figures[f"{a}/stream"][k] for k in ("ttft_s", "tpot_s")}
        for a in {key.split("/")[0] for key in figures}
    }
    for a, r in sorted(ratio.items()):
        print(f"{a}: engine/stream TTFT {r['ttft_s']:.3f}x, TPOT {r['tpot_s']:.3f}x")
    out = {
        "bench": "runtime",
        "model": name,
        "prompt_tokens": n_prompt,
        "tokens": args.tokens,
        "runs": args.runs,
        "threads": torch.get_num_threads(),
        "figures": figures,
        "engine_vs_stream": ratio,
        "within_5pct": all(v <= 1.05 for r in ratio.values() for v in r.values()),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
