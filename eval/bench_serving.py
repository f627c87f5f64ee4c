"""Serving benchmark: engine modes side by side on a Poisson RAG workload, and BFF fidelity.

Part 1 - BFF compression and fidelity on the shared *trained* model (stories260k, 5 layers: fuse
layers 1-3; random weights give unrealistic block similarity). A RAG batch of ``--bff-requests``
requests (BOS + 5 chunks drawn from a pool of model-written story chunks + a question, ~250
tokens, blend prefill) is prefilled; BFF fuses the batch at the prefill->decode transition and the
blocks really freed are counted in the same run. Fidelity is the KL of the first decode step's
next-token distribution (the first one that reads fused KV) against the same engine unfused.
The threshold (and multi-match mode, ``--multi-match``) is calibrated on one batch: the highest
compression whose mean KL stays within ``--kl-budget * --calib-margin``; it is reported on a fresh
batch. Every mode's first-token agreement/KL with full prefill is measured here too.

Part 2 - serving on a random-weight benchmark model sized for CPU: Poisson arrivals of RAG
requests over a shared MuSiQue chunk pool (6 chunks per request out of its question's 10, so chunks
recur across requests), chunk KV ingested in a store beforehand, a KV budget of ``--kv-requests``
dense requests. Modes: full prefill, prefix caching, blend, blend+BFF (Part 1's threshold),
blend+BFF+HACK (same byte budget, 2-bit blocks). Saturation (all requests at t=0, ``--runs`` runs,
modes interleaved) gives each mode's capacity; finite rates are multiples of full prefill's
capacity. Goodput = the best tested rate whose median TTFT meets the SLO (``--slo-factor`` x full
prefill's median per-request prefill time): throughput at equal TTFT.

    python -m eval.bench_serving [--quick] [--requests 16 --rates 0.5,1,2,3 --runs 2 --bff-requests 64]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from eval.prompts import DATA_DIR, TINY_MODEL
from ragkv.blend import PrefixCache, prefill
from ragkv.engine import Engine, EngineBusyError, EngineConfig, SchedulerConfig, percentile
from ragkv.engine.paged_cache import batched_decode_step
from ragkv.engine.provider import ChunkProvider
from ragkv.fusion import FusionConfig
from ragkv.generate import SamplingParams
from ragkv.kv import compute_chunk_kv
from ragkv.metrics import first_token_kl
from ragkv.model import load_model, random_model
from ragkv.store import MemoryStore

THRESHOLDS = (0.999, 0.995, 0.99, 0.98, 0.95, 0.9)
QUESTIONS = ("What did Lily do?", "Where did Tom go?", "Why was the dog sad?", "Who found the ball?")


def tune_malloc() -> None:
    """Let glibc reuse freed large blocks instead of mmap/munmap per tensor (Linux only; no-op elsewhere).

    On the project VM a fresh mmap'd allocation costs a page fault per 4 KiB, which made mid-sized
    tensor ops 10-100x slower than their arithmetic (e.g. a 1.7 MB ``torch.cat``: 16 ms vs 0.4 ms) and
    drowned every mode's compute in allocator noise. Same effect as ``MALLOC_MMAP_THRESHOLD_=1G``.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return


# ---- part 1: BFF on the trained model ----------------------------------------------------------------
def story_chunks(model, n: int, length: int, seed: int) -> list[list[int]]:
    """In-distribution chunks: text the trained model writes itself after BOS (temperature 1), batched."""
    with Engine(model, EngineConfig(mode="full", num_blocks=n * model.config.num_layers * 8)) as eng:
        reqs = [
            dict(
                prefix=[model.config.bos_token_id],
                params=SamplingParams(
                    max_new_tokens=length, temperature=1.0, seed=seed * 1000 + i, stop_token_ids=()
                ),
            )
            for i in range(n)
        ]
        return [o.token_ids for o in eng.generate(reqs)]


