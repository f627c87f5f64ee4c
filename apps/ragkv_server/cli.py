"""``ragkv-server`` command line: ``serve`` (the HTTP service), ``ingest``, ``ask`` and ``gc``.

The four share the service's settings (:mod:`ragkv_server.config`: defaults < ``--config`` file or
``$RAGKV_CONFIG`` < ``RAGKV_*`` env vars < flags), so they use the same model, data directory and store
unless told otherwise. They are this distribution's, not the core's (issue 55): the core's ``ragkv``
command keeps what the core owns (``demo``, ``models``, ``calibrate``, ``adapter``, ``eval``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from ragkv.cli import configure_logging, run_command, set_threads
from ragkv.defaults import MODES
from ragkv.model.rope_energy import DEMO_CORPUS
from ragkv_server.config import Settings, load_settings
from ragkv_server.service import build_rag

PROMPT_FILE_HELP = (
    "JSON with the RAG prompt settings: instruction, question_template, system, examples (few-shot "
    f"[user, answer] turns); e.g. the demo corpus {DEMO_CORPUS} for the demo's prompt"
)


#: the settings every command here takes as a flag (:func:`add_settings_flags`)
SETTINGS_FLAGS = ("model", "data_dir", "store", "prompt_file")


def settings(args: argparse.Namespace, **extra) -> Settings:
    """The service's settings as ``args`` (the shared flags, :func:`add_settings_flags`) override them."""
    return load_settings(args.config, **{k: getattr(args, k) for k in SETTINGS_FLAGS}, **extra)


def read_docs(path: Path, fmt: str) -> list[dict]:
    """Documents of one file: text/markdown (one document), JSONL, or JSON (documents or MuSiQue samples)."""
    if fmt == "auto":
        fmt = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}.get(path.suffix.lower(), "text")
    if fmt == "text":
        return [{"id": path.stem, "text": path.read_text(), "metadata": {"path": str(path)}}]
    if fmt == "jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        rows = json.loads(path.read_text())
        rows = rows if isinstance(rows, list) else [rows]
    docs = []
    for i, r in enumerate(rows):
        if isinstance(r, dict) and "ctxs" in r:  # a MuSiQue / 2WikiMQA sample: its passages
            docs += [
                {"id": f"{path.stem}-{i}-{j}", "text": c["text"], "metadata": {"title": c.get("title", "")}}
                for j, c in enumerate(r["ctxs"])
            ]
        elif isinstance(r, dict) and isinstance(r.get("text"), str):
            docs.append({"id": r.get("id"), "text": r["text"], "metadata": r.get("metadata") or {}})
        elif isinstance(r, str):
            docs.append({"text": r})
        else:
            raise ValueError(f"{path}: item {i} is not a document (need a string or an object with 'text')")
    return docs


def _gc(args: argparse.Namespace) -> int:
    """Delete stored chunk KV that no document of the data folder's index references."""
    rag = build_rag(settings(args), writer=True, collect_garbage=False)
    rep = rag.collect_garbage(dry_run=args.dry_run)
    rag.close()
    print(
        f"{rep['blobs']} stored chunk KV blobs, {rep['unreferenced']} unreferenced, "
        f"{rep['deleted']} deleted ({rep['bytes_freed']} bytes freed)"
    )
    print(json.dumps(rep))
    return 0


def _ingest(args: argparse.Namespace) -> int:
    """Ingest files into the data folder (or through a running service with ``--url``; as a Ray Data
    pipeline with ``--ray``)."""
    s = settings(args, chunk_tokens=args.chunk_tokens)
    if args.ray:
        if args.url:
            print("error: --ray ingests into the data folder itself; leave out --url", file=sys.stderr)
            return 2
        return _ingest_ray(args, s)
    docs = []
    for p in args.paths:
        path = Path(p)
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for f in files:
            docs += read_docs(f, args.format)
    docs = docs[: args.limit or None]
    if not docs:
        print("error: no documents found", file=sys.stderr)
        return 2
    if args.url:  # a running service owns the folder: ingest through its API (it holds the writer lock)
        return _print_ingest(
            len(docs), args.url, upload_documents(args.url, docs, args.api_key, args.collection)
        )
    rag = build_rag(s, writer=True)  # one writer per data folder (a running `serve` holds it)
    set_threads(args.threads, rag.model.config.hidden_size)
    rep = rag.ingest(docs, show_progress=not args.quiet, collection=args.collection)
    rag.close()
    return _print_ingest(len(docs), s.data_dir, {k: getattr(rep, k) for k in INGEST_COUNTS})


