"""Chunk KV written or read differently, side by side on the one blend loop (issue 38's go/no-go and candidates).

    python -m eval.bench_adapter [--limit 24] [--ratios 0,0.12,0.5] [--adapters const=PATH,wkv16=PATH]
        [--conditions iso,other,mean2,fixed] [--records runs/adapter/dev.records.jsonl] [--set dev|calibration]
    python -m eval.bench_adapter --ingest-cost --threads 1   # what writing check (c)'s KV costs at ingest

Per question of the dev split (invented facts, ``ragkv.adapter.data.dev_set``; never the gate's set
unless ``--set calibration``), on the prompt users send, with float32 full prefill as the reference:

* ``iso``: today's chunk convention (each passage after BOS alone);
* ``other``: each passage's KV written after the 3 first passages of *another* question's prompt (a
  real prompt's context that is not this one's: the digest's check (a));
* ``mean2``: K/V averaged over two such draws (check (b));
* ``fixed``: written after one fixed generic context (3 training passages; check (c));
* each ``--adapters`` entry: iso KV read through that adapter file (check (d) is the rank-0 one);
  ``name=PATH@fixed``: ``fixed`` KV read through it (an adapter trained on context-primed KV). A
  writer file (W-full, ``ragkv adapter train --kind writer``) writes the chunk KV instead: after BOS,
  or after check (c)'s context with ``@fixed``. A link-rows file (L, ``--kind link``) puts its rows
  after each chunk of the prompt (computed, charged).

Each condition runs at every ``--ratios`` point (0 = reuse; else the default blend schedule at that
ratio). Reported: same greedy answer as full, output F1 vs full, first-token KL, gold recall,
charged compute, each with a bootstrap interval and the paired difference against ``iso``. Ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

from ragkv.adapter.data import Item, dev_set, training_set
from ragkv.adapter.kv_adapter import KVAdapter, adapter_format
from ragkv.adapter.links import FORMAT as LINK_FORMAT
from ragkv.adapter.links import LinkedModel, LinkRows
from ragkv.adapter.train import item_ids
from ragkv.adapter.writer import FORMAT as WRITER_FORMAT
from ragkv.adapter.writer import WriterLoRA
from ragkv.blend.core import BlendSchedule
from ragkv.blend.kvtree import PrefixCache
from ragkv.blend.prefill import prefill
from ragkv.fidelity.measure import bootstrap_ci, load_calibration_set
from ragkv.generate import SamplingParams, generate
from ragkv.kv.chunk import ChunkKV
from ragkv.metrics import first_token_kl, normalize_answer, token_f1
from ragkv.metrics.text import answer_recall, max_over_golds
from ragkv.model import DEFAULT_MODEL, load_model
from ragkv.model.forward import compute_chunk_kv

MAX_NEW = 16


def primed_kv(model, ids: list[int], contexts: list[list[int]]) -> ChunkKV:
    """A chunk's KV written after each of ``contexts`` (averaged when several; a context is cut from the
    front to fit the model's context)."""
    kvs = [compute_chunk_kv(model, ids, context=ctx) for ctx in contexts]
    if len(kvs) == 1:
        return kvs[0]
    k = torch.stack([c.k for c in kvs]).mean(0)
    v = torch.stack([c.v for c in kvs]).mean(0)
    return ChunkKV(
        token_ids=kvs[0].token_ids, k=k, v=v, start_pos=kvs[0].start_pos, fingerprint=model.fingerprint
    )


def passage_pool(model) -> list[str]:
    """Training passages (never the dev or calibration sets'): check (b)'s draws, check (c)'s context."""
    return [p for it in training_set(model, 40, 0, 0) for p in it.passages]


def fixed_context_ids(model, pool: list[str] | None = None) -> list[int]:
    """Check (c)'s one fixed generic context: the first 3 training passages, tokenized."""
    pool = passage_pool(model) if pool is None else pool
    return [t for p in pool[:3] for t in model.encode(p)]


