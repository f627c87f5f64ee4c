"""Query latency during a large ingest: idle vs while a ``--mb`` MB upload is being ingested.

Starts ``python -m ragkv_server.server`` on a free loopback port (the tiny stories260k model, so a query's
generation is cheap; 64-token chunks; torch threads 1), ingests a small base corpus, then does
``--runs`` rounds of two phases side by side:

* idle: ``--queries`` sequential ``POST /v1/query`` requests (the whole query path: question
  embedding, FAISS retrieval, chunk-KV fetch, blend prefill, ``--max-tokens`` new tokens);
* load: the same queries while one NDJSON upload of ``--mb`` MB (documents of ``--doc-chars``
  characters) is sent to ``POST /v1/documents`` and ingested (the service ingests it in bounded
  steps of ``ingest_batch_chunks`` chunks: KV, embedding, cancellation check).

``/healthz`` is polled every ``--health-interval`` seconds throughout, on its own connection. When
the load phase's queries are done the upload's connection is closed: the server cancels the ingest
at its next step and commits nothing (checked: the document count is unchanged), then the next
round starts once the server is idle again. ``--complete`` waits for the ingest to finish instead
(and commits it). Prints p50/p99 per phase and run, the ratio load/idle p99 of each run, their
medians over runs and the slowest ``/healthz``; ends with one JSON line.

    python -m eval.bench_ingest_load                    # 50 MB, 3 rounds of 200 queries per phase
    python -m eval.bench_ingest_load --mb 0.2 --runs 1 --queries 10   # a smoke run

Goal (issue 16): load p99 within 2x of the idle p99; ``/healthz`` under 100 ms throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from eval.bench_api import start_server
from eval.faults import WORDS, make_docs
from eval.harness import stop_server
from eval.prompts import TINY_MODEL
from ragkv.metrics import percentile

MB = 1_000_000


# ---- the load: one large NDJSON upload on a raw connection (so it can be cut at any moment) ---------
def upload_body(mb: float, doc_chars: int, seed: int) -> tuple[bytes, int]:
    """NDJSON of synthetic documents adding up to ``mb`` MB; returns (body, number of documents)."""
    rng = random.Random(seed)
    total = int(mb * MB)
    lines, size, i = [], 0, 0
    while size < total:
        n = min(doc_chars, total - size)
        words, length = [], 0
        while length < n:
            sentence = " ".join(rng.choices(WORDS, k=rng.randint(6, 14))).capitalize() + "."
            words.append(sentence)
            length += len(sentence) + 1
        text = " ".join(words)[:n].rstrip() or "x"
        line = json.dumps({"id": f"big-{seed}-{i:03d}", "text": text}) + "\n"
        lines.append(line)
        size += len(line)
        i += 1
    return "".join(lines).encode(), len(lines)


class Upload(threading.Thread):
    """Sends ``body`` as one ``POST /v1/documents`` (NDJSON) and waits for the answer; :meth:`cut`
    closes the connection (the server then cancels the ingest)."""

    def __init__(self, base: str, body: bytes):
        super().__init__(daemon=True)
        host, port = base.removeprefix("http://").split(":")
        self.addr, self.body = (host, int(port)), body
        self.sock: socket.socket | None = None
        self.status: int | None = None
        self.sent_s: float | None = None
        self.done_s: float | None = None
        self.error: str | None = None
        self._cut = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        try:
            self.sock = socket.create_connection(self.addr, timeout=3600)
            head = (
                f"POST /v1/documents HTTP/1.1\r\nHost: {self.addr[0]}:{self.addr[1]}\r\n"
                f"Content-Type: application/x-ndjson\r\nContent-Length: {len(self.body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            self.sock.sendall(head.encode())
            view = memoryview(self.body)
            for lo in range(0, len(view), 1 << 20):
                if self._cut.is_set():
                    return
                self.sock.sendall(view[lo : lo + (1 << 20)])
            self.sent_s = time.perf_counter() - self.t0
            reply = b""
            while b"\r\n" not in reply:
                piece = self.sock.recv(65536)
                if not piece:
                    break
                reply += piece
            if reply.startswith(b"HTTP/1.1 "):
                self.status = int(reply.split(b" ")[1])
                self.done_s = time.perf_counter() - self.t0
        except OSError as e:
            if not self._cut.is_set():
                self.error = f"{type(e).__name__}: {e}"
        finally:
            if self.sock is not None:
                self.sock.close()

    def cut(self) -> None:
        """Close the connection now (the client goes away)."""
        self._cut.set()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---- measurements ----------------------------------------------------------------------------------
class HealthPoller(threading.Thread):
    """GET /healthz every ``interval`` seconds on one keep-alive connection; latencies per phase."""

    def __init__(self, base: str, interval: float):
        super().__init__(daemon=True)
        self.base, self.interval = base, interval
        self.phase = "idle"
        self.samples: dict[str, list[float]] = {}
        self.errors = 0
        self.stop = threading.Event()
        self.slow: dict[str, list[tuple[float, float]]] = {}  # (seconds into the phase, ms) over 50 ms
        self.t_phase = time.perf_counter()

    def begin(self, phase: str) -> None:
        """Samples from now on belong to ``phase``."""
        self.t_phase = time.perf_counter()
        self.phase = phase

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self.stop.is_set():
                phase = self.phase
                t0 = time.perf_counter()
                try:
                    ok = c.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                dt = time.perf_counter() - t0
                if ok:
                    self.samples.setdefault(phase, []).append(dt)
                    if dt > 0.05:
                        self.slow.setdefault(phase, []).append(
                            (round(t0 - self.t_phase, 2), round(dt * 1000, 1))
                        )
                else:
                    self.errors += 1
                self.stop.wait(max(0.0, self.interval - dt))

    def take(self, phase: str) -> tuple[list[float], list[tuple[float, float]]]:
        """The latencies of ``phase`` and its slow polls (seconds into the phase, ms), cleared."""
        return self.samples.pop(phase, []), self.slow.pop(phase, [])


def run_queries(
    c: httpx.Client,
    questions: list[str],
    n: int,
    max_tokens: int,
    server: dict | None = None,
    min_s: float = 0.0,
) -> tuple[list[float], int]:
    """``n`` sequential queries, more until ``min_s`` seconds have passed; (latencies of the answered
    ones, errors). ``server`` collects the server's own timings (``retrieval_s``, ``total_s`` ...)."""
    lat, errors = [], 0
    t_end = time.perf_counter() + min_s
    i = 0
    while i < n or time.perf_counter() < t_end:
        i += 1
        t0 = time.perf_counter()
        try:
            r = c.post(
                "/v1/query", json={"question": questions[i % len(questions)], "max_tokens": max_tokens}
            )
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            lat.append(time.perf_counter() - t0)
            if server is not None:
                for key, v in r.json()["timings"].items():
                    server.setdefault(key, []).append(v)
        else:
            errors += 1
    return lat, errors