def _ingest_ray(args: argparse.Namespace, s: Settings) -> int:
    """``ingest --ray``: the same documents through :func:`ragkv.rag.distributed.ingest_dataset` (a
    local Ray, or the cluster at ``--address``); ``.json`` files are read here, the rest by Ray."""
    from ragkv.rag.distributed import WorkerSpec, error_lines, ingest_dataset
    from ragkv.store import default_store_url

    paths = [Path(p) for p in args.paths]
    json_docs = [d for p in paths if p.suffix.lower() == ".json" for d in read_docs(p, args.format)]
    data = [str(p) for p in paths if p.suffix.lower() != ".json"] or json_docs
    if json_docs and data is not json_docs:
        print("error: --ray takes .json files or other paths, not both in one run", file=sys.stderr)
        return 2
    rag = build_rag(s, writer=True)
    set_threads(args.threads, rag.model.config.hidden_size)
    key = s.store_hmac_key.get_secret_value() if s.store_hmac_key else None
    spec = WorkerSpec.of(rag, s.store or default_store_url(s.data_dir), model=s.model, dtype=s.dtype)
    spec = dataclasses.replace(spec, device=s.device, adapter=s.adapter, codec=s.store_codec, hmac_key=key)
    try:
        rep = ingest_dataset(
            data,
            rag,
            spec,
            collection=args.collection,
            address=args.address,
            kv_actors=args.kv_actors,
            commit_every=args.commit_every,
            show_progress=not args.quiet,
        )
    finally:
        rag.close()
    for line in error_lines(rep):
        print(line, file=sys.stderr)
    counts = {k: getattr(rep, k) for k in INGEST_COUNTS}
    extra = {
        "errors": len(rep.errors),
        "kv_already_stored": rep.kv_already_stored,
        "workers": len(rep.workers),
    }
    return _print_ingest(rep.documents, s.data_dir, {**counts, **extra})


#: the counts an ingest reports, the library's :class:`~ragkv.rag.IngestReport` and the service's alike
INGEST_COUNTS = ("documents_added", "documents_unchanged", "chunks_added", "kv_computed", "seconds")


def _print_ingest(n_docs: int, where, counts: dict) -> int:
    print(
        f"{n_docs} documents -> {where}: {counts['documents_added']} added, {counts['documents_unchanged']} "
        f"unchanged, {counts['chunks_added']} chunks, {counts['kv_computed']} chunk KVs computed in "
        f"{counts['seconds']:.1f} s"
    )
    print(json.dumps({"documents": n_docs, **counts, "seconds": round(counts["seconds"], 3)}))
    return 0


def upload_documents(
    url: str, docs: list[dict], api_key: str | None, collection: str | None, batch_bytes: int = 4 << 20
) -> dict:
    """Ingest ``docs`` through a running service (``POST /v1/documents``, NDJSON batches of about
    ``batch_bytes``, each committed whole); returns the summed counts. A refused batch raises
    ValueError with the service's message, after the batches before it were committed."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/x-ndjson"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if collection:
        headers["X-Ragkv-Collection"] = collection
    total = dict.fromkeys(INGEST_COUNTS, 0)
    lines = [json.dumps({k: v for k, v in d.items() if v is not None}).encode() + b"\n" for d in docs]
    while lines:
        n, size = 0, 0
        while n < len(lines) and (n == 0 or size + len(lines[n]) <= batch_bytes):
            size += len(lines[n])
            n += 1
        body, lines = b"".join(lines[:n]), lines[n:]
        req = urllib.request.Request(url.rstrip("/") + "/v1/documents", body, headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                got = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise ValueError(f"{url} refused the upload ({e.code}): {message}") from None
        except urllib.error.URLError as e:
            raise ValueError(f"cannot reach {url}: {e.reason}") from None
        for k in INGEST_COUNTS:
            total[k] += got[k]
    return total


def _ask(args: argparse.Namespace) -> int:
    """Answer one question over the ingested documents (``--compare``: with full prefill too)."""
    s = settings(args)
    rag = build_rag(s)
    set_threads(args.threads, rag.model.config.hidden_size)
    if len(rag.index) == 0:
        print(f"error: nothing ingested in {s.data_dir}; run `ragkv-server ingest` first", file=sys.stderr)
        return 2
    coll = args.collection
    chunks = (
        rag.chunks_by_id(args.chunk_ids, coll)
        if args.chunk_ids
        else rag.retrieve(args.question, args.top_k, coll)
    )
    max_new = args.max_new_tokens or s.max_new_tokens
    modes = ["full", args.mode or s.mode] if args.compare else [args.mode or s.mode]
    out = {}
    for mode in dict.fromkeys(modes):
        streamed = args.stream and not args.compare
        if streamed:
            print(f"{mode}: ", end="", flush=True)
        ans = None
        kw = dict(mode=mode, ratio=args.ratio, chunks=chunks, max_new_tokens=max_new, collection=coll)
        for ev in rag.answer_stream(args.question, **kw):
            if hasattr(ev, "sources"):
                ans = ev
            elif streamed:
                print(ev.text, end="", flush=True)
        if streamed:
            print()
        else:
            print(f"{mode}: {ans.text.strip()}")
        out[mode] = ans
        t = ans.timings
        print(
            f"  TTFT {t['ttft_s'] * 1000:.1f} ms (retrieval {t['retrieval_s'] * 1000:.1f}, KV fetch "
            f"{t['kv_fetch_s'] * 1000:.1f}), total {t['total_s'] * 1000:.1f} ms, recomputed "
            f"{ans.stats['recompute_fraction']:.0%} of {ans.stats['num_tokens']} prompt tokens"
        )
    print("sources:")
    for r in chunks:
        print(f"  chunk {r.chunk_id} ({r.doc_id}#{r.seq}, score {r.score:.3f}): {r.text.strip()[:70]!r}")
    rag.close()
    print(
        json.dumps(
            {
                "question": args.question,
                "chunk_ids": [r.chunk_id for r in chunks],
                **{f"answer_{m}": a.text for m, a in out.items()},
                **{f"ttft_{m}_s": round(a.timings["ttft_s"], 5) for m, a in out.items()},
            }
        )
    )
    return 0


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``ingest``, ``ask`` and ``gc`` share with the service's settings."""
    p.add_argument("--config", help="settings file (.toml/.yaml/.json); default $RAGKV_CONFIG")
    p.add_argument("--model", help="model name, GGUF file, folder or hub id (default: the settings' model)")
    p.add_argument("--data-dir", help="index + KV directory (default: the settings' data_dir)")
    p.add_argument("--store", help="chunk KV store URL: file:///dir, redis://host:6379/0, memory://")
    p.add_argument("--threads", default="auto", help="torch threads: a number, or auto (1 for tiny models)")
    p.add_argument("--prompt-file", help=PROMPT_FILE_HELP)


