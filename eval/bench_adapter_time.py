"""The time a KV adapter adds to TTFT (issue 38's goal: at most 5%), paired, on the fidelity gate's prompts.

    python -m eval.bench_adapter_time [--limit 8] [--runs 3] [--ratios 0,0.12] [--threads 1] [--adapter PATH]
        [--passage-tokens N] [--source pipelined|sequential]

Per calibration question (the gate's set, ``ragkv.fidelity``), chunk KV in memory and the prompt's
exact head cached, as the gate measures TTFT: prefill (plus the first token's argmax) with the chunks'
stored KV read as is and read through the adapter (default: the shipped one of the default model), at
reuse (ratio 0) and each blend ratio. The two variants alternate inside every run; the figure per
question is the ratio of their medians over ``--runs``, then the median over questions with a
bootstrap interval. ``--source``: how stored KV reaches the blend loop, ``pipelined`` (the chunk
resolver's default: layer ``l+1`` is read, and corrected, on a loader thread while layer ``l`` computes)
or ``sequential`` (read and corrected on the compute thread). Also timed: the adapter's correction
alone (every layer of the longest prompt's reused rows). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eval.bench_adapter import calibration_items
from ragkv.adapter.kv_adapter import KVAdapter
from ragkv.adapter.shipped import shipped_adapter
from ragkv.adapter.train import item_ids
from ragkv.blend.core import BlendSchedule
from ragkv.blend.kvtree import PrefixCache
from ragkv.blend.pipeline import pipelined_factory
from ragkv.blend.prefill import prefill
from ragkv.fidelity.measure import bootstrap_ci
from ragkv.model import DEFAULT_MODEL, load_model
from ragkv.model.forward import compute_chunk_kv


def _ttft(model, prefix, kvs, suffix, ratio: float, pc: PrefixCache, adapter, factory=None) -> float:
    kw = dict(prefix_cache=pc, prefix_cache_insert=False, adapter=adapter, source_factory=factory)
    t0 = time.perf_counter()
    if ratio == 0:
        res = prefill(model, prefix, kvs, suffix, "reuse", **kw)
    else:
        res = prefill(model, prefix, kvs, suffix, "blend", schedule=BlendSchedule(ratios=(ratio,)), **kw)
    int(res.logits.argmax())
    return time.perf_counter() - t0


def correction_s(adapter: KVAdapter, kvs, runs: int) -> float:
    """Median seconds of correcting every layer of ``kvs``'s rows (what one prefill adds)."""
    k = torch.cat([c.k for c in kvs], dim=1)  # [L, n, Hkv, D]
    v = torch.cat([c.v for c in kvs], dim=1)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for layer in range(k.shape[0]):
            adapter.correct(layer, k[layer], v[layer])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--adapter", default=None, help="an adapter file (default: the model's shipped one)")
    ap.add_argument("--limit", type=int, default=8, help="calibration questions")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ratios", default="0,0.12", help="0 = reuse; else blend at that ratio")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--passage-tokens", type=int, default=0, help="cut each passage to this many tokens (0: whole)"
    )
    ap.add_argument("--source", choices=["pipelined", "sequential"], default="pipelined")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    factory = pipelined_factory(model) if args.source == "pipelined" else None
    adapter = KVAdapter.load(args.adapter, model) if args.adapter else shipped_adapter(model)
    if adapter is None:
        raise SystemExit(f"no adapter: {args.model} ships none; pass --adapter FILE")
    ratios = [float(r) for r in args.ratios.split(",")]
    pc = PrefixCache(max_bytes=1 << 28)
    per_q: dict[float, list[float]] = {r: [] for r in ratios}
    base_ms: dict[float, list[float]] = {r: [] for r in ratios}
    longest = None
    measured = 0
    for it in calibration_items():
        if measured == args.limit:
            break
        prefix, chunks, suffix = item_ids(model, it)
        if args.passage_tokens:
            chunks = [c[: args.passage_tokens] for c in chunks]
        if len(prefix) + sum(map(len, chunks)) + len(suffix) + 1 > model.config.max_position:
            continue  # does not fit the model's context: left out, as the gate's set does
        measured += 1
        kvs = [compute_chunk_kv(model, c) for c in chunks]
        if longest is None or sum(map(len, chunks)) > sum(len(c.token_ids) for c in longest):
            longest = kvs
        prefill(model, prefix, [], [], "prefix", prefix_cache=pc)  # the exact head, cached
        for r in ratios:
            _ttft(model, prefix, kvs, suffix, r, pc, adapter, factory)  # warm-up
            plain, adapted = [], []
            for _ in range(args.runs):
                plain.append(_ttft(model, prefix, kvs, suffix, r, pc, None, factory))
                adapted.append(_ttft(model, prefix, kvs, suffix, r, pc, adapter, factory))
            per_q[r].append(statistics.median(adapted) / statistics.median(plain))
            base_ms[r].append(1000 * statistics.median(plain))
    if not measured:
        raise SystemExit(f"no calibration question fits {args.model}'s context: pass --passage-tokens")
    corr = correction_s(adapter, longest, max(3, args.runs))
    out = {
        "bench": "adapter_time",
        "model": args.model,
        "adapter": adapter.identity,
        "questions": measured,
        "source": args.source,
    }
    for r in ratios:
        name = "reuse" if r == 0 else f"blend@{r:g}"
        med = statistics.median(per_q[r])
        lo, hi = bootstrap_ci(per_q[r], statistics.median)
        print(
            f"{name:>11}: TTFT with / without the adapter {med:.3f}x [{lo:.3f}, {hi:.3f}] "
            f"(without: median {statistics.median(base_ms[r]):.0f} ms)"
        )
        out[name] = {"ratio": med, "ci": [lo, hi], "ttft_without_ms": statistics.median(base_ms[r])}
    n = sum(len(c.token_ids) for c in longest)
    print(f"correction alone: {1000 * corr:.1f} ms for {n} rows x {model.config.num_layers} layers")
    out["correction_ms"] = 1000 * corr
    out["correction_rows"] = n
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