def ingest_cost(model, items: list[Item], context: list[int], runs: int = 3) -> dict:
    """Ingest compute of context-primed chunk KV with the context's KV cached (each chunk's rows
    attending to it) against today's convention (each chunk after BOS alone), both through the same
    cached-prefix path, interleaved: per distinct chunk the ratio of median times, then the median."""
    import time

    bos = [model.config.bos_token_id] if model.config.bos_token_id is not None else []
    heads = {"iso": bos, "fixed": bos + context}
    pc = PrefixCache(max_bytes=1 << 28)
    for head in heads.values():
        prefill(model, head, [], [], "prefix", prefix_cache=pc)
    chunks = list(dict.fromkeys(tuple(c) for it in items for c in item_ids(model, it)[1]))
    ratios, ms = [], {"iso": [], "fixed": []}
    for ids in chunks:
        times: dict[str, list[float]] = {"iso": [], "fixed": []}
        for _ in range(runs):
            for name, head in heads.items():
                t0 = time.perf_counter()
                prefill(model, head, [], list(ids), "prefix", prefix_cache=pc, prefix_cache_insert=False)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios.append(med["fixed"] / med["iso"])
        for k in ms:
            ms[k].append(1000 * med[k])
    return {
        "chunks": len(chunks),
        "chunk_tokens_median": statistics.median(len(c) for c in chunks),
        "context_tokens": len(context),
        "iso_ms_median": round(statistics.median(ms["iso"]), 1),
        "fixed_ms_median": round(statistics.median(ms["fixed"]), 1),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_ci": bootstrap_ci(ratios),
    }


