"""Plot the adapter candidates side by side: fidelity against charged compute on the dev split, and the
training curves (issue 38).

    python -m eval.plot_adapter --records runs/adapter/dev.records.jsonl \
        --train const=runs/adapter/train.log,wkv16=runs/adapter/wkv16.log --out docs/results/adapter_dev.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", required=True)
    ap.add_argument("--train", default="", help="name=log,...: logs whose JSON lines carry a 'curve'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    by: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for line in Path(args.records).read_text().splitlines():
        r = json.loads(line)
        by[r["cond"]][r["ratio"]].append(r)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = plt.get_cmap("tab20").colors  # one colour per condition: more than the default cycle's ten
    for i, (cond, ratios) in enumerate(by.items()):
        style = {"color": colors[(2 * i) % 20 + (2 * i) // 20 % 2], "marker": "osD^v"[i % 5], "label": cond}
        xs = sorted(ratios)
        charged = [statistics.fmean(x["charged"] for x in ratios[r]) for r in xs]
        same = [statistics.fmean(x["same"] for x in ratios[r]) for r in xs]
        kl = [statistics.fmean(x["kl"] for x in ratios[r]) for r in xs]
        axes[0].plot(charged, same, "-", **style)
        axes[1].plot(charged, kl, "-", **style)
    axes[0].axhline(0.81, color="grey", ls="--", lw=1, label="noise floor (bf16, held-out)")
    axes[0].set(xlabel="charged compute", ylabel="same greedy answer as full", title="dev split: fidelity")
    axes[1].set(
        xlabel="charged compute", ylabel="first-token KL vs full", yscale="log", title="dev split: KL"
    )
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    for spec in filter(None, args.train.split(",")):
        name, path = spec.split("=", 1)
        for line in Path(path).read_text().splitlines():
            if line.startswith("{") and '"curve"' in line:
                rec = json.loads(line)
                curve = rec["curve"]
                k = 8
                smooth = [statistics.fmean(curve[max(0, i - k) : i + 1]) for i in range(len(curve))]
                label = f"{name} (rank {rec['rank']})" if "rank" in rec else name
                axes[2].plot(range(1, len(curve) + 1), smooth, label=label)
    axes[2].set(xlabel="step", ylabel="KL to full prefill (train, smoothed)", title="training")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(json.dumps({"plot": args.out, "conditions": sorted(by)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