_METRIC = re.compile(r"^(\w+)(\{[^}]*\})? (\S+)$")


def metrics(c: httpx.Client) -> dict[str, float]:
    """The server's Prometheus samples, ``name{labels}`` -> value."""
    out = {}
    for line in c.get("/metrics").text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def ingest_busy(c: httpx.Client) -> bool:
    m = metrics(c)
    return (
        m.get('ragkv_requests_running{pool="ingest"}', 0) > 0
        or m.get('ragkv_requests_queued{pool="ingest"}', 0) > 0
    )


def kv_puts(c: httpx.Client) -> int:
    return int(metrics(c).get('ragkv_store_ops{op="puts"}', 0))


def stats(xs: list[float]) -> dict:
    return {
        "n": len(xs),
        "p50_ms": round(percentile(xs, 50) * 1000, 2),
        "p99_ms": round(percentile(xs, 99) * 1000, 2),
        "max_ms": round(max(xs) * 1000, 2) if xs else float("nan"),
    }


# ---- one round -----------------------------------------------------------------------------------
def one_round(k: int, base: str, c: httpx.Client, health: HealthPoller, questions, args) -> dict:
    """Idle queries, then the same queries during the upload's ingest; the ingest is then cut
    (or, with ``--complete``, awaited)."""
    health.take("idle")
    health.begin("idle")
    s_idle: dict[str, list[float]] = {}
    idle, idle_err = run_queries(c, questions, args.queries, args.max_tokens, s_idle)
    health.begin("between")
    h_idle, _ = health.take("idle")
    docs_before = c.get("/healthz").json()["documents"]
    body, n_docs = upload_body(args.mb, args.doc_chars, seed=100 + k)
    puts0 = kv_puts(c)
    up = Upload(base, body)
    health.take("load")
    health.begin("load")
    up.start()
    t0 = time.perf_counter()
    s_load: dict[str, list[float]] = {}
    load, load_err = run_queries(c, questions, args.queries, args.max_tokens, s_load, args.load_s)
    load_s = time.perf_counter() - t0
    running_at_end = up.status is None
    health.begin("between")
    h_load, h_slow = health.take("load")
    puts1 = kv_puts(c)
    alone = None
    if up.status is None and args.alone_s > 0:  # the ingest's own pace, no queries
        time.sleep(args.alone_s)
        alone = (kv_puts(c) - puts1) / args.alone_s if up.status is None else None
    if args.complete:
        up.join()
    else:
        up.cut()
        up.join(60)
    deadline = time.monotonic() + 600
    while ingest_busy(c) and time.monotonic() < deadline:  # the next idle phase must be idle
        time.sleep(0.2)
    docs_after = c.get("/healthz").json()["documents"]
    return {
        "idle": stats(idle),
        "load": stats(load),
        "p99_ratio": round(percentile(load, 99) / percentile(idle, 99), 3),
        "server_p99_ms": {
            phase: {k: round(percentile(v, 99) * 1000, 1) for k, v in t.items()}
            for phase, t in (("idle", s_idle), ("load", s_load))
        },
        "healthz_idle": stats(h_idle),
        "healthz_load": stats(h_load),
        "healthz_slow_load": h_slow[:20],
        "errors": idle_err + load_err,
        "load_s": round(load_s, 1),
        "upload_bytes": len(body),
        "upload_documents": n_docs,
        "upload_sent_s": None if up.sent_s is None else round(up.sent_s, 2),
        "ingest_running_at_end": running_at_end,
        "kv_chunks_during_load": puts1 - puts0,
        "ingest_chunks_per_s_during_load": round((puts1 - puts0) / load_s, 1),
        "ingest_chunks_per_s_alone": None if alone is None else round(alone, 1),
        "upload_status": up.status,
        "upload_error": up.error,
        "documents_before": docs_before,
        "documents_after": docs_after,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m eval.bench_ingest_load",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--mb", type=float, default=50.0, help="upload size in MB (10^6 bytes)")
    ap.add_argument("--doc-chars", type=int, default=2_000_000, help="characters per uploaded document")
    ap.add_argument("--queries", type=int, default=200, help="queries per phase (at least)")
    ap.add_argument(
        "--load-s",
        type=float,
        default=60.0,
        help="the load phase goes on with queries for at least this long",
    )
    ap.add_argument("--runs", type=int, default=3, help="rounds of idle + load")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--base-docs", type=int, default=40, help="documents ingested before the rounds")
    ap.add_argument("--health-interval", type=float, default=0.05)
    ap.add_argument(
        "--alone-s",
        type=float,
        default=5.0,
        help="after the load queries: seconds of the ingest alone (its pace)",
    )
    ap.add_argument("--ingest-batch", type=int, default=32, help="the server's ingest_batch_chunks")
    ap.add_argument("--server-workers", type=int, default=2, help="the server's max_concurrency")
    ap.add_argument("--complete", action="store_true", help="let each upload's ingest finish (commits it)")
    ap.add_argument("--model", default=str(TINY_MODEL))
    ap.add_argument("--keep", action="store_true", help="keep the data directory and server log")
    ap.add_argument(
        "--fork-server",
        action="store_true",
        help="fork the server from the harness's fork server (imports done once: the tests) instead of a fresh interpreter",
    )
    args = ap.parse_args(argv)
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="ragkv-bench-ingest-load-"))
    server_args = SimpleNamespace(
        model=args.model,
        top_k=3,
        max_tokens=args.max_tokens,
        server_workers=args.server_workers,
        clients=1,
        generation="threads",
        torch_threads=1,
        chunk_tokens=64,
    )
    extra = {
        "RAGKV_MAX_UPLOAD_BYTES": str(max(256 << 20, int(args.mb * MB * 1.1))),
        "RAGKV_MAX_DOCUMENT_CHARS": str(max(2_000_000, args.doc_chars)),
        "RAGKV_MAX_DOCUMENT_TOKENS": "none",  # 2M-character documents: over the default token quota
        "RAGKV_INGEST_BATCH_CHUNKS": str(args.ingest_batch),
    }
    proc = None
    rounds = []
    try:
        proc, base, log_path = start_server(server_args, tmp / "data", extra, fork=args.fork_server)
        with httpx.Client(base_url=base, timeout=600) as c:
            base_docs = make_docs(args.base_docs, seed=5)
            for i in range(0, len(base_docs), 10):
                c.post("/v1/documents", json={"documents": base_docs[i : i + 10]}).raise_for_status()
            questions = [d["text"].split(". ")[1] + "?" for d in base_docs]
            run_queries(c, questions, 10, args.max_tokens)  # warm-up, not counted
            health = HealthPoller(base, args.health_interval)
            health.start()
            try:
                for k in range(args.runs):
                    r = one_round(k, base, c, health, questions, args)
                    rounds.append(r)
                    print(
                        f"run {k + 1}/{args.runs}: query p50/p99 idle {r['idle']['p50_ms']:.1f}/{r['idle']['p99_ms']:.1f} ms, "
                        f"during ingest {r['load']['p50_ms']:.1f}/{r['load']['p99_ms']:.1f} ms "
                        f"(p99 x{r['p99_ratio']:.2f}); /healthz max idle {r['healthz_idle']['max_ms']:.1f} ms, "
                        f"during ingest {r['healthz_load']['max_ms']:.1f} ms ({r['healthz_load']['n']} polls); "
                        f"{r['kv_chunks_during_load']} chunks ingested in {r['load_s']} s "
                        f"(alone: {r['ingest_chunks_per_s_alone']}/s), still running at the end: "
                        f"{r['ingest_running_at_end']}; errors {r['errors']}\n  server p99 ms {r['server_p99_ms']}"
                        f"\n  /healthz over 50 ms during ingest (s into it, ms): {r['healthz_slow_load']}; "
                        f"upload sent after {r['upload_sent_s']} s",
                        flush=True,
                    )
            finally:
                health.stop.set()
                health.join()
    finally:
        if proc is not None:
            stop_server(proc)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    load_end = os.getloadavg()

    def med(f) -> float:
        return round(statistics.median(f(r) for r in rounds), 2)

    res = {
        "query_path": "POST /v1/query (retrieval + blend prefill + max_tokens new tokens, stories260k)",
        "mb": args.mb,
        "upload_bytes": rounds[0]["upload_bytes"],
        "upload_documents": rounds[0]["upload_documents"],
        "runs": args.runs,
        "queries_per_phase": args.queries,
        "max_tokens": args.max_tokens,
        "idle_p50_ms": med(lambda r: r["idle"]["p50_ms"]),
        "idle_p99_ms": med(lambda r: r["idle"]["p99_ms"]),
        "load_p50_ms": med(lambda r: r["load"]["p50_ms"]),
        "load_p99_ms": med(lambda r: r["load"]["p99_ms"]),
        "p99_ratio": med(lambda r: r["p99_ratio"]),
        "p99_ratio_max": max(r["p99_ratio"] for r in rounds),
        "healthz_max_ms": max(r["healthz_load"]["max_ms"] for r in rounds),
        "healthz_p99_ms": med(lambda r: r["healthz_load"]["p99_ms"]),
        "healthz_idle_max_ms": max(r["healthz_idle"]["max_ms"] for r in rounds),
        "healthz_polls_during_load": sum(r["healthz_load"]["n"] for r in rounds),
        "healthz_errors": health.errors,
        "errors": sum(r["errors"] for r in rounds),
        "kv_chunks_during_load": [r["kv_chunks_during_load"] for r in rounds],
        "load_s": [r["load_s"] for r in rounds],
        "ingest_chunks_per_s_during_load": [r["ingest_chunks_per_s_during_load"] for r in rounds],
        "ingest_chunks_per_s_alone": [r["ingest_chunks_per_s_alone"] for r in rounds],
        "ingest_running_at_end": all(r["ingest_running_at_end"] for r in rounds),
        "documents_unchanged_after_cut": None
        if args.complete
        else all(r["documents_after"] == r["documents_before"] for r in rounds),
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in load_end],
    }
    res["goal_p99_within_2x"] = res["p99_ratio"] <= 2.0
    res["goal_healthz_under_100ms"] = res["healthz_max_ms"] < 100.0
    print(
        f"\nmedians over {args.runs} runs: query p99 idle {res['idle_p99_ms']} ms, during a {args.mb:g} MB ingest "
        f"{res['load_p99_ms']} ms (x{res['p99_ratio']}); /healthz max {res['healthz_max_ms']} ms; "
        f"load average {res['load_avg_start']} -> {res['load_avg_end']}"
    )
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
