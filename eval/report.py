"""Aggregates, the Markdown table and the plots of an evaluation run (``eval.run``).

Merge several runs (e.g. both datasets) into one table::

    python -m eval.report runs/eval/musique runs/eval/2wikimqa [--md table.md]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from ragkv.defaults import MODES as PREFILL_MODES
from ragkv.metrics import percentile

METRICS = (
    "f1",
    "em",
    "recall",
    "kl",
    "first_token_agreement",
    "output_f1_vs_full",
    "same_as_full",
    "attn_dev",
    "recompute_fraction",
)


def label_of(mode: str, ratio: float | None) -> str:
    return f"blend@{ratio:g}" if mode == "blend" else mode


def _mean(xs: list) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def aggregate(records: Iterable[dict]) -> dict[str, dict]:
    """Per label: sample count, mean of each metric, TTFT median / p90 / mean, speedup vs full."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["label"], []).append(r)
    out: dict[str, dict] = {}
    for label, rs in by.items():
        ttft = [r["ttft_s"] for r in rs]
        a = {"label": label, "mode": rs[0]["mode"], "ratio": rs[0].get("ratio"), "n": len(rs)}
        for m in METRICS:
            a[m] = _mean([r.get(m) for r in rs])
        a["ttft_median_s"] = percentile(ttft, 50, empty=None)
        a["ttft_p90_s"] = percentile(ttft, 90, empty=None)
        a["ttft_mean_s"] = _mean(ttft)
        out[label] = a
    full = out.get("full")
    for a in out.values():
        ok = full and full["ttft_median_s"] and a["ttft_median_s"]
        # ratio of medians over the same samples (every label of a finished run covers the same ones)
        a["speedup_vs_full"] = full["ttft_median_s"] / a["ttft_median_s"] if ok else None
    return dict(sorted(out.items(), key=lambda kv: _order(kv[1])))


def _order(a: dict) -> tuple:
    modes = (*PREFILL_MODES, "default", "mapreduce", "maprerank")
    i = modes.index(a["mode"]) if a["mode"] in modes else len(modes)
    return (i, a.get("ratio") or 0.0)


