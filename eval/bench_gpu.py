"""GPU benchmarks for one short GPU run (``scripts/gpu_suite.sh``): each section writes one JSON file.

Sections (``python -m eval.bench_gpu SECTION --out DIR``):

* ``hack``: the Triton HACK 2-bit decode kernel vs fp16 SDPA (and dequantize-then-SDPA) at 8K / 32K /
  128K context x batch 1 / 16 / 64, Llama-3-8B attention geometry (``eval.bench_hack.gpu_bench``; cells
  whose fp16 K+V exceed 20 GB are skipped there). Goal: faster than fp16 SDPA at 32K, batch 16.
* ``codec``: restoring a stored 2K-token chunk from lossless video on NVDEC (``decoder="auto"``, GB/s of
  bf16 KV), on the CPU decoder, and recomputing the same chunk's KV on the GPU, for a random model of
  Llama-3-8B shape with ``--layers`` layers (both scale linearly in layers; per-layer figures reported).
* ``runtime``: TTFT of full prefill vs CacheBlend blend (ratio 0.15, chunk KV in GPU memory) vs
  transformers' own forward, bf16 on CUDA, same random Llama-3-8B-shaped weights (few layers).
* ``loading``: blend with stored KV loaded layer by layer on a CUDA side stream (``PipelinedSource``,
  pinned staging) vs loading everything first, vs load-only and compute-only.
* ``graph``: greedy decode tokens/s at batch 1: CUDA-graph replay of ``StaticDecoder`` vs the same step
  eager vs ``ragkv.generate`` (growing cache). Goal: graph >= 2x eager.

Deviation from "the real model": weights are random (no checkpoint travels to the GPU machine) and
the vocabulary is 32000 instead of 128256 (the LM head runs on one row for TTFT, so this only saves
memory); every other dimension is Llama-3-8B's (hidden 4096, 32 heads, 8 KV heads, head_dim 128,
MLP 14336).

``--dry-run`` runs every section on the CPU at tiny sizes through the same code (no timing goals): it
checks the plumbing without a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SECTIONS = ("hack", "codec", "runtime", "loading", "graph")
#: Llama-3-8B shape (vocab reduced, see the module docstring)
LLAMA8B = dict(hidden=4096, heads=32, kv_heads=8, inter=14336, vocab=32000)
TINY = dict(hidden=64, heads=4, kv_heads=2, inter=128, vocab=256)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, runs: int, device: torch.device, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds, synchronising the device around every run."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def make_model(layers: int, shape: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """Random Llama of ``shape`` on ``device`` and its transformers config."""
    from eval.bench_prefill import bench_model

    m, hf = bench_model(
        layers, shape["hidden"], shape["heads"], shape["kv_heads"], shape["inter"], shape["vocab"], seed
    )
    if device != "cpu" or dtype != torch.float32:
        from ragkv.model import Model

        weights = {n: t.to(device=device, dtype=dtype).contiguous() for n, t in hf_weights(m).items()}
        m = Model(m.config, weights, fingerprint=f"{m.fingerprint}-{dtype}-{device}", name=m.name)
    return m, hf


def hf_weights(m) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names (views of ragkv's fused tensors)."""
    c = m.config
    nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {
        "model.embed_tokens.weight": m.embed_w,
        "model.norm.weight": m.final_norm,
        "lm_head.weight": m.lm_head_w,
    }
    for i, lw in enumerate(m.layers):
        p = f"model.layers.{i}."
        q, k, v = lw.qkv_w.split([nq, nk, nk], 0)
        gate, up = lw.gate_up_w.chunk(2, 0)
        out.update(
            {
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": lw.o_w,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": lw.down_w,
                p + "input_layernorm.weight": lw.in_norm,
                p + "post_attention_layernorm.weight": lw.post_norm,
            }
        )
    return out


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- sections --------------------------------------------------------------------------------------------------
def bench_hack(args, device: torch.device) -> dict:
    """Triton kernel vs fp16 SDPA; the dry run checks the plan (and that bench_hack imports)."""
    from eval.bench_hack import gpu_bench

    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    plan = [
        {"context": t, "batch": b, "fp16_kv_gb": round(b * t * 8 * 128 * 2 * 2 / 1e9, 2)}
        for t in contexts
        for b in batches
    ]
    if args.dry_run:
        return {"plan": plan, "skipped_over_20gb": [p for p in plan if p["fp16_kv_gb"] > 20]}
    rows = gpu_bench(contexts, batches, args.runs)
    if rows is None:
        return {"error": "no CUDA device with triton", "plan": plan}
    for r in rows:
        r["speedup_vs_fp16"] = round(r["t_sdpa_fp16_ms"] / r["t_triton_ms"], 3)
    goal = next((r for r in rows if r["context"] == 32768 and r["batch"] == 16), None)
    return {
        "rows": rows,
        "skipped_over_20gb": [p for p in plan if p["fp16_kv_gb"] > 20],
        "goal_32k_b16_faster_than_fp16": None
        if goal is None
        else goal["t_triton_ms"] < goal["t_sdpa_fp16_ms"],
    }