def calibration_items() -> list[Item]:
    passages, qs = load_calibration_set()
    return [
        Item("facts", [passages[p] for p in q["passages"]], q["question"], q["answers"], id=q["id"])
        for q in qs
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--ratios", default="0,0.12,0.5")
    ap.add_argument("--conditions", default="iso,other,mean2,fixed")
    ap.add_argument(
        "--adapters", default="", help="name=path[@fixed],... (KV adapters read, writers write, the chunk KV)"
    )
    ap.add_argument("--set", default="dev", choices=("dev", "calibration"))
    ap.add_argument("--records", default="runs/adapter/dev.records.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--ingest-cost",
        action="store_true",
        help="instead: time writing check (c)'s primed chunk KV (context KV cached) against today's",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="float32")
    items = dev_set(args.limit) if args.set == "dev" else calibration_items()[: args.limit]
    if args.ingest_cost:
        res = ingest_cost(model, items, fixed_context_ids(model))
        print(
            f"{res['chunks']} chunks (median {res['chunk_tokens_median']} tokens) after a cached "
            f"{res['context_tokens']}-token context: {res['ratio_median']}x today's ingest time "
            f"{res['ratio_ci']} ({res['fixed_ms_median']} vs {res['iso_ms_median']} ms per chunk)"
        )
        print(json.dumps({"bench": "adapter_ingest_cost", **res}))
        return 0
    ratios = [float(r) for r in args.ratios.split(",")]
    conds = [c for c in args.conditions.split(",") if c]
    adapters, writers, links, adapter_base = {}, {}, {}, {}
    for spec in filter(None, args.adapters.split(",")):
        name, path = spec.split("=", 1)
        path, _, base = path.partition("@")  # PATH@fixed: trained on check (c)'s KV, not iso
        adapter_base[name] = base or "iso"
        fmt = adapter_format(path)
        if fmt == WRITER_FORMAT:  # a chunk-KV writer: the KV is written through it
            writers[name] = WriterLoRA.load(path, model)
        elif fmt == LINK_FORMAT:  # link rows: its base's KV, the rows after each chunk
            links[name] = LinkRows.load(path, model)
        else:  # a KV adapter: its base's KV, read through it
            adapters[name] = KVAdapter.load(path, model)
    conds += list(adapter_base)
    rng = random.Random(0)
    pool = passage_pool(model)
    fixed_ctx = fixed_context_ids(model, pool)
    rec_path = Path(args.records)
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if rec_path.is_file():
        for line in rec_path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            done[(r["id"], r["cond"], r["ratio"])] = r
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    pc = PrefixCache(max_bytes=1 << 28)
    from tqdm.auto import tqdm

    with rec_path.open("a") as f:
        for qi, it in enumerate(tqdm(items, desc="questions")):
            todo = [(c, r) for c in conds for r in ratios if (it.id, c, r) not in done]
            if not todo:
                continue
            prefix, chunks, suffix = item_ids(model, it)
            if len(prefix) + sum(map(len, chunks)) + len(suffix) + MAX_NEW > model.config.max_position:
                continue  # the prompt does not fit the model's context: left out, as the gate's set does
            full = prefill(model, prefix, chunks, suffix, "full")
            full_text = generate(model, full, params).text
            if not pc.lookup(model.fingerprint, [prefix]):
                prefill(model, prefix, [], [], "prefix", prefix_cache=pc)
            other = items[(qi + 1) % len(items)]
            other_ctx = [t for p in other.passages[:3] for t in model.encode(p)]
            kvs: dict[str, list] = {}
            iso = [compute_chunk_kv(model, c) for c in chunks]
            needed = {c for c, _ in todo}
            needed |= {adapter_base[c] for c in needed if c in adapters or c in links}
            for c in sorted(needed, key=lambda c: c in adapters or c in links):  # their bases first
                if c == "iso":
                    kvs[c] = iso
                elif c == "other":
                    kvs[c] = [primed_kv(model, ids, [other_ctx]) for ids in chunks]
                elif c == "mean2":
                    draws = [[t for p in rng.sample(pool, 3) for t in model.encode(p)] for _ in range(2)]
                    kvs[c] = [primed_kv(model, ids, draws) for ids in chunks]
                elif c == "fixed":
                    kvs[c] = [primed_kv(model, ids, [fixed_ctx]) for ids in chunks]
                elif c in writers:  # written by the writer (after BOS, or after check (c)'s context)
                    ctx = fixed_ctx if adapter_base[c] == "fixed" else ()
                    wm = writers[c].model(model)
                    kvs[c] = [compute_chunk_kv(wm, ids, model.fingerprint, context=ctx) for ids in chunks]
                else:  # its base's KV, read through the adapter by prefill itself
                    kvs[c] = kvs[adapter_base[c]]
            for c, r in todo:
                kw = dict(prefix_cache=pc, prefix_cache_insert=False, adapter=adapters.get(c))
                lm, ckv = model, kvs[c]
                if c in links:  # the prompt with the link rows after each chunk, on the same model
                    lm, ckv = LinkedModel(model, links[c]), links[c].interleave(kvs[c])
                if r == 0:
                    res = prefill(lm, prefix, ckv, suffix, "reuse", **kw)
                else:
                    res = prefill(lm, prefix, ckv, suffix, "blend", schedule=BlendSchedule(ratios=(r,)), **kw)
                text = generate(lm, res, params).text
                rec = {
                    "id": it.id,
                    "cond": c,
                    "ratio": r,
                    "output": text,
                    "full_output": full_text,
                    "same": float(normalize_answer(text) == normalize_answer(full_text)),
                    "f1_vs_full": token_f1(text, full_text),
                    "kl": float(first_token_kl(full.logits, res.logits)),
                    "recall": max_over_golds(answer_recall, text, it.answers),
                    "full_recall": max_over_golds(answer_recall, full_text, it.answers),
                    "charged": float(res.stats.get("recompute_fraction", 0.0)),
                }
                done[(it.id, c, r)] = rec
                f.write(json.dumps(rec) + "\n")
            f.flush()
    ids = [it.id for it in items]
    rows = []
    print(
        f"{'condition':>10} {'ratio':>5} {'same':>18} {'d_same vs iso':>20} {'F1 vs full':>6} {'KL':>6} {'recall':>6} {'charged':>7}"
    )
    for c in conds:
        for r in ratios:
            recs = [done[(i, c, r)] for i in ids if (i, c, r) in done]
            base = [done[(i, "iso", r)] for i in ids if (i, c, r) in done and (i, "iso", r) in done]
            if not recs:
                continue
            same = [x["same"] for x in recs]
            diff = (
                [a["same"] - b["same"] for a, b in zip(recs, base, strict=False)]
                if len(base) == len(recs)
                else []
            )
            row = {
                "cond": c,
                "ratio": r,
                "n": len(recs),
                "same": round(statistics.fmean(same), 3),
                "same_ci": bootstrap_ci(same),
                "d_same_vs_iso": round(statistics.fmean(diff), 3) if diff else None,
                "d_same_ci": bootstrap_ci(diff) if diff else None,
                "f1_vs_full": round(statistics.fmean(x["f1_vs_full"] for x in recs), 3),
                "kl": round(statistics.fmean(x["kl"] for x in recs), 4),
                "recall": round(statistics.fmean(x["recall"] for x in recs), 3),
                "full_recall": round(statistics.fmean(x["full_recall"] for x in recs), 3),
                "charged": round(statistics.fmean(x["charged"] for x in recs), 3),
            }
            rows.append(row)
            print(
                f"{c:>10} {r:>5} {row['same']:>6} {str(row['same_ci']):>11} {row['d_same_vs_iso'] if diff else '':>7} "
                f"{str(row['d_same_ci'] or ''):>12} {row['f1_vs_full']:>6} {row['kl']:>6} {row['recall']:>6} {row['charged']:>7}"
            )
    print(json.dumps({"bench": "adapter", "set": args.set, "questions": len(ids), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
