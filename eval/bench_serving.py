"""Serving benchmark: engine modes side by side on a Poisson RAG workload, and BFF fidelity.

Part 1 - BFF compression and fidelity on a *trained* model (``--model``; random weights give
unrealistic block similarity). Default: the tiny stories260k (5 layers: fuse layers 1-3), requests of
BOS + 5 chunks drawn from a pool of model-written story chunks + a question (~250 tokens). A real
checkpoint (``--model smollm2-135m-instruct``; fuse all but 2 layers at each end) gets MuSiQue
requests as ``ragkv.LLM`` builds them: the chat template around MuSiQue's instruction, 5 chunks
drawn from a pool of ``--bff-chunk-tokens``-token MuSiQue passage heads, and a MuSiQue question.
A RAG batch of ``--bff-requests`` requests (blend prefill) is prefilled; BFF fuses the batch at the prefill->decode transition and the
blocks really freed are counted in the same run. Fidelity is the KL of the first decode step's
next-token distribution (the first one that reads fused KV) against the same engine unfused.
The threshold (and multi-match mode, ``--multi-match``) is calibrated on one batch: the highest
compression whose mean KL stays within ``--kl-budget * --calib-margin``; it is reported on a fresh
batch. Every mode's first-token agreement/KL with full prefill is measured here too.

Part 2 - serving on a random-weight benchmark model sized for CPU (``--layers``/``--hidden``/...), or
with ``--model`` on that checkpoint (the random-model options are then ignored; prompts in its chat
template as in part 1): Poisson arrivals of RAG requests over a shared MuSiQue chunk pool
(``--chunks-per-request`` chunks per request out of its question's 10, so chunks recur across requests), chunk KV ingested in a store beforehand, a KV budget of ``--kv-requests``
dense requests. Modes: full prefill, prefix caching, blend (at ``--ratio``, explicit: the fidelity gate's
point on the default model is exact prefill), blend+BFF (Part 1's threshold),
blend+BFF+HACK (same byte budget, 2-bit blocks). Saturation (all requests at t=0, ``--runs`` runs,
modes interleaved) gives each mode's capacity; finite rates are multiples of full prefill's
capacity. Goodput = the best tested rate whose median TTFT meets the SLO (``--slo-factor`` x full
prefill's median per-request prefill time): throughput at equal TTFT.

    python -m eval.bench_serving [--quick] [--requests 16 --rates 0.5,1,2,3 --runs 2 --bff-requests 64]
    python -m eval.bench_serving --model smollm2-135m-instruct --threads 1 --bff-requests 8 \
        --requests 8 --chunk-tokens 96 --rates 0.5,2 --runs 1      # the real model, CPU-sized
    python -m eval.bench_serving --model smollm2-135m-instruct --threads 1 --skip-bff --modes full,blend \
        --requests 8 --items 6 --chunk-tokens 96 --kv-requests 4 --rates "" --runs 2   # throughput only
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch

from eval.prompts import DATA_DIR, TINY_MODEL, get_spec, passage_text, query_text
from ragkv.blend import DEFAULT_RATIO, ChunkResolver, PrefixCache, prefill
from ragkv.blend.gate import ensure_gate
from ragkv.engine import Engine, EngineBusyError, EngineConfig, SchedulerConfig, percentile
from ragkv.engine.paged_cache import batched_decode_step
from ragkv.fidelity.plan import RequestSettings
from ragkv.fusion import FusionConfig
from ragkv.generate import SamplingParams
from ragkv.metrics import first_token_kl
from ragkv.model import load_model, random_model
from ragkv.model.chat import chat_parts, has_chat_template
from ragkv.model.forward import compute_chunk_kv
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


def is_tiny(model_name) -> bool:
    return Path(str(model_name)).resolve() == Path(TINY_MODEL).resolve()


def musique_frame(model):
    """(prefix ids, question -> suffix ids) of a MuSiQue RAG prompt as ``ragkv.LLM`` builds it: the chat
    template around the instruction, the passages and the query when the model has one, else BOS +
    the instruction and the plain query."""
    spec = get_spec("musique")
    if has_chat_template(model):
        prefix, _ = chat_parts(model, spec.prefix, "")
        return prefix, lambda q: chat_parts(model, spec.prefix, query_text(spec.query, q))[1]
    return model.encode(spec.prefix, add_bos=True), lambda q: model.encode(query_text(spec.query, q))


def fusion_skip(num_layers: int) -> int:
    """Layers left unfused at each end: 1 on a shallow model (stories260k: layers 1-3), else 2."""
    return 2 if num_layers >= 6 else 1


# ---- part 1: BFF on the trained model ----------------------------------------------------------------
def story_chunks(model, n: int, length: int, seed: int) -> list[list[int]]:
    """In-distribution chunks: text the trained model writes itself after BOS (temperature 1), batched."""
    with Engine(
        model, EngineConfig(settings=RequestSettings("full"), num_blocks=n * model.config.num_layers * 8)
    ) as eng:
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


def passage_chunks(model, n: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of ``n`` MuSiQue passages (title + text), spread over the samples."""
    data = json.loads((DATA_DIR / "musique_s.json").read_text())
    out = []
    for c in (c for d in data for c in d["ctxs"][:2]):
        ids = model.encode(passage_text(c.get("title", ""), c["text"]))[:length]
        if len(ids) == length:
            out.append(ids)
        if len(out) == n:
            break
    return out