def bench_codec(args, device: torch.device) -> dict:
    """NVDEC (auto) restore vs CPU decode vs GPU recompute of one chunk, per layer and per chunk."""
    from ragkv.model.forward import compute_chunk_kv
    from ragkv.store.codecs.video import VideoCodec, nvdec

    shape = TINY if args.dry_run else LLAMA8B
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    n_tok = 64 if args.dry_run else args.chunk_tokens
    m, _ = make_model(args.layers, shape, str(device), dtype)
    chunk = tokens(n_tok, shape["vocab"], 1)
    kv = compute_chunk_kv(m, chunk)
    recompute_s = timed(lambda: compute_chunk_kv(m, chunk), args.runs, device)
    k, v = kv.k.float().cpu(), kv.v.float().cpu()
    codec = VideoCodec(
        planes="yuv420", small_frames="pad", preset=args.preset, group_layers=3, slots=args.slots
    )
    t0 = time.perf_counter()
    segs = [(a, b, codec.encode(k[a:b], v[a:b], layer_start=a)) for a, b in codec.groups(k.shape[0])]
    encode_s = time.perf_counter() - t0
    kv_bytes = 2 * kv.k.numel() * kv.k.element_size()
    ref_k = torch.cat([codec.quantized_reference(k[a:b], v[a:b], dtype=dtype)[0] for a, b, _ in segs])

    def restore(dec: VideoCodec, dev: torch.device):
        out_k = torch.empty(k.shape, dtype=dtype, device=dev)
        out_v = torch.empty_like(out_k)

        def run():
            for a, b, data in segs:
                dec.decode_into(data, out_k[a:b], out_v[a:b])

        return run, out_k

    cpu_dec = VideoCodec(decoder="cpu", threads=1)
    cpu_run, cpu_out = restore(cpu_dec, torch.device("cpu"))
    cpu_s = timed(cpu_run, args.runs, torch.device("cpu"))
    dev_dec = VideoCodec(decoder="auto")
    dev_run, dev_out = restore(dev_dec, device)
    res = {
        "model": {"layers": args.layers, **shape, "dtype": str(dtype)},
        "chunk_tokens": n_tok,
        "kv_bytes": kv_bytes,
        "video_bytes": sum(len(d) for _, _, d in segs),
        "frame": list(codec.layout_for(3, n_tok, m.config.num_kv_heads, m.config.head_dim).frame_shape),
        "slots": args.slots,
        "encode_s": round(encode_s, 3),
        "recompute_s": recompute_s,
        "cpu_decode_s": cpu_s,
        "cpu_decode_gb_s": kv_bytes / cpu_s / 1e9,
        "nvdec_available": nvdec.available(),
        "nvdec_import_error": nvdec.IMPORT_ERROR,
    }
    try:
        dev_s = timed(dev_run, args.runs, device)
        res.update(
            restore_s=dev_s,
            restore_gb_s=kv_bytes / dev_s / 1e9,
            restore_decoder="+".join(sorted(dev_dec.decoded_by)),
            restore_bit_exact=bool(torch.equal(dev_out.cpu(), ref_k) and torch.equal(cpu_out, ref_k)),
            restore_over_recompute=dev_s / recompute_s,
            per_layer_restore_ms=dev_s / args.layers * 1e3,
            per_layer_recompute_ms=recompute_s / args.layers * 1e3,
            goal_restore_faster_than_recompute=dev_s < recompute_s,
        )
    except Exception as e:  # noqa: BLE001 - report, never crash the suite
        res["restore_error"] = f"{type(e).__name__}: {e}"
    return res