def rag_batch(model, pool: list[list[int]], n: int, k: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    qs = [model.encode(q) for q in QUESTIONS]
    return [
        dict(
            prefix=[model.config.bos_token_id],
            chunks=rng.sample(pool, k),
            question=rng.choice(qs),
            mode="blend",
            params=SamplingParams(max_new_tokens=4),
        )
        for _ in range(n)
    ]


def bff_run(model, provider, reqs, fusion: FusionConfig | None, attention: str = "fp16") -> dict:
    """Prefill the batch, let the engine fuse it, then one decode step; logits + block counts."""
    n = len(reqs)
    cfg = EngineConfig(
        mode="blend",
        attention=attention,
        num_blocks=n * model.config.num_layers * 20,
        bff=fusion,
        scheduler=SchedulerConfig(max_num_seqs=n, max_queue=n, max_prefill_tokens=1 << 30),
    )
    eng = Engine(model, cfg, provider=provider)
    try:
        hs = [eng.submit(**r) for r in reqs]
        while len(eng.scheduler.running) < n or (fusion is not None and eng.bff_stats.runs == 0):
            if not eng.step():
                time.sleep(0.001)
        layers = fusion.fused_layers(model.config.num_layers) if fusion else [1, 2, 3]
        run = sorted(eng.scheduler.running, key=lambda r: r.request_id)
        phys = {layer: len({b for r in run for b in r.seq.tables[layer]}) for layer in layers}
        used = eng.pool.manager.num_used
        order = {h.request_id: i for i, h in enumerate(hs)}
        logits = batched_decode_step(model, [r.seq for r in run], [r.next_token for r in run])
        out = torch.empty_like(logits)
        for r, lg in zip(run, logits, strict=True):
            out[order[r.request_id]] = lg
        st = eng.bff_stats
        return dict(logits=out, phys=phys, used=used, freed=st.blocks_freed, stats=st.as_dict())
    finally:
        eng.shutdown()


def fidelity(base: dict, fused: dict) -> dict:
    kls = [first_token_kl(a, b) for a, b in zip(base["logits"], fused["logits"], strict=True)]
    agree = sum(
        int(a.argmax()) == int(b.argmax()) for a, b in zip(base["logits"], fused["logits"], strict=True)
    )
    before = sum(base["phys"].values())
    after = sum(fused["phys"].values())
    return dict(
        kl=statistics.mean(kls),
        kl_max=max(kls),
        agreement=agree / len(kls),
        cr=before / max(1, after),
        cr_per_layer={layer: base["phys"][layer] / max(1, fused["phys"][layer]) for layer in base["phys"]},
        freed=fused["freed"],
        used_before=fused["used"] + fused["freed"],
        used_after=fused["used"],
        check=(base["used"] - fused["used"]) == fused["freed"],
    )


def part1(args) -> dict:
    model = load_model(TINY_MODEL)
    t0 = time.perf_counter()
    pool = story_chunks(model, args.bff_pool, 48, seed=7)
    provider = ChunkProvider(model)
    for c in pool:
        provider.remember(compute_chunk_kv(model, c))
    calib = rag_batch(model, pool, args.bff_requests, 5, seed=1)
    evalb = rag_batch(model, pool, args.bff_requests, 5, seed=2)
    ntok = statistics.mean(1 + sum(len(c) for c in r["chunks"]) + len(r["question"]) for r in evalb)
    print(
        f"\n== Part 1: BFF on stories260k: {args.bff_requests} requests of ~{ntok:.0f} tokens, layers 1-3 "
        f"(pool of {len(pool)} chunks; setup {time.perf_counter() - t0:.1f}s)"
    )

    def fcfg(thr, **kw):
        return FusionConfig(threshold=thr, every=args.bff_requests, skip_first=1, skip_last=1, **kw)

    base_c = bff_run(model, provider, calib, None)
    print(
        f"{'thr':>6} {'multi-match':>11} {'CR':>6} {'KL mean':>9} {'KL max':>8} {'agree':>6} {'freed':>6}  (calibration)"
    )
    sweep = []
    for thr in args.thresholds:
        for mm in args.multi_match:
            f = fidelity(base_c, bff_run(model, provider, calib, fcfg(thr, multi_match=mm)))
            sweep.append((thr, mm, f))
            print(
                f"{thr:6.3f} {mm:>11} {f['cr']:6.2f} {f['kl']:9.5f} {f['kl_max']:8.4f} {f['agreement']:6.2f} "
                f"{f['freed']:6d}"
            )
    budget = args.kl_budget * args.calib_margin
    ok = [(f["cr"], thr, mm) for thr, mm, f in sweep if f["kl"] <= budget]
    _, thr, mm = max(ok) if ok else (0.0, max(args.thresholds), args.multi_match[0])
    other = "paper" if mm == "argmax" else "argmax"
    base_e = bff_run(model, provider, evalb, None)
    res = fidelity(base_e, bff_run(model, provider, evalb, fcfg(thr, multi_match=mm)))
    arg = fidelity(base_e, bff_run(model, provider, evalb, fcfg(thr, multi_match=other)))
    rep = fidelity(base_e, bff_run(model, provider, evalb, fcfg(thr, multi_match=mm, attention="replicate")))
    hack = fidelity(base_e, bff_run(model, provider, evalb, fcfg(thr, multi_match=mm), attention="hack"))
    hack0 = fidelity(base_e, bff_run(model, provider, evalb, None, attention="hack"))
    print(
        f"chosen: threshold {thr}, multi-match {mm} (highest CR with calibration KL <= {budget}); evaluation batch:"
    )
    print(
        f"  {mm:>6} multi-match: CR {res['cr']:.2f} (per layer "
        + ", ".join(f"{k}: {v:.2f}" for k, v in res["cr_per_layer"].items())
        + f"), KL {res['kl']:.5f} (max {res['kl_max']:.4f}), agreement {res['agreement']:.2f}, blocks used "
        f"{res['used_before']} -> {res['used_after']} (freed {res['freed']}, all layers)"
    )
    print(
        f"  {other:>6} multi-match: CR {arg['cr']:.2f}, KL {arg['kl']:.5f}, agreement {arg['agreement']:.2f}"
    )
    print(
        f"  replicate-rescaled (paper accuracy mode, nothing freed): KL {rep['kl']:.5f}, freed {rep['freed']}"
        f"  (norm-aware vs replicate KL difference {abs(rep['kl'] - res['kl']):.2e})"
    )
    print(
        f"  HACK 2-bit decode vs fp16: KL {hack0['kl']:.4f} (agreement {hack0['agreement']:.2f}) alone, "
        f"{hack['kl']:.4f} ({hack['agreement']:.2f}) with BFF"
    )
    # every mode's fidelity on the trained model: first token vs full prefill, first decode step vs blend
    pc = PrefixCache()
    first: dict[str, list] = {m: [] for m in ("full", "prefix", "blend")}
    for r in evalb:
        kvs = [provider.ready_now(c, True) for c in r["chunks"]]
        pre, q = r["prefix"], r["question"]
        first["full"].append(prefill(model, pre, r["chunks"], q, "full").logits)
        first["prefix"].append(prefill(model, pre, r["chunks"], q, "prefix", prefix_cache=pc).logits)
        first["blend"].append(prefill(model, pre, kvs, q, "blend").logits)
    modes = {}
    for m in ("full", "prefix", "blend"):
        pairs = list(zip(first["full"], first[m], strict=True))
        modes[m] = dict(
            agreement=statistics.mean(int(a.argmax()) == int(b.argmax()) for a, b in pairs),
            kl=statistics.mean(first_token_kl(a, b) for a, b in pairs),
        )
    modes["blend+bff"] = dict(modes["blend"], decode_kl=res["kl"], decode_agreement=res["agreement"])
    modes["blend+bff+hack"] = dict(modes["blend"], decode_kl=hack["kl"], decode_agreement=hack["agreement"])
    print(
        f"{'mode':>15} {'1st-token agree':>15} {'KL vs full':>10} {'decode-step KL vs blend':>23} {'agree':>6}"
    )
    for m, f in modes.items():
        print(
            f"{m:>15} {f['agreement']:15.2f} {f['kl']:10.4f} {f.get('decode_kl', 0.0):23.5f} "
            f"{f.get('decode_agreement', 1.0):6.2f}"
        )
    return dict(
        multi_match=mm,
        hack_alone=hack0,
        threshold=thr,
        eval=res,
        argmax=arg,
        replicate=rep,
        hack=hack,
        modes=modes,
        sweep=[(t, m, f["cr"], f["kl"]) for t, m, f in sweep],
    )


# ---- part 2: serving throughput on the benchmark model ---------------------------------------------------
def musique_workload(
    tok_model, n_items: int, n_requests: int, chunk_tokens: int, seed: int
) -> tuple[list, list]:
    data = json.loads((DATA_DIR / "musique_s.json").read_text())[:n_items]
    items = []
    for d in data:
        ctx = [tok_model.encode(c["title"] + ". " + c["text"])[:chunk_tokens] for c in d["ctxs"]]
        items.append((tok_model.encode(d["question"])[:32], [c for c in ctx if len(c) >= 8]))
    rng = random.Random(seed)
    prefix = [tok_model.config.bos_token_id] + tok_model.encode(
        "Answer the question using the passages below."
    )
    reqs = []
    for _ in range(n_requests):
        q, ctx = items[rng.randrange(len(items))]
        reqs.append(dict(prefix=prefix, chunks=rng.sample(ctx, 6), question=q))
    pool = {tuple(c) for _, ctx in items for c in ctx}
    return reqs, [list(c) for c in pool]


def serve(model, store, reqs, arrivals, cfg: EngineConfig, max_new: int) -> dict:
    """Submit ``reqs`` at ``arrivals`` (seconds) to a background engine; per-request and engine figures."""
    eng = Engine(model, cfg, store=store)
    eng.start()
    handles = []
    t0 = time.perf_counter()
    try:
        for r, at in zip(reqs, arrivals, strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            while True:
                try:
                    handles.append(
                        eng.submit(**r, params=SamplingParams(max_new_tokens=max_new, stop_token_ids=()))
                    )
                    break
                except EngineBusyError:
                    time.sleep(0.005)
        outs = [h.result(timeout=600) for h in handles]
        m = eng.metrics()
    finally:
        eng.shutdown()
    span = max(o.metrics.finished for o in outs) - t0
    ttft = [o.metrics.ttft_s for o in outs]
    pre = [o.metrics.prefill_s for o in outs if o.metrics.prefill_s is not None]
    tpot = [o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None]
    return dict(
        rps=len(outs) / span,
        tps=sum(len(o.token_ids) for o in outs) / span,
        span=span,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        peak_bytes=m.kv_bytes_peak,
        peak_blocks=m.kv_blocks_peak,
        blocks_total=m.kv_blocks_total,
        bff=m.bff,
        failed=m.requests_failed,
        prefill_p50=percentile(pre, 50),
    )


def part2(args, threshold: float, multi_match: str) -> dict:
    over = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    model = random_model("llama", seed=0, **over)
    tok_model = load_model(TINY_MODEL)  # its tokenizer (vocab 512) only
    reqs, pool = musique_workload(tok_model, args.items, args.requests, args.chunk_tokens, seed=3)
    t0 = time.perf_counter()
    store = MemoryStore()
    for c in pool:
        store.put(compute_chunk_kv(model, c))
    ntok = statistics.mean(len(r["prefix"]) + sum(map(len, r["chunks"])) + len(r["question"]) for r in reqs)
    c = model.config
    dense_block = 2 * 16 * c.num_kv_heads * c.head_dim * 4
    per_req = c.num_layers * math.ceil((ntok + args.max_new) / 16)
    budget = args.kv_requests * per_req * dense_block
    print(
        f"\n== Part 2: serving, random model ({args.layers} layers, hidden {args.hidden}, GQA "
        f"{args.heads}/{args.kv_heads}), {args.requests} requests of ~{ntok:.0f} tokens + {args.max_new} new, "
        f"{len(pool)} distinct chunks (ingest {time.perf_counter() - t0:.1f}s), KV budget "
        f"{budget / 2**20:.1f} MiB = {args.kv_requests} dense requests"
    )
    sched = SchedulerConfig(max_num_seqs=64, max_queue=4 * args.requests, max_prefill_tokens=4096)
    skip = 2 if args.layers >= 6 else 1
    # Part 1's configuration as is: on random weights it fuses mostly the blocks of chunks reused at
    # the same position (near-identical KV), so its compression here is not the trained model's.
    bff = FusionConfig(threshold=threshold, every=8, skip_first=skip, skip_last=skip, multi_match=multi_match)
    modes = {
        "full": EngineConfig(mode="full"),
        "prefix": EngineConfig(mode="prefix"),
        "blend": EngineConfig(mode="blend"),
        "blend+bff": EngineConfig(mode="blend", bff=bff),
        "blend+bff+hack": EngineConfig(mode="blend", bff=bff, attention="hack"),
    }
    modes = {k: v for k, v in modes.items() if k in args.modes}
    for cfg in modes.values():
        cfg.kv_memory_bytes = budget
        cfg.scheduler = sched
    serve(model, store, reqs[:2], [0.0, 0.0], EngineConfig(mode="full", scheduler=sched), 2)  # warm-up
    results: dict[str, dict] = {m: {} for m in modes}
    sat: dict[str, list] = {m: [] for m in modes}
    for _ in range(args.runs):  # saturation runs, modes interleaved
        for name, cfg in modes.items():
            sat[name].append(serve(model, store, reqs, [0.0] * len(reqs), cfg, args.max_new))
    for name in modes:
        runs = sorted(sat[name], key=lambda r: r["rps"])
        results[name]["inf"] = dict(runs[len(runs) // 2], rps=statistics.mean(r["rps"] for r in runs))
    cap_full = results["full"]["inf"]["rps"] if "full" in results else 1.0
    rng = random.Random(11)
    for mult in args.rates:
        rate = mult * cap_full
        gaps = [rng.expovariate(rate) for _ in reqs]
        arrivals = [sum(gaps[:i]) for i in range(len(reqs))]
        for name, cfg in modes.items():
            results[name][f"{mult:g}x"] = serve(model, store, reqs, arrivals, cfg, args.max_new)
    slo = None
    if "full" in results and args.rates:
        slo = args.slo_factor * results["full"]["inf"]["prefill_p50"]
    print(
        f"{'mode':>15} {'rate':>6} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} "
        f"{'p99':>7} {'prefill p50':>11} {'peak KV MiB':>11} {'blocks':>11} {'BFF s':>6}"
    )
    summary = {}
    for name in modes:
        goodput = 0.0
        for label, r in results[name].items():
            if slo is not None and label != "inf" and r["ttft_p50"] <= slo:
                goodput = max(goodput, r["rps"])
            print(
                f"{name:>15} {label:>6} {r['rps']:7.2f} {r['tps']:7.1f} {r['ttft_p50']:9.3f} {r['ttft_p99']:7.3f} "
                f"{r['tpot_p50']:9.4f} {r['tpot_p99']:7.4f} {r['prefill_p50']:11.4f} {r['peak_bytes'] / 2**20:11.2f} "
                f"{r['peak_blocks']:5d}/{r['blocks_total']:<5d} {r['bff']['time_s']:6.2f}"
            )
        sat_r = results[name]["inf"]
        summary[name] = dict(
            rps=sat_r["rps"],
            tps=sat_r["tps"],
            ttft_p50=sat_r["ttft_p50"],
            ttft_p99=sat_r["ttft_p99"],
            tpot_p50=sat_r["tpot_p50"],
            tpot_p99=sat_r["tpot_p99"],
            peak_kv_mib=sat_r["peak_bytes"] / 2**20,
            goodput_rps=goodput,
            prefill_p50=sat_r["prefill_p50"],
            failed=sat_r["failed"],
            bff_cr_per_layer=sat_r["bff"]["cr_per_layer"] if sat_r["bff"]["runs"] else None,
        )
        if sat_r["bff"]["runs"]:
            print(
                f"{'':>15} BFF per layer CR (saturation run): "
                + ", ".join(f"{k}: {v:.2f}" for k, v in sat_r["bff"]["cr_per_layer"].items())
            )
    if slo is not None:
        print(
            f"goodput SLO: median TTFT <= {slo:.3f}s ({args.slo_factor:g} x full prefill's median prefill time)"
        )
    return dict(summary=summary, slo_s=slo, cap_full=cap_full)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (~1 min)")
    ap.add_argument("--bff-requests", type=int, default=64)
    ap.add_argument("--bff-pool", type=int, default=24, help="story chunks in the part-1 pool")
    ap.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",")], default=list(THRESHOLDS))
    ap.add_argument(
        "--multi-match", type=lambda s: s.split(","), default=["paper"], help="modes swept in calibration"
    )
    ap.add_argument("--kl-budget", type=float, default=0.01)
    ap.add_argument("--calib-margin", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--items", type=int, default=6, help="MuSiQue questions whose chunks form the pool")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--kv-requests", type=int, default=8, help="KV budget in dense requests")
    ap.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",") if x],
        default=[0.5, 1.0, 2.0, 3.0],
        help="finite request rates as multiples of full prefill's capacity",
    )
    ap.add_argument("--runs", type=int, default=2, help="saturation runs per mode (mean req/s)")
    ap.add_argument(
        "--slo-factor",
        type=float,
        default=4.0,
        help="TTFT SLO in units of full prefill's median prefill time",
    )
    ap.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["full", "prefix", "blend", "blend+bff", "blend+bff+hack"],
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for this process (0: torch's default)"
    )
    ap.add_argument(
        "--no-malloc-tune",
        action="store_true",
        help="keep glibc's default mmap threshold (every large tensor allocation then page-faults afresh)",
    )
    args = ap.parse_args(argv)
    if not args.no_malloc_tune:
        tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.bff_requests, args.bff_pool, args.thresholds = 16, 12, [0.97, 0.93, 0.9]
        args.requests, args.items, args.chunk_tokens, args.max_new = 8, 3, 64, 6
        args.rates, args.runs, args.layers = [0.5, 2.0], 1, 4
    t0 = time.perf_counter()
    p1 = part1(args)
    p2 = part2(args, p1["threshold"], p1["multi_match"])
    s = p2["summary"]
    full, blend = s.get("full"), s.get("blend")
    out = dict(
        throughput_blend_over_full=(blend["rps"] / full["rps"]) if full and blend else None,
        prefill_speedup_blend_over_full=(full["prefill_p50"] / blend["prefill_p50"])
        if full and blend
        else None,
        goodput_blend_over_full=(blend["goodput_rps"] / full["goodput_rps"])
        if full and blend and full["goodput_rps"]
        else None,
        bff_cr=p1["eval"]["cr"],
        bff_kl=p1["eval"]["kl"],
        bff_agreement=p1["eval"]["agreement"],
        bff_threshold=p1["threshold"],
        bff_cr_per_layer=p1["eval"]["cr_per_layer"],
        bff_blocks_used_before_after=[p1["eval"]["used_before"], p1["eval"]["used_after"]],
        bff_multi_match=p1["multi_match"],
        bff_other_multi_match_cr_kl=[p1["argmax"]["cr"], p1["argmax"]["kl"]],
        hack_decode_kl=[p1["hack_alone"]["kl"], p1["hack"]["kl"]],
        modes={
            k: {
                kk: (round(vv, 4) if isinstance(vv, float) else vv)
                for kk, vv in {**v, **p1["modes"][k]}.items()
            }
            for k, v in s.items()
        },
        slo_s=p2["slo_s"],
        seconds=time.perf_counter() - t0,
    )
    print(f"\ntotal {out['seconds']:.0f}s")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