def rag_batch(model, pool: list[list[int]], n: int, k: int, seed: int, frame=None) -> list[dict]:
    """``n`` blend requests of ``k`` chunks from ``pool``: BOS + story questions (tiny model), or the
    MuSiQue frame ``(prefix, question -> suffix)`` with MuSiQue questions."""
    rng = random.Random(seed)
    if frame is None:
        prefix, qs = [model.config.bos_token_id], [model.encode(q) for q in QUESTIONS]
    else:
        data = json.loads((DATA_DIR / "musique_s.json").read_text())
        prefix, qs = frame[0], [frame[1](d["question"]) for d in data[:16]]
    return [
        dict(
            prefix=prefix,
            chunks=rng.sample(pool, k),
            question=rng.choice(qs),
            mode="blend",
            params=SamplingParams(max_new_tokens=4, stop_token_ids=()),
        )
        for _ in range(n)
    ]


def hack_options(args) -> dict:
    """The engine's HACK options from the command line (empty: the engine's defaults)."""
    return dict(getattr(args, "hack", None) or {})


def bff_run(
    model,
    resolver,
    reqs,
    fusion: FusionConfig | None,
    attention: str = "fp16",
    layers: list[int] | None = None,
    decode_steps: int = 0,
    hack: dict | None = None,
    ratio: float = DEFAULT_RATIO,
) -> dict:
    """Prefill the batch, let the engine fuse it, then one decode step; logits + block counts
    (distinct physical blocks of ``layers``: by default the layers ``fusion`` fuses), then
    ``decode_steps`` more greedy batched decode steps, timed (``step_s``), and the KV bytes of the
    used blocks: as stored (``kv_bytes``: HACK pages + fp16 staging capacity) and in fp16."""
    n = len(reqs)
    longest = max(len(r["prefix"]) + sum(map(len, r["chunks"])) + len(r["question"]) for r in reqs)
    per_seq = max(
        20, math.ceil((longest + 8) / 16) + 2
    )  # blocks per layer (20: the tiny model's ~250 tokens)
    cfg = EngineConfig(
        settings=RequestSettings("blend", ratio),
        attention=attention,
        hack=dict(hack or {}),
        num_blocks=n * model.config.num_layers * per_seq,
        bff=fusion,
        scheduler=SchedulerConfig(max_num_seqs=n, max_queue=n, max_prefill_tokens=1 << 30),
    )
    eng = Engine(model, cfg, resolver=resolver)
    try:
        hs = [eng.submit(**r) for r in reqs]
        while len(eng.scheduler.running) < n or (fusion is not None and eng.bff_stats.runs == 0):
            if not eng.step():
                time.sleep(0.001)
        if layers is None:
            layers = fusion.fused_layers(model.config.num_layers) if fusion else [1, 2, 3]
        run = sorted(eng.scheduler.running, key=lambda r: r.request_id)
        phys = {layer: len({b for r in run for b in r.seq.table[layer].tolist()}) for layer in layers}
        used = eng.pool.manager.num_used
        order = {h.request_id: i for i, h in enumerate(hs)}
        seqs = [r.seq for r in run]
        logits = batched_decode_step(model, seqs, [r.next_token for r in run])
        out = torch.empty_like(logits)
        for r, lg in zip(run, logits, strict=True):
            out[order[r.request_id]] = lg
        t0 = time.perf_counter()
        toks = logits.argmax(-1).tolist()
        for _ in range(decode_steps):
            toks = batched_decode_step(model, seqs, toks).argmax(-1).tolist()
        step_s = (time.perf_counter() - t0) / max(1, decode_steps)
        pool, c = eng.pool, model.config
        blocks = pool.manager.num_used
        fp16_bytes = blocks * 2 * pool.block_size * c.num_kv_heads * c.head_dim * 2
        # dense: model-dtype blocks; HACK: its pages plus the fp16 staging capacity
        kv_bytes = blocks * pool.block_bytes + (pool.hack.staging_nbytes() if pool.hack else 0)
        st = eng.bff_stats
        return dict(
            logits=out,
            phys=phys,
            used=used,
            freed=st.blocks_freed,
            stats=st.as_dict(),
            step_s=step_s,
            kv_bytes=kv_bytes,
            fp16_bytes=fp16_bytes,
            tokens=sum(s.length for s in seqs),
        )
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
    tiny = is_tiny(args.model)
    model = load_model(args.model)
    t0 = time.perf_counter()
    if tiny:
        pool, frame, name = (
            story_chunks(model, args.bff_pool, args.bff_chunk_tokens, seed=7),
            None,
            "stories260k",
        )
    else:
        pool = passage_chunks(model, args.bff_pool, args.bff_chunk_tokens)
        frame, name = musique_frame(model), str(args.model)
    resolver = ChunkResolver(model)  # every pool chunk's KV in memory, computed once
    for c in pool:
        resolver.compute(c)
    calib = rag_batch(model, pool, args.bff_requests, 5, seed=1, frame=frame)
    evalb = rag_batch(model, pool, args.bff_requests, 5, seed=2, frame=frame)
    ntok = statistics.mean(
        len(r["prefix"]) + sum(len(c) for c in r["chunks"]) + len(r["question"]) for r in evalb
    )
    skip = fusion_skip(model.config.num_layers)

    def fcfg(thr, **kw):
        return FusionConfig(threshold=thr, every=args.bff_requests, skip_first=skip, skip_last=skip, **kw)

    layers = fcfg(1.0).fused_layers(model.config.num_layers)
    print(
        f"\n== Part 1: BFF on {name}: {args.bff_requests} requests of ~{ntok:.0f} tokens, layers "
        f"{layers[0]}-{layers[-1]} (pool of {len(pool)} chunks; setup {time.perf_counter() - t0:.1f}s)"
    )

    base_c = bff_run(model, resolver, calib, None, layers=layers)
    print(
        f"{'thr':>6} {'multi-match':>11} {'CR':>6} {'KL mean':>9} {'KL max':>8} {'agree':>6} {'freed':>6}  (calibration)"
    )
    sweep = []
    for thr in args.thresholds:
        for mm in args.multi_match:
            f = fidelity(base_c, bff_run(model, resolver, calib, fcfg(thr, multi_match=mm)))
            sweep.append((thr, mm, f))
            print(
                f"{thr:6.3f} {mm:>11} {f['cr']:6.2f} {f['kl']:9.5f} {f['kl_max']:8.4f} {f['agreement']:6.2f} "
                f"{f['freed']:6d}"
            )
    budget = args.kl_budget * args.calib_margin
    ok = [(f["cr"], thr, mm) for thr, mm, f in sweep if f["kl"] <= budget]
    _, thr, mm = max(ok) if ok else (0.0, max(args.thresholds), args.multi_match[0])
    other = "paper" if mm == "argmax" else "argmax"
    base_e = bff_run(model, resolver, evalb, None, layers=layers)
    res = fidelity(base_e, bff_run(model, resolver, evalb, fcfg(thr, multi_match=mm)))
    arg = fidelity(base_e, bff_run(model, resolver, evalb, fcfg(thr, multi_match=other)))
    rep = fidelity(base_e, bff_run(model, resolver, evalb, fcfg(thr, multi_match=mm, attention="replicate")))
    hopts = hack_options(args)
    hack = fidelity(
        base_e, bff_run(model, resolver, evalb, fcfg(thr, multi_match=mm), attention="hack", hack=hopts)
    )
    steps = args.decode_steps
    dense_run = bff_run(model, resolver, evalb, None, layers=layers, decode_steps=steps)
    hack_run = bff_run(
        model, resolver, evalb, None, attention="hack", layers=layers, decode_steps=steps, hack=hopts
    )
    hack0 = fidelity(base_e, hack_run)
    hack_mem = dict(
        physical_bytes_over_fp16=hack_run["kv_bytes"] / hack_run["fp16_bytes"],
        bytes_per_token=hack_run["kv_bytes"] / hack_run["tokens"],
        fp16_bytes_per_token=hack_run["fp16_bytes"] / hack_run["tokens"],
        decode_step_s=hack_run["step_s"],
        fp16_decode_step_s=dense_run["step_s"],
    )
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
        f"{hack['kl']:.4f} ({hack['agreement']:.2f}) with BFF; KV {hack_mem['bytes_per_token']:.0f} B/token "
        f"physically vs fp16 {hack_mem['fp16_bytes_per_token']:.0f} "
        f"({hack_mem['physical_bytes_over_fp16']:.3f}x); batched decode step of {len(evalb)}: "
        f"{hack_mem['decode_step_s']:.3f} s vs fp16 engine {hack_mem['fp16_decode_step_s']:.3f} s"
    )
    # every mode's fidelity on the trained model: first token vs full prefill, first decode step vs blend
    pc = PrefixCache()
    first: dict[str, list] = {m: [] for m in ("full", "prefix", "blend")}
    for r in evalb:
        kvs = [resolver.kv(c) for c in r["chunks"]]
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
        model=name,
        layers=layers,
        tokens=ntok,
        multi_match=mm,
        hack_alone=hack0,
        hack_mem=hack_mem,
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
    tok_model, n_items: int, n_requests: int, chunk_tokens: int, seed: int, per_request: int = 6, frame=None
) -> tuple[list, list]:
    """Requests of ``per_request`` of a MuSiQue question's passages; with ``frame`` (see
    :func:`musique_frame`) the prefix and question are the chat-template ones, else BOS + a short
    instruction and the bare question (the random model's workload)."""
    data = json.loads((DATA_DIR / "musique_s.json").read_text())[:n_items]
    items = []
    for d in data:
        ctx = [tok_model.encode(c["title"] + ". " + c["text"])[:chunk_tokens] for c in d["ctxs"]]
        q = frame[1](d["question"]) if frame else tok_model.encode(d["question"])[:32]
        items.append((q, [c for c in ctx if len(c) >= 8]))
    rng = random.Random(seed)
    if frame:
        prefix = frame[0]
    else:
        prefix = [tok_model.config.bos_token_id] + tok_model.encode(
            "Answer the question using the passages below."
        )
    reqs = []
    for _ in range(n_requests):
        q, ctx = items[rng.randrange(len(items))]
        reqs.append(dict(prefix=prefix, chunks=rng.sample(ctx, per_request), question=q))
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
    if is_tiny(args.model):
        model = random_model("llama", seed=0, **over)
        tok_model, frame = load_model(TINY_MODEL), None  # its tokenizer (vocab 512) only
        model_name = (
            f"random model ({args.layers} layers, hidden {args.hidden}, GQA {args.heads}/{args.kv_heads})"
        )
    else:
        model = tok_model = load_model(args.model)
        frame = musique_frame(model)
        c = model.config
        model_name = f"{args.model} ({c.num_layers} layers, hidden {c.hidden_size}, GQA {c.num_heads}/{c.num_kv_heads})"
    reqs, pool = musique_workload(
        tok_model, args.items, args.requests, args.chunk_tokens, 3, args.chunks_per_request, frame
    )
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
        f"\n== Part 2: serving, {model_name}, {args.requests} requests of ~{ntok:.0f} tokens + {args.max_new} new, "
        f"{len(pool)} distinct chunks (ingest {time.perf_counter() - t0:.1f}s), KV budget "
        f"{budget / 2**20:.1f} MiB = {args.kv_requests} dense requests"
    )
    sched = SchedulerConfig(max_num_seqs=64, max_queue=4 * args.requests, max_prefill_tokens=4096)
    skip = fusion_skip(c.num_layers)
    # Part 1's configuration as is: on random weights it fuses mostly the blocks of chunks reused at
    # the same position (near-identical KV), so its compression here is not the trained model's.
    bff = FusionConfig(threshold=threshold, every=8, skip_first=skip, skip_last=skip, multi_match=multi_match)
    modes = {
        "full": EngineConfig(settings=RequestSettings("full")),
        "prefix": EngineConfig(settings=RequestSettings("prefix")),
        # blending at an explicit ratio: with none the fidelity gate chooses, and on the default model its
        # point is exact prefill (the figures then compare full with full)
        "blend": EngineConfig(settings=RequestSettings("blend", args.ratio)),
        "blend+bff": EngineConfig(settings=RequestSettings("blend", args.ratio), bff=bff),
        "blend+bff+hack": EngineConfig(
            settings=RequestSettings("blend", args.ratio), bff=bff, attention="hack", hack=hack_options(args)
        ),
    }
    modes = {k: v for k, v in modes.items() if k in args.modes}
    for cfg in modes.values():
        cfg.kv_memory_bytes = budget
        cfg.scheduler = sched
    serve(
        model, store, reqs[:2], [0.0, 0.0], EngineConfig(settings=RequestSettings("full"), scheduler=sched), 2
    )  # warm-up
    ensure_gate(model)  # blending's one-time self-check of the model, not inside blend's first timed run
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
    return dict(summary=summary, slo_s=slo, cap_full=cap_full, model=model_name, tokens=ntok)


