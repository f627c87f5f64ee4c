"""Decode speed: float32 weights against the GGUF file's own blocks, and llama.cpp on the same file.

    python -m eval.bench_decode [--prompts 300,2000,6000] [--answers 32,96,256] [--batches 1,4,16]
        [--repeats 3] [--threads 2] [--engine-steps 32] [--no-llamacpp]

Single sequence, per prompt length and decode weights: one prefill (float32 weights, whatever the
decode weights) and the longest answer decoded greedily with no stop token; the time per output
token (TPOT: from the first answer token to the n-th, over n - 1) and the end-to-end time (prefill +
n tokens) are read at each answer length. Engine batches: ``batch`` sequences holding the shortest
prompt's KV, ``--engine-steps`` batched decode steps (``batched_decode_step``, the engine's step):
milliseconds per step and tokens per second. llama.cpp (``llama-cpp-python``, the optional ``llamacpp``
extra: ``pip install 'ragkv[llamacpp]'``, or ``pip install llama-cpp-python``) runs the same GGUF file
on the same token ids and threads, greedy; its column is skipped, with a message, where it is not
installed. Every figure is the median of ``--repeats`` runs.

Bytes per token: the weights one decode step reads (linear layers and LM head: float32, or the
repacked blocks) plus the prompt's K/V, against this machine's memory bandwidth measured here (a
float32 sum over 1 GiB, the same threads): the time that many bytes take at that rate is the bound.
``--cpu-proxy`` adds, on one thread, the CPU time of a decode step and of its linear layers
(``time.process_time``): on a shared machine wall-clock times move with other jobs' load, CPU time
much less (``--only-cpu-proxy`` measures that alone). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from ragkv.blend import prefill
from ragkv.engine import KVPool, PagedSequence, batched_decode_step
from ragkv.generate import SamplingParams, stream
from ragkv.model import DEFAULT_MODEL, load_model

LLAMACPP_MISSING = (
    "llama.cpp column skipped: llama-cpp-python is not installed "
    "(pip install 'ragkv[llamacpp]' or pip install llama-cpp-python; it compiles llama.cpp, ~8 min on 2 cores)"
)


def median(xs):
    return statistics.median(xs) if xs else None


def bandwidth_gbs(threads: int, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Read bandwidth of a float32 sum over ``nbytes`` (GB/s, median)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return nbytes / median(ts) / 1e9


def prompt_ids(model, n: int) -> list[int]:
    """``n`` token ids of evaluation text (MuSiQue passages), after BOS where the model adds one."""
    from eval.prompts import get_spec, load_samples

    ids: list[int] = model.encode("", add_bos=True)
    for s in load_samples(get_spec("musique")):
        for t in s.passages:
            ids += model.encode(t + "\n")
            if len(ids) >= n:
                return ids[:n]
    return ids[:n]


def time_ragkv(model, ids: list[int], n_out: int) -> tuple[float, list[float]]:
    """``(prefill seconds, seconds from the prefill's end to each answer token)``."""
    t0 = time.perf_counter()
    res = prefill(model, ids, [], [], "full")
    int(res.logits.argmax())
    t1 = time.perf_counter()
    marks = []
    params = SamplingParams(max_new_tokens=n_out, stop_token_ids=())
    for ev in stream(model, res, params):
        if ev.is_token:
            marks.append(time.perf_counter() - t1)
    return t1 - t0, marks


def time_llamacpp(llm, ids: list[int], n_out: int) -> tuple[float, list[float]]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    marks = []
    for _tok in llm.generate([], top_k=1, temp=0.0, reset=False):
        marks.append(time.perf_counter() - t1)
        if len(marks) >= n_out:
            break
    return t1 - t0, marks


def per_answer(runs: list[tuple[float, list[float]]], answers: list[int]) -> dict:
    """TPOT and end-to-end per answer length, medians over runs."""
    out = {}
    for n in answers:
        tpot = [(m[n - 1] - m[0]) / (n - 1) for _, m in runs if len(m) >= n]
        e2e = [p + m[n - 1] for p, m in runs if len(m) >= n]
        out[n] = {"tpot_ms": round(median(tpot) * 1e3, 2), "e2e_s": round(median(e2e), 3)}
    out["prefill_s"] = round(median([p for p, _ in runs]), 3)
    return out


def time_engine(model, ids: list[int], batch: int, steps: int, repeats: int) -> float:
    """Median milliseconds of one batched decode step of ``batch`` sequences holding ``ids``' KV."""
    res = prefill(model, ids, [], [], "full")
    kv = res.kv
    ms = []
    for _ in range(repeats):
        nb = batch * model.config.num_layers * ((len(ids) + steps + 2) // 16 + 2)
        pool = KVPool.for_model(model, num_blocks=nb, block_size=16)
        seqs = []
        for _ in range(batch):
            s = PagedSequence(pool)
            s.load_prompt(kv.k, kv.v)
            seqs.append(s)
        toks = [int(res.logits.argmax())] * batch
        batched_decode_step(model, seqs, toks)  # warm
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = batched_decode_step(model, seqs, toks)
            toks = logits.argmax(-1).tolist()
        ms.append((time.perf_counter() - t0) / steps * 1e3)
        for s in seqs:
            s.release()
    return median(ms)


def cpu_proxy(model, weights: dict, ids: list[int], steps: int) -> dict:
    """CPU milliseconds per decode step on one thread (``time.process_time``: what the step itself
    costs, not the time it waits for a core on a shared machine), and of the step's weight reads
    alone (the linear layers and LM head on a random row, the same calls a step makes)."""
    from ragkv.generate import decode_step, make_cache

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name, t in weights.items():
            model.set_decode_weights(t)
            dec = model.decoder()
            cache = make_cache(model, capacity=len(ids) + steps + 2)
            for i, tok in enumerate(ids):
                decode_step(model, cache, tok, i)
            cpu = []
            tok = 5
            for i in range(steps):
                c0 = time.process_time()
                tok = int(decode_step(model, cache, tok, len(ids) + i).argmax())
                cpu.append(time.process_time() - c0)
            h = torch.randn(1, model.config.hidden_size)
            attn = torch.randn(1, model.config.num_heads * model.config.head_dim)
            reads = []
            for _ in range(max(3, steps // 4)):
                c0 = time.process_time()
                for layer in range(model.config.num_layers):
                    dec.qkv(layer, h)
                    dec.finish_layer(layer, h, attn)
                dec.logits(h)
                reads.append(time.process_time() - c0)
            out[name] = {
                "cpu_ms_per_step": round(median(cpu) * 1e3, 2),
                "cpu_ms_linear_layers": round(median(reads) * 1e3, 2),
            }
    finally:
        torch.set_num_threads(threads)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", default="300,2000,6000")
    ap.add_argument("--answers", default="32,96,256")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine-steps", type=int, default=32)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument(
        "--cpu-proxy",
        type=int,
        default=32,
        metavar="STEPS",
        help="also measure CPU ms per decode step on one thread over STEPS steps (0: skip)",
    )
    ap.add_argument("--only-cpu-proxy", action="store_true", help="measure the CPU proxy only (quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [int(x) for x in args.prompts.split(",") if x]
    answers = sorted(int(x) for x in args.answers.split(",") if x)
    batches = [int(x) for x in args.batches.split(",") if x]

    from ragkv.model.gguf import gguf_source
    from ragkv.model.loader import cached_lowbit_weights, resolve_model_dir

    model = load_model(args.model, decode_weights="gguf")
    folder = resolve_model_dir(args.model)
    src = gguf_source(folder)
    if model.decode_weights != "gguf":
        raise SystemExit(f"no GGUF decode weights for {args.model}: {model.decode_weights_note}")
    packed = cached_lowbit_weights(folder, src)
    weights = {"float32": None, "gguf": packed}
    bw = bandwidth_gbs(args.threads)
    c = model.config
    summary: dict = {
        "bench": "decode",
        "model": args.model,
        "gguf": src.name,
        "threads": args.threads,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or ''}".strip(),
        "load_avg_start": os.getloadavg()[0],
        "bandwidth_gbs": round(bw, 1),
        "repeats": args.repeats,
        "single": {},
        "engine": {},
        "bytes_per_token": {},
    }
    print(f"memory bandwidth (float32 sum, {args.threads} threads): {bw:.1f} GB/s")
    for name, t in weights.items():
        model.set_decode_weights(t)
        summary["bytes_per_token"][name] = model.decode_weight_bytes()

    if args.cpu_proxy:
        summary["cpu_proxy_one_thread"] = cpu_proxy(
            model, weights, prompt_ids(model, min(prompts)), args.cpu_proxy
        )
        for name, r in summary["cpu_proxy_one_thread"].items():
            print(
                f"one thread, CPU time: {name:>8} {r['cpu_ms_per_step']:.1f} ms per decode step, "
                f"{r['cpu_ms_linear_layers']:.1f} ms of it the linear layers and LM head"
            )
        if args.only_cpu_proxy:
            model.set_decode_weights(packed)
            print(json.dumps(summary))
            return summary

    llm = None
    if not args.no_llamacpp:
        try:
            from llama_cpp import Llama

            llm = Llama(
                str(src), n_ctx=max(prompts) + max(answers) + 8, n_threads=args.threads, verbose=False
            )
        except ImportError:
            print(LLAMACPP_MISSING)
            summary["llamacpp"] = "not installed"
    else:
        summary["llamacpp"] = "skipped (--no-llamacpp)"

    for n in prompts:
        ids = prompt_ids(model, n)
        row = {}
        for name, t in weights.items():
            model.set_decode_weights(t)
            time_ragkv(model, ids[:64], 4)  # warm
            runs = [time_ragkv(model, ids, max(answers)) for _ in range(args.repeats)]
            row[name] = per_answer(runs, answers)
        if llm is not None:
            time_llamacpp(llm, ids[:64], 4)
            runs = [time_llamacpp(llm, ids, max(answers)) for _ in range(args.repeats)]
            row["llamacpp"] = per_answer(runs, answers)
        kv_bytes = 2 * c.num_layers * len(ids) * c.num_kv_heads * c.head_dim * 4
        for name in weights:
            b = summary["bytes_per_token"][name] + kv_bytes
            bound_ms = b / (bw * 1e9) * 1e3
            tp = row[name][answers[0]]["tpot_ms"]
            row[name]["bound_ms"] = round(bound_ms, 2)
            row[name]["x_bound"] = round(tp / bound_ms, 2)
        summary["single"][len(ids)] = row
        print(f"prompt {len(ids)} tokens")
        for name, r in row.items():
            cols = "  ".join(f"{a} tok: {r[a]['tpot_ms']:.1f} ms/tok, {r[a]['e2e_s']:.2f} s" for a in answers)
            extra = f"  (bound {r['bound_ms']:.1f} ms, x{r['x_bound']})" if "bound_ms" in r else ""
            print(f"  {name:>9}: prefill {r['prefill_s']:.2f} s  {cols}{extra}")

    ids = prompt_ids(model, min(prompts))
    for name, t in weights.items():
        model.set_decode_weights(t)
        for b in batches:
            ms = time_engine(model, ids, b, args.engine_steps, args.repeats)
            summary["engine"].setdefault(name, {})[b] = {
                "step_ms": round(ms, 2),
                "tok_s": round(b / ms * 1e3, 1),
            }
            print(f"engine {name:>8} batch {b:>2}: {ms:.1f} ms/step, {b / ms * 1e3:.0f} tok/s")
    model.set_decode_weights(packed)
    summary["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
