"""Loading benchmark: is stored-KV loading hidden behind selective recompute (CacheBlend §5)?

The bench_prefill model (random Llama, 32 layers, hidden 512, GQA), 6 x 512-token chunks whose KV
is stored in a real store (local directory; Redis with --redis-url or when redis-server is on PATH).
Per store and codec, medians of ``--runs``:

* sequential: load every layer of every chunk, then blend from memory;
* pipelined: blend while a background thread loads layer l+1 (``PipelinedSource``);
* load_only: the loads alone; compute_only: the blend alone with KV already in memory.

Goal: pipelined <= 1.15 * max(load_only, compute_only). The loading controller's ratio (profiled on
this machine) is reported with its reason. Ends with one JSON line.

    python -m eval.bench_loading [--layers 32 --runs 5 --codecs raw,int8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from eval.bench_prefill import bench_model
from eval.harness import free_port
from ragkv.blend import BlendSchedule, prefill
from ragkv.blend.controller import LoadingController
from ragkv.blend.pipeline import StoredChunk, pipelined_factory
from ragkv.kv import ChunkKV
from ragkv.model.forward import compute_chunk_kv
from ragkv.store import store_from_url


def _start_redis(tmp: Path) -> tuple[subprocess.Popen | None, str | None]:
    exe = shutil.which("redis-server")
    if not exe:
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def _load_to_memory(model, refs: list[StoredChunk], kvs) -> list[ChunkKV]:
    """Read every layer of every stored chunk once, into in-memory ChunkKVs."""
    out = []
    for r, kv in zip(refs, kvs, strict=True):
        layers = [r.layer_kv(i) for i in range(model.config.num_layers)]
        k = torch.stack([a for a, _ in layers])
        v = torch.stack([b for _, b in layers])
        out.append(ChunkKV(kv.token_ids, k, v, kv.start_pos, kv.fingerprint))
    return out


def _bench_store(model, store, kvs, chunks, prefix, question, ratio: float, runs: int) -> dict:
    """Median times of load-only, compute-only, sequential and pipelined blending for one store."""
    sched = BlendSchedule.single(ratio)

    def refs():
        return [StoredChunk(store, kv.key, c, model.fingerprint) for kv, c in zip(kvs, chunks, strict=True)]

    cases = {
        "load_only": lambda: _load_to_memory(model, refs(), kvs),
        "compute_only": lambda: prefill(model, prefix, kvs, question, "blend", schedule=sched),
        "sequential": lambda: prefill(
            model, prefix, _load_to_memory(model, refs(), kvs), question, "blend", schedule=sched
        ),
        "pipelined": lambda: prefill(
            model,
            prefix,
            refs(),
            question,
            "blend",
            schedule=sched,
            source_factory=pipelined_factory(model, depth=2),
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm-up (page cache, allocator)
    for _ in range(runs):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = max(med["load_only"], med["compute_only"])
    return {
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "ratio": ratio,
        "pipelined_over_max": round(med["pipelined"] / bound, 3),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument(
        "--ratio", type=float, default=None, help="fixed ratio (default: the controller's choice)"
    )
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--codecs", default="raw,int8")
    ap.add_argument("--redis-url", default=None, help="use this Redis (default: start redis-server if found)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for compute (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, _ = bench_model(args.layers, args.hidden, 8, 2, 1536, 32000)
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(3, 32000, (args.chunk_tokens,), generator=g).tolist() for _ in range(args.chunks)]
    question = torch.randint(3, 32000, (args.question_tokens,), generator=g).tolist()
    prefix = [1]
    kvs = [compute_chunk_kv(model, c) for c in chunks]
    tmp = Path(tempfile.mkdtemp(prefix="ragkv-bench-loading-"))
    proc = None
    stores: dict[str, object] = {}
    for codec in args.codecs.split(","):
        stores[f"localdir-{codec}"] = store_from_url(f"file://{tmp}/kv-{codec}?codec={codec}")
    if not args.no_redis:
        url = args.redis_url
        if url is None:
            proc, url = _start_redis(tmp)
        if url:
            stores["redis-raw"] = store_from_url(url + "?prefix=ragkv:bench:")
    n_tokens = 1 + sum(map(len, chunks)) + len(question)
    n_cached = sum(map(len, chunks))
    try:
        ctrl = LoadingController.profile(model, stores, lengths=(512, 1024, 2048), runs=1)
        rows, result = [], {}
        for name, store in stores.items():
            for kv in kvs:
                assert store.put(kv), f"{name}: put failed"
            decision = ctrl.choose_ratio(n_tokens, n_cached, name)
            ratio = args.ratio if args.ratio is not None else decision.ratio
            row = _bench_store(model, store, kvs, chunks, prefix, question, ratio, args.runs)
            row.update(store=name, reason=decision.reason, stored_MB=round(store.nbytes() / 1e6, 1))
            rows.append(row)
            if not result:
                result = row
        print(f"model {args.layers} layers hidden {args.hidden}; prompt {n_tokens} tokens; runs {args.runs}")
        print(
            f"{'store':16s} {'load_only':>10s} {'compute':>10s} {'sequential':>11s} {'pipelined':>10s} "
            f"{'pip/max':>8s} {'ratio':>6s}"
        )
        for r in rows:
            print(
                f"{r['store']:16s} {r['load_only_s']:10.3f} {r['compute_only_s']:10.3f} {r['sequential_s']:11.3f} "
                f"{r['pipelined_s']:10.3f} {r['pipelined_over_max']:8.3f} {r['ratio']:6.3f}"
            )
        print("controller:", rows[0]["reason"])
        out = {
            "pipelined_s": result["pipelined_s"],
            "sequential_s": result["sequential_s"],
            "load_only_s": result["load_only_s"],
            "compute_only_s": result["compute_only_s"],
            "ratio": result["ratio"],
            "pipelined_over_max": result["pipelined_over_max"],
            "store": result["store"],
            "reason": result["reason"],
            "all": rows,
        }
        print(json.dumps(out))
        return out
    finally:
        for s in stores.values():
            s.close()
        if proc is not None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
