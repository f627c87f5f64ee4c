"""API benchmark: N concurrent clients against the ragkv HTTP service on loopback for a fixed time.

Starts ``python -m ragkv_server.server`` on a free loopback port (or uses ``--url``), ingests a slice of the
shared MuSiQue passages through ``POST /v1/documents``, then runs ``--runs`` timed phases of
``--duration`` seconds. Every client loops over the questions with streaming ``POST /v1/query``,
alternating ``blend`` and ``full`` so both modes see the same load side by side. Per mode it reports
the client-observed time to first token (request sent -> first token event; includes queueing) and
the server's own TTFT (after the queue), plus requests/s and errors (must be 0). Figures are
medians over the runs. Ends with one JSON line.

    python -m eval.bench_api                 # 8 clients, 3 x 15 s
    python -m eval.bench_api --quick         # 1 x 6 s, fewer documents

``--model`` is the server's ``RAGKV_MODEL`` (default the tiny stories260k, whose 512 positions make
the server cut chunks to ~62 tokens). On the real default model (``--model smollm2-135m-instruct``,
8192 positions) the server's automatic chunk size is 512 tokens, i.e. ~2K-token prompts of top 4
chunks: on a CPU, set ``--chunk-tokens`` (e.g. 128) and few clients:

    python -m eval.bench_api --model smollm2-135m-instruct --chunk-tokens 128 --clients 1 \
        --server-workers 1 --samples 3 --passages 3 --duration 60 --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from eval.harness import ForkedProcess, launch_server, stop_server
from eval.prompts import DATA_DIR, TINY_MODEL
from ragkv.metrics import percentile

MODES = ("blend", "full")


def start_server(
    args, data_dir: Path, env_extra: dict[str, str] | None = None, fork: bool = False
) -> tuple[subprocess.Popen | ForkedProcess, str, Path]:
    """``python -m ragkv_server.server`` on a free loopback port (``env_extra``: more ``RAGKV_*`` settings);
    returns (process, base URL, log path). ``fork``: forked from the harness's fork server (the tests)."""
    env = {
        "RAGKV_DATA_DIR": str(data_dir),
        "RAGKV_MODEL": args.model,
        "RAGKV_TOP_K": str(args.top_k),
        "RAGKV_MAX_NEW_TOKENS": str(args.max_tokens),
        "RAGKV_MAX_CONCURRENCY": str(args.server_workers),
        "RAGKV_MAX_QUEUE": str(max(64, 2 * args.clients)),
        "RAGKV_LOG_LEVEL": "warning",
        "RAGKV_GENERATION": args.generation,
    }
    if args.torch_threads:
        env["RAGKV_TORCH_THREADS"] = str(args.torch_threads)
    if args.chunk_tokens:
        env["RAGKV_CHUNK_TOKENS"] = str(args.chunk_tokens)
    env.update(env_extra or {})
    log_path = data_dir.parent / "server.log"
    proc, base = launch_server(env, log_path, fork=fork)
    return proc, base, log_path


def ingest(base: str, samples: list[dict], passages: int) -> dict:
    docs = [
        {"id": f"musique-{i}-{j}", "text": c["text"], "metadata": {"title": c.get("title", "")}}
        for i, s in enumerate(samples)
        for j, c in enumerate(s["ctxs"][:passages])
    ]
    t0 = time.perf_counter()
    out = {"documents": 0, "chunks": 0, "kv_computed": 0}
    with httpx.Client(base_url=base, timeout=600) as c:
        for i in range(0, len(docs), 4):
            r = c.post("/v1/documents", json={"documents": docs[i : i + 4]})
            r.raise_for_status()
            body = r.json()
            out["documents"] += len(body["documents"])
            out["chunks"] += sum(len(d["chunk_ids"]) for d in body["documents"])
            out["kv_computed"] += body["kv_computed"]
    out["seconds"] = time.perf_counter() - t0
    return out


async def one_request(c: httpx.AsyncClient, question: str, mode: str, max_tokens: int) -> dict:
    """One streaming query; client TTFT = request sent -> first token event."""
    t0 = time.perf_counter()
    ttft = None
    final = None
    async with c.stream(
        "POST",
        "/v1/query",
        json={"question": question, "mode": mode, "stream": True, "max_tokens": max_tokens},
    ) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "token" and ttft is None:
                    ttft = time.perf_counter() - t0
                elif event == "answer":
                    final = json.loads(line[6:])
                elif event == "error":
                    return {"ok": False, "error": line[6:200]}
    if final is None:
        return {"ok": False, "error": "stream ended without an answer"}
    total = time.perf_counter() - t0
    return {
        "ok": True,
        "mode": mode,
        "ttft_s": ttft if ttft is not None else total,
        "total_s": total,
        "server_ttft_s": final["timings"]["ttft_s"],
        "queue_s": final["timings"]["queue_s"],
        "tokens": final["usage"]["completion_tokens"],
        "reused": final["stats"].get("num_reused_rows", 0),
    }