def summary(aggs: dict[str, dict], default_ratio: float, extra: dict | None = None) -> dict:
    """Flat ``<label>_<metric>`` keys; plain ``blend_*`` for the default ratio (else the first blend ratio)."""
    out: dict = dict(extra or {})
    keys = (*METRICS, "ttft_median_s", "ttft_p90_s", "speedup_vs_full", "n")
    for label, a in aggs.items():
        for k in keys:
            out[f"{label}_{k}"] = a[k]
    blends = [a for a in aggs.values() if a["mode"] == "blend"]
    if blends:
        pick = next((a for a in blends if math.isclose(a["ratio"], default_ratio)), blends[0])
        out["blend_ratio"] = pick["ratio"]
        for k in keys:
            out[f"blend_{k}"] = pick[k]
        reuse = aggs.get("reuse")
        if reuse and reuse["kl"] and pick["kl"] is not None:
            out["blend_kl_over_reuse_kl"] = pick["kl"] / reuse["kl"]
    return out


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if x != 0 and abs(x) < 10 ** (-digits):
            return f"{x:.1e}"
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(results: list[dict]) -> str:
    """One row per (dataset, mode): quality, fidelity vs full, TTFT median/p90 and speedup."""
    head = (
        "| dataset | mode | n | F1 | EM | recall | first-token agree | KL(full‖mode) | output F1 vs full "
        "| Δattn | recompute | TTFT median (s) | TTFT p90 (s) | speedup vs full |"
    )
    lines = [head, "|" + "---|" * 14]
    for res in results:
        for a in res["aggregates"].values():
            lines.append(
                "| "
                + " | ".join(
                    [
                        res["config"]["dataset"],
                        a["label"],
                        str(a["n"]),
                        _fmt(a["f1"]),
                        _fmt(a["em"]),
                        _fmt(a.get("recall")),
                        _fmt(a["first_token_agreement"]),
                        _fmt(a["kl"], 4),
                        _fmt(a["output_f1_vs_full"]),
                        _fmt(a["attn_dev"], 4),
                        _fmt(a["recompute_fraction"]),
                        _fmt(a["ttft_median_s"], 4),
                        _fmt(a["ttft_p90_s"], 4),
                        _fmt(a["speedup_vs_full"], 2) + ("×" if a["speedup_vs_full"] else ""),
                    ]
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot_quality_vs_ttft(aggs: dict[str, dict], path: Path, title: str) -> None:
    """The paper's Fig. 12 view: F1 (and first-token agreement) against median TTFT, one point per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, name in (
        (axes[0], "f1", "F1"),
        (axes[1], "first_token_agreement", "first-token agreement"),
    ):
        markers = "osD^v<>px*h"
        for i, a in enumerate(aggs.values()):
            if a[metric] is None or a["ttft_median_s"] is None:
                continue
            ax.scatter(a["ttft_median_s"], a[metric], marker=markers[i % len(markers)], label=a["label"])
        ax.set_xlabel("TTFT median (s)")
        ax.set_ylabel(name)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vs_ratio(aggs: dict[str, dict], path: Path, title: str) -> None:
    """The paper's Fig. 16 view: quality and fidelity against the recompute ratio (reuse = 0, full = 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(a["ratio"], a) for a in aggs.values() if a["mode"] == "blend"]
    if "reuse" in aggs:
        pts.append((0.0, aggs["reuse"]))
    if "full" in aggs:
        pts.append((1.0, aggs["full"]))
    pts.sort(key=lambda p: p[0])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric, name in (
        (axes[0], "f1", "F1"),
        (axes[1], "kl", "first-token KL(full‖mode)"),
        (axes[2], "first_token_agreement", "first-token agreement"),
    ):
        xs = [r for r, a in pts if a[metric] is not None]
        ys = [a[metric] for _, a in pts if a[metric] is not None]
        ax.plot(xs, ys, marker="o")
        ax.set_xlabel("recompute ratio (reuse = 0, full = 1)")
        ax.set_ylabel(name)
        if metric == "kl" and any(y > 0 for y in ys):
            ax.set_yscale("symlog", linthresh=1e-5)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: Path, result: dict, plots: bool = True) -> list[Path]:
    """results.json, results.md and (optionally) the two PNG plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    tmp = paths[0].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(paths[0])
    paths[1].write_text(markdown_table([result]) + "\n" + notes(result))
    if plots and result["aggregates"]:
        title = f"{result['config']['dataset']} · {Path(result['config']['model']).name}"
        paths.append(out_dir / "quality_vs_ttft.png")
        plot_quality_vs_ttft(result["aggregates"], paths[-1], title)
        paths.append(out_dir / "quality_vs_ratio.png")
        plot_vs_ratio(result["aggregates"], paths[-1], title)
    return paths


def notes(result: dict) -> str:
    """The run's setting in words: prompt cut, retrieval recall, gate result."""
    c, f = result["config"], result.get("fit", {})
    lines = [
        f"- model `{c['model']}` ({c['dtype']}, {c['device']}), dataset `{c['dataset']}`, "
        f"{result.get('n_samples', 0)} samples, greedy, max {c['max_new_tokens']} new tokens"
        + (", partial run" if result.get("partial") else ""),
        f"- passages per prompt: {c['num_chunks'] or 'all'}; tokens per passage: "
        f"{c['chunk_tokens'] or 'uncut'}; passages cut: {_fmt(f.get('cut_frac'))}; words kept: "
        f"{_fmt(f.get('words_kept_frac'))}; gold answer string in the prompt: {_fmt(f.get('gold_in_prompt_rate'))} "
        f"(in the available passages: {_fmt(f.get('gold_in_available_rate'))}); prompt tokens median "
        f"{_fmt(f.get('prompt_tokens_median'), 0)}",
        f"- chat template: {'yes' if c.get('chat_frame') else 'none'}; blending self-check passed: "
        f"{result.get('gate_ok')}",
    ]
    r = result.get("retrieval")
    if r:
        lines.append(
            f"- retrieval: top-{r['top_k']} of {r['num_passages']} unique passages; gold answer in a "
            f"retrieved passage {_fmt(r['gold_hit_rate'])} (in the original passages "
            f"{_fmt(r['original_gold_hit_rate'])}); recall of the original passages "
            f"{_fmt(r['original_recall'])}, precision {_fmt(r['original_precision'])}"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="output folders of eval.run (holding results.json)")
    ap.add_argument("--md", help="write the merged table here (default: print it)")
    args = ap.parse_args(argv)
    results = []
    for d in args.runs:
        p = Path(d) / "results.json"
        if not p.is_file():
            ap.error(f"{p} not found: run python -m eval.run --out {d} first")
        results.append(json.loads(p.read_text()))
    text = markdown_table(results) + "\n" + "".join(notes(r) for r in results)
    if args.md:
        Path(args.md).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