def bench_runtime(args, device: torch.device) -> dict:
    """TTFT full vs blend vs transformers (same weights) on ``device``."""
    from transformers import AutoModelForCausalLM

    from ragkv.blend import BlendSchedule, prefill
    from ragkv.model.forward import compute_chunk_kv

    shape = TINY if args.dry_run else LLAMA8B
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    n_chunks, chunk_tokens = (2, 32) if args.dry_run else (args.chunks, args.chunk_tokens)
    m, hf_cfg = make_model(args.layers, shape, str(device), dtype)
    need = 1 + n_chunks * chunk_tokens + 32
    if need > m.config.max_position:  # fail before any work (an H100 run once spent 39 s to learn this)
        raise SystemExit(
            f"--chunks x --chunk-tokens: a {need}-token prompt exceeds the {m.config.max_position}-position model"
        )
    chunks = [tokens(chunk_tokens, shape["vocab"], 10 + i) for i in range(n_chunks)]
    question = tokens(32, shape["vocab"], 99)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    sched = BlendSchedule.single(args.ratio)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    hf = hf.to(dtype).eval()
    missing, unexpected = hf.load_state_dict(hf_weights(m), strict=False)
    if unexpected or any("rotary" not in x for x in missing):
        raise RuntimeError(f"weights do not map onto transformers' model: {missing} {unexpected}")
    ids = torch.tensor([[1, *sum(chunks, []), *question]], device=device)

    def hf_ttft():
        with torch.inference_mode():
            return hf(ids).logits[0, -1].argmax()

    full = prefill(m, [1], chunks, question, "full")
    hf_first = int(hf_ttft())
    res = {
        "model": {"layers": args.layers, **shape, "dtype": str(dtype)},
        "prompt_tokens": int(ids.shape[1]),
        "ttft_full_s": timed(
            lambda: prefill(m, [1], chunks, question, "full").logits.argmax(), args.runs, device
        ),
        "ttft_blend_s": timed(
            lambda: prefill(m, [1], kvs, question, "blend", schedule=sched).logits.argmax(), args.runs, device
        ),
        "ttft_transformers_s": timed(hf_ttft, args.runs, device),
        "first_token_full_equals_transformers": int(full.logits.argmax()) == hf_first,
    }
    res["blend_speedup_vs_full"] = res["ttft_full_s"] / res["ttft_blend_s"]
    res["full_vs_transformers"] = res["ttft_full_s"] / res["ttft_transformers_s"]
    return res


def bench_loading(args, device: torch.device) -> dict:
    """Blend with KV loaded per layer on a side stream (pipelined) vs loaded first (sequential)."""
    from eval.bench_loading import _load_to_memory
    from ragkv.blend import BlendSchedule, prefill
    from ragkv.blend.pipeline import StoredChunk, pipelined_factory
    from ragkv.kv import ChunkKV
    from ragkv.model.forward import compute_chunk_kv
    from ragkv.store import store_from_url

    shape = TINY if args.dry_run else dict(hidden=512, heads=8, kv_heads=2, inter=1536, vocab=32000)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    layers = 4 if args.dry_run else 32
    n_chunks, chunk_tokens = (2, 32) if args.dry_run else (args.chunks, args.chunk_tokens)
    m, _ = make_model(layers, shape, str(device), dtype)
    chunks = [tokens(chunk_tokens, shape["vocab"], 20 + i) for i in range(n_chunks)]
    question = tokens(32, shape["vocab"], 98)
    kvs = []
    for c in chunks:
        kv = compute_chunk_kv(m, c)
        kvs.append(ChunkKV(kv.token_ids, kv.k.cpu(), kv.v.cpu(), kv.start_pos, kv.fingerprint))
    tmp = Path(tempfile.mkdtemp(prefix="ragkv-gpu-loading-"))
    store = store_from_url(f"file://{tmp}/kv?codec=raw")
    sched = BlendSchedule.single(args.ratio)
    try:
        for kv in kvs:
            assert store.put(kv)

        def refs():
            return [StoredChunk(store, kv.key, c, m.fingerprint) for kv, c in zip(kvs, chunks, strict=True)]

        in_mem = [
            ChunkKV(kv.token_ids, kv.k.to(device), kv.v.to(device), kv.start_pos, kv.fingerprint)
            for kv in kvs
        ]
        cases = {
            "load_only": lambda: _load_to_memory(m, refs(), kvs),
            "compute_only": lambda: prefill(m, [1], in_mem, question, "blend", schedule=sched),
            "sequential": lambda: prefill(
                m, [1], _load_to_memory(m, refs(), kvs), question, "blend", schedule=sched
            ),
            "pipelined": lambda: prefill(
                m,
                [1],
                refs(),
                question,
                "blend",
                schedule=sched,
                source_factory=pipelined_factory(m, depth=2),
            ),
        }
        res = {k: timed(fn, args.runs, device) for k, fn in cases.items()}
        a = prefill(
            m, [1], refs(), question, "blend", schedule=sched, source_factory=pipelined_factory(m, depth=2)
        )
        b = prefill(m, [1], in_mem, question, "blend", schedule=sched)
        res["pipelined_equals_in_memory"] = bool(torch.equal(a.logits, b.logits))
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    res["pipelined_over_sequential"] = res["pipelined"] / res["sequential"]
    res["pipelined_over_max"] = res["pipelined"] / max(res["load_only"], res["compute_only"])
    res["model"] = {"layers": layers, **shape, "dtype": str(dtype)}
    return res


