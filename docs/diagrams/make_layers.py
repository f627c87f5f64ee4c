"""Draw ragkv's layer map (docs/diagrams/layers.png, the README's picture) from the enforced ranks.

The ranks are read from ``RANK`` in tests/project/test_layout.py, the test that fails when a module
imports a unit of its own or a higher rank, so the picture shows what the suite enforces. Units of the
same rank share a row; the rows run bottom (imported by everything) to top. Above the ``ragkv`` package
sit the distributions that depend on it (the integrations and the service: top-level ``integrations/``
and ``apps/``), beside it what runs from a checkout only. The PNG records the ranks it was drawn from
(``ragkv:ranks``), which tests/project/test_docs_links.py compares with ``RANK``.

    /work/main/.venv/bin/python docs/diagrams/make_layers.py [--out docs/diagrams/layers.png]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "layers.png"

#: one line per ragkv unit (a unit not listed here is drawn with its name only)
DESCRIBE = {
    "defaults": "the prefill modes and every default of every surface (imports nothing)",
    "metrics": "F1 / EM, first-token KL, attention deviation",
    "attention": "dense / paged attention, KV caches, HACK",
    "constrain": "structured output: JSON-schema token masks",
    "fusion": "BFF / CFF joint KV blocks",
    "model": "config, RoPE, loaders, the one layer loop",
    "prompt": "the prompt convention: instruction + chunks + question",
    "kv": "chunk KV: the type, keyed by content and model",
    "facts": "invented facts: calibration and training data",
    "store": "chunk-KV stores (memory, dir, Redis, tiered) and codecs",
    "blend": "prefill modes, CacheBlend, spans, locator, the chunk-KV resolver",
    "generate": "decoding: sampling, stops, logprobs, constraints",
    "fidelity": "fidelity report and gate: the point blend runs at",
    "adapter": "KV adapters: a learned correction of reused chunk KV, and its training",
    "llm": "ragkv.LLM: one model, any prefill mode",
    "engine": "continuous batching over paged KV, serving an LLM",
    "rag": "ingest, index, retrieve, answer: one query path",
    "demo": "the demo corpus",
    "__init__": "the public API (import ragkv)",
    "testing": "what every test suite shares: the tiny model, fixtures",
    "cli": "ragkv demo / models / calibrate / adapter / eval",
}
#: the distributions that depend on ragkv: (folder, distribution, what it is)
DISTRIBUTIONS = (
    ("integrations/frameworks", "ragkv-frameworks", "what the integrations share"),
    ("integrations/langchain", "langchain-ragkv", "LangChain models,\nretriever, splitter"),
    (
        "integrations/llama-index",
        "llama-index-llms-ragkv\nllama-index-retrievers-ragkv",
        "LlamaIndex LLM, retriever",
    ),
    ("integrations/vllm", "ragkv-vllm", "vLLM plugin: KV connector"),
    ("apps/", "ragkv-server", "HTTP service, its CLI"),
)
CHECKOUT = (
    ("eval/", "evaluation, benchmarks"),
    ("tests/", "the suite"),
    ("data/, models/", "eval sets, tiny model"),
)


def read_ranks(test_file: Path = REPO / "tests" / "project" / "test_layout.py") -> dict[str, float]:
    """``RANK`` of tests/project/test_layout.py, read without importing it (a literal dict)."""
    for node in ast.walk(ast.parse(test_file.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "RANK" for t in targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"no RANK in {test_file}")


def ranks_signature(ranks: dict[str, float]) -> str:
    """The ranks as one stable string (stored in the PNG, compared by the docs test)."""
    return ";".join(f"{u}={r:g}" for u, r in sorted(ranks.items(), key=lambda kv: (kv[1], kv[0])))


def draw(ranks: dict[str, float], out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    core = dict(ranks)
    rows = sorted({r for r in core.values()})
    row_h, gap, width = 0.62, 0.12, 10.0
    top_band = 1.35
    height = len(rows) * (row_h + gap) + top_band + 1.6
    fig = plt.figure(figsize=(13.5, height * 0.62 + 0.6), dpi=110)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-1.2, width + 3.6)
    ax.set_ylim(-0.5, height)
    ax.axis("off")

    def box(x, y, w, h, title, sub, face, edge, dashed=False, size=9.5):
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=face,
                edgecolor=edge,
                linewidth=1.4,
                linestyle="--" if dashed else "-",
            )
        )
        ax.text(x + w / 2, y + h * 0.66, title, ha="center", va="center", fontsize=size, fontweight="bold")
        if sub:
            ax.text(x + w / 2, y + h * 0.27, sub, ha="center", va="center", fontsize=7.4, color="#333333")

    # the ragkv package: one row per rank, bottom to top
    y0 = 0.2
    core_top = y0 + len(rows) * (row_h + gap)
    ax.add_patch(
        FancyBboxPatch(
            (-0.15, 0.0),
            width + 0.3,
            core_top + 0.5,
            boxstyle="round,pad=0.02,rounding_size=0.15",
            facecolor="#f4f7fb",
            edgecolor="#5b7db1",
            linewidth=1.6,
        )
    )
    ax.text(
        width / 2, core_top + 0.1, "ragkv  (the core wheel: pip install ragkv)", ha="center", va="bottom",
        fontsize=11, fontweight="bold", color="#2c4a7a",
    )  # fmt: skip
    palette = ["#dce8f7", "#e3f1e1", "#fbeed7", "#efe3f5"]
    for i, r in enumerate(rows):
        units = sorted(u for u, ur in core.items() if ur == r)
        y = y0 + i * (row_h + gap)
        w = (width - 0.15 * (len(units) - 1)) / len(units)
        for j, u in enumerate(units):
            name = "ragkv/__init__" if u == "__init__" else f"ragkv/{u}"
            box(j * (w + 0.15), y, w, row_h, name, DESCRIBE.get(u, ""), palette[i % len(palette)], "#7d8fa8")
        ax.text(-0.35, y + row_h / 2, f"{r:g}", ha="right", va="center", fontsize=7.5, color="#666666")
    ax.text(-0.35, core_top + 0.05, "rank", ha="right", va="bottom", fontsize=7.5, color="#666666")

    # the distributions that depend on ragkv
    yb = core_top + 0.85
    n = len(DISTRIBUTIONS)
    w = (width - 0.15 * (n - 1)) / n
    for j, (folder, dist, what) in enumerate(DISTRIBUTIONS):
        box(
            j * (w + 0.15),
            yb,
            w,
            top_band - 0.25,
            folder,
            f"{dist}\n{what}",
            "#fff6e0",
            "#c08a1e",
            dashed=True,
            size=8.5,
        )
    ax.text(
        width / 2, yb + top_band - 0.18, "distributions that depend on ragkv (own pyproject, README, tests)",
        ha="center", va="bottom", fontsize=10, fontweight="bold", color="#8a5a00",
    )  # fmt: skip

    # beside: what runs from a checkout only
    xs = width + 0.55
    ax.text(
        xs + 1.3,
        core_top - 0.1,
        "checkout only\n(never imported by ragkv)",
        ha="center",
        va="top",
        fontsize=8.5,
    )
    for k, (folder, what) in enumerate(CHECKOUT):
        box(
            xs, core_top - 1.35 - k * 0.95, 2.6, 0.75, folder, what, "#eeeeee", "#999999", dashed=True, size=9
        )

    # imports point down only
    ax.add_patch(
        FancyArrowPatch(
            (xs + 0.5, core_top - 3.4),
            (xs + 0.5, 0.4),
            arrowstyle="-|>",
            mutation_scale=18,
            color="#555555",
            lw=1.6,
        )
    )
    ax.text(
        xs + 0.7, (core_top - 3.0) / 2, "imports point\ndown only\n(tests/project/test_layout.py)",
        ha="left", va="center", fontsize=8.5, color="#444444",
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(
        out, metadata={"ragkv:ranks": ranks_signature(ranks), "Software": "docs/diagrams/make_layers.py"}
    )
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    print(draw(read_ranks(), args.out))


if __name__ == "__main__":
    main()
