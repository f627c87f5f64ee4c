"""The fidelity curve as a picture: same-answer rate and TTFT speed-up against charged compute."""

from __future__ import annotations

from pathlib import Path

from ragkv.fidelity.report import FidelityReport


def plot_report(report: FidelityReport, path: Path) -> Path:
    """Write ``path`` (PNG): the ladder's same-answer rate with its intervals, the noise floor as a
    line, and the measured speed-up on a second axis; the chosen default is marked by the caller's text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ladder = sorted((p for p in report.points if p.mode in ("reuse", "blend")), key=lambda p: p.charged)
    x = [p.charged for p in ladder]
    y = [p.same for p in ladder]
    err = [[p.same - p.same_ci[0] for p in ladder], [p.same_ci[1] - p.same for p in ladder]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label="blend: same answer as full (95% CI)")
    for p in ladder:
        ax.annotate(p.name, (p.charged, p.same), textcoords="offset points", xytext=(4, -12), fontsize=7)
    for p in report.points:
        if p.mode == "prefix":  # exact prefill: what the gate falls back to
            ax.plot([p.charged], [p.same], "g*", ms=12, label=f"exact prefill ({p.speedup:.2f}x TTFT)")
    ax.axhline(
        report.floor.same,
        color="crimson",
        ls="--",
        label=f"noise floor: bf16 full prefill ({report.floor.same:.0%})",
    )
    ax.set_xlabel("charged compute (rows x layers over a full prefill's)")
    ax.set_ylabel("same greedy answer as float32 full prefill")
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    ax2.plot(x, [p.speedup for p in ladder], color="grey", marker="s", ls=":", label="TTFT speed-up")
    ax2.set_ylabel("TTFT speed-up over full prefill")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize=8)
    ax.set_title(
        f"{report.model}: fidelity of blend on {report.n_questions} calibration questions", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