def _serve(args: argparse.Namespace) -> int:
    """The HTTP service: every argument after ``serve`` is :mod:`ragkv_server.server`'s."""
    from ragkv_server.server import main as serve

    return serve(args.rest, prog="ragkv-server serve")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ragkv-server", description="ragkv's HTTP service, and ingest / ask / gc over its data folder."
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    i = sub.add_parser(
        "ingest",
        help="ingest files (text, JSONL, JSON) into the index and KV store",
        description="Split, embed, index and precompute chunk KV of documents. Idempotent.",
    )
    i.add_argument(
        "paths",
        nargs="+",
        help="files or directories (.txt/.md: one document; .jsonl: "
        "{id?, text, metadata?} per line; .json: a list of those, or MuSiQue samples)",
    )
    add_settings_flags(i)
    i.add_argument("--format", choices=["auto", "text", "jsonl", "json"], default="auto")
    i.add_argument("--chunk-tokens", type=int, default=None)
    i.add_argument("--limit", type=int, default=None, help="ingest at most this many documents")
    i.add_argument("--collection", default=None, help="the collection to ingest into (default: default)")
    i.add_argument(
        "--url",
        help="ingest through a running ragkv service (it holds the data folder: one writer per folder)",
    )
    i.add_argument("--api-key", default=os.environ.get("RAGKV_API_KEY"), help="with --url: a write key")
    i.add_argument(
        "--ray",
        action="store_true",
        help="run ingest as a Ray Data pipeline (split, embed and chunk KV on Ray workers; needs ragkv[ray])",
    )
    i.add_argument(
        "--address", default=None, help="with --ray: the Ray cluster to join (default: a local Ray)"
    )
    i.add_argument(
        "--kv-actors", type=int, default=1, help="with --ray: chunk-KV actors (the model once each)"
    )
    i.add_argument(
        "--commit-every", type=int, default=64, help="with --ray: documents per index commit (acknowledged)"
    )
    i.add_argument("-q", "--quiet", action="store_true")
    i.set_defaults(func=_ingest)

    g = sub.add_parser(
        "gc",
        help="delete stored chunk KV that no document references",
        description="Collect the chunk store of a data folder: every blob no chunk of its index "
        "references is deleted. Only for a store this index owns (not one shared with another index).",
    )
    add_settings_flags(g)
    g.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    g.set_defaults(func=_gc)

    a = sub.add_parser(
        "ask",
        help="answer a question over the ingested documents",
        description="Retrieve (or use --chunk-ids) and answer with the chunks' KV reused.",
    )
    a.add_argument("question")
    add_settings_flags(a)
    a.add_argument("--mode", choices=MODES, default=None)
    a.add_argument("--ratio", type=float, default=None)
    a.add_argument("--top-k", type=int, default=None)
    a.add_argument("--chunk-ids", type=int, nargs="+", default=None)
    a.add_argument("--collection", default=None, help="the collection to search (default: default)")
    a.add_argument("--max-new-tokens", type=int, default=None, help="default: the settings' max_new_tokens")
    a.add_argument("--compare", action="store_true", help="also answer with full prefill and show both TTFTs")
    a.add_argument("--stream", action="store_true", help="print tokens as they come")
    a.set_defaults(func=_ask)

    f = sub.add_parser(
        "serve",
        help="run the HTTP service (python -m ragkv_server.server)",
        add_help=False,
        description="Runs `python -m ragkv_server.server`; `ragkv-server serve --help` lists its options.",
    )
    f.add_argument("rest", nargs=argparse.REMAINDER)
    f.set_defaults(func=_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd_at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if cmd_at is not None and argv[cmd_at] == "serve":  # everything after it belongs to the server's parser
        configure_logging(any(a in ("-v", "--verbose") for a in argv[:cmd_at]))
        return _serve(argparse.Namespace(rest=argv[cmd_at + 1 :]))
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
