"""Compact stored KV (issue 25): every stored-KV codec candidate side by side on the real model.

Per candidate, over ``--questions`` MuSiQue questions (3 passages of ``--chunk-tokens`` tokens each,
CacheBlend ``blend`` with the chat template, as ``eval.bench_codec`` builds them):

* bytes per token of the stored blob (headers, side info, digests included) and the ratio vs fp16;
* blend over the decoded KV vs blend over the exact KV: first-token KL (mean, max), first-token
  agreement, and identical greedy answers (``--new-tokens`` tokens);
* encode and restore throughput (MB of fp16 KV per second, one CPU thread), restore ms per chunk
  (store ``get``: read, verify, decode) vs recomputing the chunk's KV, and ingest time per chunk
  (compute KV + encode) relative to ``raw``.

``stepz`` profiles are calibrated here (demo corpus, disjoint from the MuSiQue evaluation questions)
with and without RoPE-aware key bits, and allocated at several KL budgets. int8/int4 "+zstd" are
the store's quant codecs with zstd (level 3) on each segment. The video codec is not re-run (encode
is ~1 s per chunk here); its figures are in docs/VIDEO_CODEC.md.

    python -m eval.bench_stored_kv [--questions 24] [--chunk-tokens 128] [--out runs/stored_kv.json]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from ragkv.blend import prefill
from ragkv.kv.chunk import ChunkKV
from ragkv.metrics import first_token_kl
from ragkv.store import MemoryStore
from ragkv.store import blob as blobfmt
from ragkv.store.codecs import get_codec
from ragkv.store.codecs.calibrate import calibrate
from ragkv.store.codecs.stepz import FALLBACK, StepProfile, StepZCodec
from ragkv.store.codecs.video.allocate import allocate_layer_steps


def layer_sensitivity(model, cases, chunks_per_case, codec: StepZCodec, probe: float) -> tuple[list, list]:
    """Blend first-token KL with only one (tensor, layer) quantized by ``codec`` (steps at ``probe``)."""
    refs = [
        prefill(model, pre, chunks, suf, mode="blend").logits
        for (pre, _, suf), chunks in zip(cases, chunks_per_case, strict=True)
    ]
    L = model.config.num_layers
    out: tuple[list, list] = ([], [])
    for is_k in (True, False):
        for layer in range(L):
            kls = []
            for (pre, _, suf), chunks, ref in zip(cases, chunks_per_case, refs, strict=True):
                alt = []
                for ch in chunks:
                    k, v = ch.k.clone(), ch.v.clone()
                    qk, qv = codec.reference(ch.k[layer : layer + 1], ch.v[layer : layer + 1], layer)
                    if is_k:
                        k[layer : layer + 1] = qk
                    else:
                        v[layer : layer + 1] = qv
                    alt.append(ChunkKV(ch.token_ids, k, v, ch.start_pos, ch.fingerprint, ch.convention))
                kls.append(first_token_kl(ref, prefill(model, pre, alt, suf, mode="blend").logits))
            out[0 if is_k else 1].append(float(np.mean(kls)))
    return out


def musique() -> list[dict]:
    from eval.prompts import DATA_DIR

    return json.loads((DATA_DIR / "musique_s.json").read_text())


def cases(model, n: int, chunk_tokens: int):
    from eval.bench_codec import prompt_parts
    from ragkv.model.forward import compute_chunk_kv

    data = musique()
    out = []
    for i in range(n):
        q = data[i % len(data)]
        ids = [model.encode(c["text"])[:chunk_tokens] for c in q["ctxs"][:3]]
        chunks = [compute_chunk_kv(model, x) for x in ids]
        prefix, suffix = prompt_parts(model, q["question"])
        out.append({"prefix": prefix, "suffix": suffix, "chunks": chunks, "ids": ids})
    return out


def answer(model, case, chunks, new_tokens: int):
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, generate

    res = prefill(model, case["prefix"], chunks, case["suffix"], mode="blend")
    gen = generate(model, res, SamplingParams(max_new_tokens=new_tokens))
    return res.logits, gen.token_ids


def fp16_bytes(chunk) -> int:
    return 2 * chunk.k.numel() * 2


def run_candidate(model, name, codec, cs, refs, new_tokens, zstd=False):
    from ragkv.kv.chunk import ChunkKV
    from ragkv.metrics import first_token_agreement, first_token_kl

    store = MemoryStore(codec=codec)
    fp = model.fingerprint
    enc_s, dec_s, nbytes, tokens, fp16 = 0.0, [], 0, 0, 0
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    kls, agree, same = [], [], []
    for case, (ref_logits, ref_ids) in zip(cs, refs, strict=True):
        decoded = []
        for ch in case["chunks"]:
            t0 = time.perf_counter()
            blob = blobfmt.encode_chunk(ch, codec)
            if zstd:
                hdr = blobfmt.parse_header(blob)
                segs = [
                    zc.compress(blob[hdr.data_start + s.offset : hdr.data_start + s.offset + s.length])
                    for s in hdr.segments
                ]
                size = hdr.data_start + sum(len(s) for s in segs)
            enc_s += time.perf_counter() - t0
            store.put_blob(ch.key, blob)
            t0 = time.perf_counter()
            if zstd:
                for s in segs:
                    zd.decompress(s)
            got = store.get(ch.key, fp)
            dec_s.append(time.perf_counter() - t0)
            nbytes += size if zstd else len(blob)
            tokens += ch.num_tokens
            fp16 += fp16_bytes(ch)
            decoded.append(ChunkKV(ch.token_ids, got.k, got.v, ch.start_pos, ch.fingerprint, ch.convention))
        logits, ids = answer(model, case, decoded, new_tokens)
        kls.append(first_token_kl(ref_logits, logits))
        agree.append(first_token_agreement(ref_logits, logits))
        same.append(ids == ref_ids)
    mb = fp16 / 1e6
    return {
        "name": name,
        "bytes_per_token": nbytes / tokens,
        "ratio_vs_fp16": fp16 / nbytes,
        "kl": float(np.mean(kls)),
        "kl_max": float(np.max(kls)),
        "agreement": float(np.mean(agree)),
        "same_answer": float(np.mean(same)),
        "encode_mb_s": mb / enc_s,
        "restore_mb_s": mb / sum(dec_s),
        "restore_ms": 1e3 * statistics.median(dec_s),
        "encode_ms": 1e3 * enc_s / len(dec_s),
        "n": len(kls),
    }


def with_steps(base: StepProfile, target_kl: float, rope: bool) -> StepProfile:
    m = base.meta
    k, v = allocate_layer_steps(m["k_kl"], m["v_kl"], m["probe"], target_kl, 0.05, 3.0)
    return StepProfile(
        k_steps=k,
        v_steps=v,
        k_bits=base.k_bits if rope else None,
        base_bits=base.base_bits,
        fingerprint=base.fingerprint,
        meta={"target_kl": target_kl},
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--calib-questions", type=int, default=2)
    ap.add_argument("--budgets", default="0.001,0.003,0.006")
    ap.add_argument(
        "--uniform",
        default="0.16/0.25",
        help="uniform K/V steps (x std) run with and without the calibrated RoPE key bits, comma-separated",
    )
    ap.add_argument("--out", default="runs/stored_kv.json")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ragkv.model import load_model
    from ragkv.model.forward import compute_chunk_kv

    model = load_model(args.model)
    out_path = Path(args.out)
    done = json.loads(out_path.read_text()) if out_path.exists() else {}
    same = {k: v for k, v in vars(args).items() if k not in ("uniform", "budgets", "out")}
    if {k: v for k, v in done.get("config", {}).items() if k in same} != same:
        done = {"rows": {}}
    done["config"] = vars(args)

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(done, indent=1))

    profiles = {}
    for rope in (True, False):
        key = f"profile_rope{int(rope)}"
        if key not in done:
            p = calibrate(
                model,
                n_questions=args.calib_questions,
                chunk_tokens=args.chunk_tokens,
                rope_bits=rope,
                sensitivity=layer_sensitivity,
            )
            done[key] = p.to_json()
            save()
        profiles[rope] = StepProfile.from_json(done[key])
    cs = cases(model, args.questions, args.chunk_tokens)
    refs = [answer(model, c, c["chunks"], args.new_tokens) for c in cs]
    # recompute time of one chunk (median), the denominator of restore vs recompute
    rec = []
    for c in cs[: min(6, len(cs))]:
        for ids in c["ids"][:1]:
            t0 = time.perf_counter()
            compute_chunk_kv(model, ids)
            rec.append(time.perf_counter() - t0)
    recompute_ms = 1e3 * statistics.median(rec)
    cands = [
        ("raw fp32 (old default)", get_codec("raw"), False),
        ("int8+zstd", get_codec("int8"), True),
        ("int4+zstd", get_codec("int4"), True),
        ("stepz uniform 0.35/0.5", StepZCodec(k_step=0.35, v_step=0.5), False),
        ("stepz fallback (uncalibrated)", StepZCodec(profile=FALLBACK), False),
    ]
    for b in [float(x) for x in args.budgets.split(",")]:
        cands.append(
            (f"stepz per-layer kl{b}", StepZCodec(profile=with_steps(profiles[False], b, False)), False)
        )
        cands.append(
            (f"stepz per-layer+rope kl{b}", StepZCodec(profile=with_steps(profiles[True], b, True)), False)
        )
    for spec in [x for x in args.uniform.split(",") if x]:
        spec, _, only = spec.partition(":")  # "K/V:r": only with the RoPE bits, ":u": only without
        ks, vs = (float(x) for x in spec.split("/"))
        L = model.config.num_layers
        for rope in {"r": (True,), "u": (False,)}.get(only, (False, True)):
            bits = profiles[True].k_bits if rope else None
            prof = StepProfile(
                k_steps=[ks] * L, v_steps=[vs] * L, k_bits=bits, base_bits=profiles[True].base_bits
            )
            cands.append((f"stepz uniform {spec}{' +rope' if rope else ''}", StepZCodec(profile=prof), False))
    for name, codec, z in cands:
        if name in done["rows"]:
            continue
        row = run_candidate(model, name, codec, cs, refs, args.new_tokens, zstd=z)
        row["recompute_ms"] = recompute_ms
        done["rows"][name] = row
        save()
        print(f"done {name}", flush=True)
    rows = list(done["rows"].values())
    raw_ingest = recompute_ms + done["rows"]["raw fp32 (old default)"]["encode_ms"]
    print(
        f"\n{'candidate':34} {'B/tok':>8} {'vs fp16':>7} {'KL mean':>8} {'KL max':>7} {'agree':>6} "
        f"{'same ans':>8} {'enc MB/s':>8} {'rst MB/s':>8} {'rst ms':>7} {'recomp ms':>9} {'ingest x raw':>12}"
    )
    for r in rows:
        r["ingest_speed_vs_raw"] = raw_ingest / (recompute_ms + r["encode_ms"])
        print(
            f"{r['name']:34} {r['bytes_per_token']:8.0f} {r['ratio_vs_fp16']:6.2f}x {r['kl']:8.4f} {r['kl_max']:7.4f} "
            f"{r['agreement']:6.0%} {r['same_answer']:8.0%} {r['encode_mb_s']:8.1f} {r['restore_mb_s']:8.1f} "
            f"{r['restore_ms']:7.1f} {recompute_ms:9.1f} {r['ingest_speed_vs_raw']:12.2f}"
        )
    save()
    summary = {
        "questions": args.questions,
        "chunk_tokens": args.chunk_tokens,
        "recompute_ms": recompute_ms,
        "rows": {
            r["name"]: {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
        },
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
