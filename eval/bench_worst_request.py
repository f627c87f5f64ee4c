"""Worst-case requests against a live ragkv service: what one anonymous request can cost (issue 24).

Starts ``python -m ragkv_server.server`` on a free loopback port with the tiny model (``models/stories260k``;
``--model`` another)
and the service's default limits (or uses ``--url``), ingests a few passages, then sends each
worst-case request one at a time while a probe polls ``/healthz``: the most chunk references
(``MAX_CHUNK_REFS`` copies of a stored chunk's key, and 4,096 refs), the longest stop list allowed
and a longer one, the largest JSON body, and the longest NDJSON line (and one byte more). For each it
prints the status, the request's wall time and the worst ``/healthz`` latency meanwhile; then a
``/healthz`` on a fresh connection beside ``--half-open`` connections that never finish their
request head (more than ``max_connections``: the cap on pending ones closes the oldest). It ends with
one JSON line whose ``worst_s`` is the costliest request.

A started service gets ``--max-body-bytes`` / ``--max-line-bytes`` as its limits (the upload limit
raised to fit two such lines), so ``--max-line-bytes 37748736`` times the 36 MiB line
``apps/tests/test_security.py`` sends (that test keeps a 10x bound; the figure is measured here).

    python -m eval.bench_worst_request
    python -m eval.bench_worst_request --model smollm2-135m-instruct   # the default model
    python -m eval.bench_worst_request --max-line-bytes 37748736        # the test's 36 MiB line
    python -m eval.bench_worst_request --url http://127.0.0.1:8000 --key WRITE_KEY
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from eval.harness import launch_server, stop_server
from eval.prompts import DATA_DIR, TINY_MODEL
from ragkv.blend.spans import MAX_CHUNK_REFS


def start_server(
    data_dir: Path, model: str = str(TINY_MODEL), limits: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """The service on a free loopback port with ``model`` (the tiny one: one torch thread) and the
    default limits, or ``limits`` (``RAGKV_*`` settings) over them."""
    env = {"RAGKV_MODEL": model, "RAGKV_DATA_DIR": str(data_dir), "RAGKV_LOG_LEVEL": "warning"}
    if model == str(TINY_MODEL):
        env["RAGKV_TORCH_THREADS"] = "1"
    return launch_server({**env, **(limits or {})}, data_dir.parent / "server.log")


def healthz_beside_half_open(base: str, n: int) -> tuple[int, float]:
    """(status, seconds) of ``/healthz`` on a fresh connection once ``n`` connections have sent an
    unfinished request head (a slowloris attack: they hold the server's connection slots)."""
    host, port = base.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and nothing more
            socks.append(s)
        time.sleep(0.5)  # the server has accepted them all
        t0 = time.perf_counter()
        r = httpx.get(base + "/healthz", timeout=60)
        return r.status_code, time.perf_counter() - t0
    finally:
        for s in socks:
            s.close()


def timed(base: str, send: Callable[[], httpx.Response]) -> tuple[int, float, float]:
    """(status, request seconds, worst /healthz seconds while it ran)."""
    worst = [0.0]
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=60) as p:
            while not done.is_set():
                t0 = time.perf_counter()
                p.get("/healthz")
                worst[0] = max(worst[0], time.perf_counter() - t0)
                time.sleep(0.02)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        r = send()
        status = r.status_code
    except httpx.HTTPError as e:  # a refused body may end the connection before it is all sent
        status = f"{type(e).__name__}"
    took = time.perf_counter() - t0
    done.set()
    t.join()
    return status, took, worst[0]