def step(what: str) -> None:
    """One progress line, flushed: a step cut off by its time budget says where it was."""
    print(f"[bench_gpu] {what}", file=sys.stderr, flush=True)


def bench_graph(args, device: torch.device) -> dict:
    """Decode tokens/s at batch 1: CUDA graph vs eager static step vs the growing-cache decode."""
    from eval.static_decode import StaticDecoder
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, generate

    out = {}
    models = (
        {"small": (TINY, 2)}
        if args.dry_run
        else {
            "small": (dict(hidden=512, heads=8, kv_heads=2, inter=1536, vocab=32000), 8),
            "llama8b_shape": (LLAMA8B, args.layers),
        }
    )
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    n_new = 16 if args.dry_run else args.new_tokens
    for name, (shape, layers) in models.items():
        step(f"graph {name}: building the model")
        m, _ = make_model(layers, shape, str(device), dtype)
        prompt = [1, *tokens(127, shape["vocab"], 5)]
        res = prefill(m, prompt, [], [], "full")
        cap = len(prompt) + n_new + 1
        row = {"layers": layers, **shape, "new_tokens": n_new}
        params = SamplingParams(max_new_tokens=n_new, stop_token_ids=())
        step(f"graph {name}: generate (growing cache)")
        ref = generate(m, res, params).token_ids
        row["generate_tok_s"] = n_new / timed(
            lambda m=m, res=res, p=params: generate(m, res, p), args.runs, device
        )
        step(f"graph {name}: static decoder, eager")
        eager = StaticDecoder(m, cap)
        row["static_eager_tok_s"] = n_new / timed(
            lambda e=eager, res=res: e.greedy(res, n_new), args.runs, device
        )
        row["static_eager_tokens_equal_generate"] = eager.greedy(res, n_new) == ref
        if device.type == "cuda":
            step(f"graph {name}: capturing the CUDA graph")
            g = StaticDecoder(m, cap)
            g.capture()
            row["graph_tok_s"] = n_new / timed(
                lambda g=g, res=res: g.greedy(res, n_new, use_graph=True), args.runs, device
            )
            row["graph_tokens_equal_static_eager"] = g.greedy(res, n_new, use_graph=True) == eager.greedy(
                res, n_new
            )
            row["graph_over_eager"] = row["graph_tok_s"] / row["generate_tok_s"]
            row["goal_graph_2x_eager"] = row["graph_over_eager"] >= 2.0
        out[name] = row
        del m
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


BENCHES = {
    "hack": bench_hack,
    "codec": bench_codec,
    "runtime": bench_runtime,
    "loading": bench_loading,
    "graph": bench_graph,
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=SECTIONS)
    ap.add_argument("--out", required=True, help="folder for SECTION.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: plumbing only")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=3, help="layers of the Llama-3-8B-shaped model")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--preset", default="ultrafast", help="x265 preset for the codec section's encode")
    ap.add_argument(
        "--slots", type=int, default=64, help="token slots per frame (the codec's resolution version)"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.runs = 1
        torch.set_num_threads(1)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    t0 = time.perf_counter()
    result = {"section": args.section, "dry_run": args.dry_run, "device": str(device)}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    result["torch"] = torch.__version__
    result.update(BENCHES[args.section](args, device))
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.section}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