def hack_tpot_ratio(summary: dict) -> float | None:
    """Saturation TPOT p50 of blend+BFF+HACK over the same engine without HACK (blend+BFF, else blend)."""
    hack = summary.get("blend+bff+hack")
    dense = summary.get("blend+bff") or summary.get("blend")
    if not hack or not dense or not dense["tpot_p50"]:
        return None
    return hack["tpot_p50"] / dense["tpot_p50"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (~1 min)")
    ap.add_argument(
        "--skip-bff",
        action="store_true",
        help="part 2 only (BFF modes at threshold 0.995, paper multi-match)",
    )
    ap.add_argument("--bff-requests", type=int, default=64)
    ap.add_argument(
        "--model",
        default=str(TINY_MODEL),
        help="trained checkpoint for part 1, and with anything but the tiny default also part 2's model "
        "(name, GGUF, folder; default: stories260k for part 1, a random model for part 2)",
    )
    ap.add_argument("--bff-pool", type=int, default=24, help="chunks in the part-1 pool")
    ap.add_argument("--bff-chunk-tokens", type=int, default=48, help="tokens per part-1 chunk")
    ap.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",")], default=list(THRESHOLDS))
    ap.add_argument(
        "--multi-match", type=lambda s: s.split(","), default=["paper"], help="modes swept in calibration"
    )
    ap.add_argument("--kl-budget", type=float, default=0.01)
    ap.add_argument(
        "--ratio",
        type=float,
        default=DEFAULT_RATIO,
        help="blend modes' recompute ratio (explicit: the fidelity gate's point on the default model is exact)",
    )
    ap.add_argument(
        "--decode-steps", type=int, default=4, help="part 1: timed batched decode steps, fp16 vs HACK"
    )
    ap.add_argument("--calib-margin", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=12, help="random model (part 2 without --model)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--items", type=int, default=6, help="MuSiQue questions whose chunks form the pool")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--chunks-per-request", type=int, default=6)
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
        "--hack",
        type=json.loads,
        default=None,
        help='HACK options (JSON) of the engine\'s hack modes, e.g. \'{"preset": "rope", '
        "\"recent_window\": 32}' (RoPE-aware 3-bit keys); default: the engine's own HACK defaults",
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
    p1 = None if args.skip_bff else part1(args)
    p2 = part2(args, p1["threshold"] if p1 else 0.995, p1["multi_match"] if p1 else "paper")
    s = p2["summary"]
    full, blend = s.get("full"), s.get("blend")
    out = dict(
        model=str(args.model),
        part2_model=p2["model"],
        part2_tokens=p2["tokens"],
        throughput_blend_over_full=(blend["rps"] / full["rps"]) if full and blend else None,
        prefill_speedup_blend_over_full=(full["prefill_p50"] / blend["prefill_p50"])
        if full and blend
        else None,
        goodput_blend_over_full=(blend["goodput_rps"] / full["goodput_rps"])
        if full and blend and full["goodput_rps"]
        else None,
        hack_tpot_over_fp16=hack_tpot_ratio(s),
        modes={
            k: {
                kk: (round(vv, 4) if isinstance(vv, float) else vv)
                for kk, vv in {**v, **(p1["modes"].get(k, {}) if p1 else {})}.items()
            }
            for k, v in s.items()
        },
        slo_s=p2["slo_s"],
    )
    if p1:
        out.update(part1_summary(p1))
    out["seconds"] = time.perf_counter() - t0
    print(f"\ntotal {out['seconds']:.0f}s")
    print(json.dumps(out))
    return out