def pieces(blob: bytes, size: int = 64 << 10) -> Iterator[bytes]:
    for i in range(0, len(blob), size):
        yield blob[i : i + size]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running service (default: start one with the tiny model)")
    ap.add_argument("--key", help="a write API key of that service")
    ap.add_argument(
        "--model", default=str(TINY_MODEL), help="the started service's model (e.g. smollm2-135m-instruct)"
    )
    ap.add_argument("--max-body-bytes", type=int, default=8 << 20, help="the service's max_body_bytes")
    ap.add_argument("--max-line-bytes", type=int, default=16 << 20, help="its max_upload_line_bytes")
    ap.add_argument("--half-open", type=int, default=300, help="half-open connections beside /healthz")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="ragkv-worst-")
    proc = None
    base = args.url
    if base is None:
        limits = {
            "RAGKV_MAX_BODY_BYTES": str(args.max_body_bytes),
            "RAGKV_MAX_UPLOAD_LINE_BYTES": str(args.max_line_bytes),
            "RAGKV_MAX_UPLOAD_BYTES": str(max(256 << 20, 2 * args.max_line_bytes + 1024)),
        }
        proc, base = start_server(Path(tmp.name) / "data", args.model, limits)
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    rows: list[dict] = []
    try:
        with httpx.Client(base_url=base, timeout=600, headers=headers) as c:
            sample = json.loads((DATA_DIR / "musique_s.json").read_text())[0]
            docs = [{"id": f"w{j}", "text": ctx["text"]} for j, ctx in enumerate(sample["ctxs"][:4])]
            ing = c.post("/v1/documents", json={"documents": docs})
            ing.raise_for_status()
            chunk_id = ing.json()["documents"][0]["chunk_ids"][0]
            src = c.post("/v1/query", json={"question": "x", "chunk_ids": [chunk_id], "max_tokens": 1})
            src.raise_for_status()
            key, text = src.json()["sources"][0]["kv_key"], src.json()["sources"][0]["text"]
            ctx = c.get("/v1/models").json()["data"][0]["id"]
            # the chunk's tokens a few times (key-only refs are searched in the prompt's token ids);
            # a service started elsewhere: its text, which may tokenize differently (then nothing is found)
            prompt: str | list[int] = (text + " ") * 3
            if proc is not None:
                from ragkv.store import LocalDirStore
                from ragkv.store.codecs import DEFAULT_CODEC, LEGACY_CODECS

                codecs = [DEFAULT_CODEC, *LEGACY_CODECS]  # the service's default store: read its headers
                with LocalDirStore(Path(tmp.name) / "data" / "kv", codecs=codecs) as store:
                    hdr = store.header(key)
                if hdr is not None:
                    prompt = [1, *hdr.token_ids * 3]

            def completion(**extra) -> Callable[[], httpx.Response]:
                body = {"model": ctx, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
                return lambda: c.post("/v1/completions", json=body)

            ndjson = {"content-type": "application/x-ndjson"}
            line = b'{"text": "' + b"a" * (args.max_line_bytes - 13) + b'"}\n'
            over = b'{"text": "' + b"a" * (args.max_line_bytes + 1) + b'"}\n'
            body_max = json.dumps({"question": "q", "pad": " " * (args.max_body_bytes - 40)}).encode()
            completion()()  # warm-up: the first blend runs the gate (once per process), then caches
            # each hostile request's baseline: the same prompt and answer length without what it adds
            base_refs = "the same completion, no refs"
            base_stops = "the same, 48 tokens, no stops"
            baseline = {
                f"{MAX_CHUNK_REFS} refs of one stored key": base_refs,
                "4 stops of 64 chars": base_stops,
            }
            cases: list[tuple[str, Callable[[], httpx.Response]]] = [
                (base_refs, completion()),
                (
                    f"{MAX_CHUNK_REFS} refs of one stored key",
                    completion(kv_transfer_params={"ragkv": {"chunks": [key] * MAX_CHUNK_REFS}}),
                ),
                ("4096 refs", completion(kv_transfer_params={"ragkv": {"chunks": [key] * 4096}})),
                (base_stops, completion(max_tokens=48)),
                ("4 stops of 64 chars", completion(stop=["\u00e9" * 64] * 4, max_tokens=48)),
                ("5000 stops", completion(stop=["ab"] * 5000)),
                (
                    "max JSON body (query)",
                    lambda: c.post(
                        "/v1/query", content=body_max, headers={"content-type": "application/json"}
                    ),
                ),
                (
                    "max JSON body + 1 (query)",
                    lambda: c.post(
                        "/v1/query",
                        content=body_max + b" " * 64,
                        headers={"content-type": "application/json"},
                    ),
                ),
                (
                    "longest NDJSON line",
                    lambda: c.post("/v1/documents", content=pieces(line), headers=ndjson),
                ),
                (
                    "NDJSON line too long",
                    lambda: c.post("/v1/documents", content=pieces(over), headers=ndjson),
                ),
            ]
            print(f"{'request':32} {'status':>12} {'seconds':>8} {'over baseline':>14} {'healthz max':>12}")
            took_by: dict[str, float] = {}
            for name, send in cases:
                status, took, worst = timed(base, send)
                took_by[name] = took
                extra = took - took_by[baseline[name]] if name in baseline else None
                rows.append(
                    {
                        "request": name,
                        "status": status,
                        "seconds": took,
                        "over_baseline_s": extra,
                        "healthz_max_s": worst,
                    }
                )
                shown = f"{extra:14.3f}" if extra is not None else f"{'':14}"
                print(f"{name:32} {status!s:>12} {took:8.3f} {shown} {worst:12.3f}")
            half_status, half_s = healthz_beside_half_open(base, args.half_open)
            print(f"/healthz beside {args.half_open} half-open connections: {half_status} in {half_s:.3f} s")
    finally:
        if proc is not None:
            stop_server(proc, 30)
        tmp.cleanup()
    hostile = [r for r in rows if not r["request"].startswith("the same")]
    worst_row = max(hostile, key=lambda r: r["seconds"])
    # what a hostile request costs beyond the ordinary work it asks for (prefill + decode of its prompt)
    extra = max(r["over_baseline_s"] if r["over_baseline_s"] is not None else r["seconds"] for r in hostile)
    print(
        json.dumps(
            {
                "bench": "worst_request",
                "worst_s": round(worst_row["seconds"], 3),
                "worst_request": worst_row["request"],
                "worst_over_baseline_s": round(extra, 3),
                "healthz_max_s": round(max(r["healthz_max_s"] for r in rows), 3),
                "longest_ndjson_line_bytes": args.max_line_bytes - 13,
                "half_open": args.half_open,
                "healthz_beside_half_open": {"status": half_status, "seconds": round(half_s, 3)},
                "requests": [
                    {
                        **r,
                        "seconds": round(r["seconds"], 3),
                        "over_baseline_s": None
                        if r["over_baseline_s"] is None
                        else round(r["over_baseline_s"], 3),
                        "healthz_max_s": round(r["healthz_max_s"], 3),
                    }
                    for r in rows
                ],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