async def phase(base: str, questions: list[str], clients: int, duration: float, max_tokens: int) -> dict:
    """``clients`` loops for ``duration`` seconds; requests started before the end are awaited and counted."""
    results: list[dict] = []
    stop_at = time.perf_counter() + duration

    async def client(k: int) -> None:
        i = k
        async with httpx.AsyncClient(base_url=base, timeout=300) as c:
            while time.perf_counter() < stop_at:
                mode = MODES[i % 2]
                try:
                    results.append(
                        await one_request(c, questions[(i // 2) % len(questions)], mode, max_tokens)
                    )
                except httpx.HTTPError as e:
                    results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
                i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out = {
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "error_samples": [r["error"] for r in results if not r["ok"]][:3],
    }
    for mode in MODES:
        rs = [r for r in ok if r["mode"] == mode]
        for key, name in (("ttft_s", "ttft"), ("server_ttft_s", "server_ttft"), ("queue_s", "queue")):
            xs = [r[key] for r in rs]
            out[f"{name}_p50_{mode}_s"] = percentile(xs, 50)
            out[f"{name}_p99_{mode}_s"] = percentile(xs, 99)
        out[f"requests_{mode}"] = len(rs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m eval.bench_api",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--url", help="benchmark a running server (documents already ingested) instead of starting one"
    )
    ap.add_argument(
        "--model",
        default=str(TINY_MODEL),
        help="the server's model (name, GGUF, folder; default: the tiny stories260k)",
    )
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="the server's chunk size (default: its own, top_k chunks fitting the context, <= 512)",
    )
    ap.add_argument("--data", default=str(DATA_DIR / "musique_s.json"))
    ap.add_argument("--samples", type=int, default=6, help="questions; their passages are ingested")
    ap.add_argument("--passages", type=int, default=4, help="passages ingested per question")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per timed run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-workers", type=int, default=2, help="the server's max_concurrency")
    ap.add_argument(
        "--generation",
        choices=["threads", "engine"],
        default="threads",
        help="the server's generation path: worker threads or ragkv.engine continuous batching",
    )
    ap.add_argument(
        "--torch-threads", type=int, default=1, help="the server's torch threads (0: torch default)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary data directory and server log")
    ap.add_argument("--quick", action="store_true", help="1 run of 6 s over 3 questions x 3 passages")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.duration, args.samples, args.passages = 1, 6.0, 3, 3
    samples = json.loads(Path(args.data).read_text())[: args.samples]
    questions = [s["question"] for s in samples]
    proc = None
    tmp = None
    try:
        if args.url:
            base, ing = args.url.rstrip("/"), None
        else:
            tmp = Path(tempfile.mkdtemp(prefix="ragkv-bench-api-"))
            t0 = time.perf_counter()
            proc, base, _ = start_server(args, tmp / "data")
            print(f"server up at {base} in {time.perf_counter() - t0:.1f} s")
            ing = ingest(base, samples, args.passages)
            print(
                f"ingested {ing['documents']} passages -> {ing['chunks']} chunks, {ing['kv_computed']} chunk KVs "
                f"computed in {ing['seconds']:.1f} s"
            )
        asyncio.run(
            phase(base, questions[:2], min(2, args.clients), 1.0, args.max_tokens)
        )  # warm-up, not counted
        runs = []
        for k in range(args.runs):
            r = asyncio.run(phase(base, questions, args.clients, args.duration, args.max_tokens))
            runs.append(r)
            print(
                f"run {k + 1}/{args.runs}: {r['requests']} requests in {r['wall_s']:.1f} s = "
                f"{r['requests_per_s']:.2f} req/s, errors {r['errors']} {r['error_samples'] or ''}"
            )
    finally:
        if proc is not None:
            stop_server(proc)
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(
        f"\n{args.clients} clients x {args.duration:.0f} s x {args.runs} runs, max_tokens {args.max_tokens}, "
        f"generation {args.generation}, server workers {args.server_workers} (medians over runs)"
    )
    print(f"{'':20s} {'blend':>10s} {'full':>10s} {'full/blend':>11s}")
    for name in ("ttft_p50", "ttft_p99", "server_ttft_p50", "server_ttft_p99", "queue_p50"):
        b, f = med(f"{name}_blend_s"), med(f"{name}_full_s")
        print(f"{name + ' ms':20s} {b * 1000:10.1f} {f * 1000:10.1f} {f / b if b else float('nan'):11.2f}")
    print(
        f"requests/s {med('requests_per_s'):.2f}, tokens/s {med('tokens_per_s'):.1f}, "
        f"errors {sum(r['errors'] for r in runs)}"
    )
    print(
        json.dumps(
            {
                "model": args.model,
                "chunk_tokens": args.chunk_tokens,
                "clients": args.clients,
                "duration_s": args.duration,
                "runs": args.runs,
                "max_tokens": args.max_tokens,
                "server_workers": args.server_workers,
                "generation": args.generation,
                "requests": sum(r["requests"] for r in runs),
                "requests_per_s": round(med("requests_per_s"), 3),
                "tokens_per_s": round(med("tokens_per_s"), 2),
                "ttft_p50_blend_s": round(med("ttft_p50_blend_s"), 5),
                "ttft_p50_full_s": round(med("ttft_p50_full_s"), 5),
                "ttft_p99_blend_s": round(med("ttft_p99_blend_s"), 5),
                "ttft_p99_full_s": round(med("ttft_p99_full_s"), 5),
                "server_ttft_p50_blend_s": round(med("server_ttft_p50_blend_s"), 5),
                "server_ttft_p50_full_s": round(med("server_ttft_p50_full_s"), 5),
                "errors": sum(r["errors"] for r in runs),
                "ingest": {k: round(v, 2) for k, v in ing.items()} if ing else None,
            }
        )
    )
    return 0 if all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