def part1_summary(p1: dict) -> dict:
    """Part 1's figures in the result line."""
    return dict(
        part1_model=p1["model"],
        bff_cr=p1["eval"]["cr"],
        bff_kl=p1["eval"]["kl"],
        bff_agreement=p1["eval"]["agreement"],
        bff_threshold=p1["threshold"],
        bff_layers=[p1["layers"][0], p1["layers"][-1]],
        bff_cr_per_layer=p1["eval"]["cr_per_layer"],
        bff_blocks_used_before_after=[p1["eval"]["used_before"], p1["eval"]["used_after"]],
        bff_multi_match=p1["multi_match"],
        bff_other_multi_match_cr_kl=[p1["argmax"]["cr"], p1["argmax"]["kl"]],
        hack_decode_kl=p1["hack_alone"]["kl"],
        hack_decode_agreement=p1["hack_alone"]["agreement"],
        hack_bff_decode_kl=p1["hack"]["kl"],
        hack_physical_bytes_over_fp16=p1["hack_mem"]["physical_bytes_over_fp16"],
        hack_bytes_per_token=p1["hack_mem"]["bytes_per_token"],
        hack_decode_step_over_fp16=p1["hack_mem"]["decode_step_s"] / p1["hack_mem"]["fp16_decode_step_s"],
    )


if __name__ == "__main__":
    main()
