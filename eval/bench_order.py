"""Chunk order as an operating point (issue 52, item 5): how often does full prefill's greedy answer change
when the same passages come in another order?

A cache-aware order (CacheWeaver, RAGCache's reordering) puts the retrieved chunks the KV tree already
holds first, in the tree's order, so that more of the prompt is an exact hit. That changes the prompt, so
it may ship as the default only if the answers it gives stay within the noise floor of the answers in
retrieval order (the floor: bfloat16 full prefill against float32, the fidelity report's
``full-bf16`` point) and gold recall is not lower. This measures the question the way the gate would:
on the package's calibration set, float32 full prefill of the given passage order against full prefill
of the same passages reordered, same prompt convention, 16 greedy tokens. Orders: ``reverse``, and
``shuffle`` (a fixed seed per question): a cache-aware order is one of the permutations, which one
depends on what the tree holds, so a fixed random permutation stands for a typical one.

Records go to a JSONL file as they finish (an interrupted run resumes). Prints a table and ends with one
JSON line: per order, the same-answer rate with its 95% interval, F1 against the given order's answer,
and gold recall of both orders.

    python -m eval.bench_order [--limit N] [--orders reverse,shuffle] [--records PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path


def permuted(order: str, n: int, question_id: str) -> list[int]:
    """The indices of ``n`` passages in ``order`` (``reverse``, ``shuffle``: seeded by the question)."""
    idx = list(range(n))
    if order == "reverse":
        return idx[::-1]
    if order == "shuffle":
        rng = random.Random(f"bench_order:{question_id}")
        while n > 1 and idx == list(range(n)):
            rng.shuffle(idx)
        return idx
    raise ValueError(f"unknown order {order!r}; use reverse or shuffle")


def run(limit: int | None, orders: list[str], records: Path, max_new_tokens: int) -> dict:
    import torch

    import ragkv
    from ragkv.fidelity.measure import bootstrap_ci, load_calibration_set
    from ragkv.generate import SamplingParams, generate
    from ragkv.metrics import normalize_answer, token_f1
    from ragkv.metrics.text import answer_recall, max_over_golds
    from ragkv.prompt import prompt_parts

    llm = ragkv.LLM()
    m = llm.model
    passages, questions = load_calibration_set()
    questions = questions[:limit] if limit else questions
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    done: dict[tuple[str, str], dict] = {}
    if records.exists():
        for line in records.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a torn last line
                continue
            if r.get("max_new_tokens") == max_new_tokens:
                done[(r["id"], r["order"])] = r

    def answer(prefix, chunks, suffix) -> str:
        with torch.inference_mode():
            res = ragkv.prefill(m, prefix, chunks, suffix, "full")
            return generate(m, res, params).text

    records.parent.mkdir(parents=True, exist_ok=True)
    with records.open("a") as f:
        for i, q in enumerate(questions):
            todo = [o for o in orders if (q["id"], o) not in done]
            if not todo:
                continue
            prefix, suffix = prompt_parts(m, q["question"])
            chunks = [m.encode(passages[pid]) for pid in q["passages"]]
            if len(prefix) + len(suffix) + sum(map(len, chunks)) + max_new_tokens > m.config.max_position:
                continue
            given = answer(prefix, chunks, suffix)
            for order in todo:
                text = answer(prefix, [chunks[j] for j in permuted(order, len(chunks), q["id"])], suffix)
                r = {
                    "id": q["id"],
                    "split": q["split"],
                    "order": order,
                    "max_new_tokens": max_new_tokens,
                    "given": given,
                    "output": text,
                    "same": float(normalize_answer(text) == normalize_answer(given)),
                    "f1_vs_given": token_f1(text, given),
                    "recall_given": max_over_golds(answer_recall, given, q["answers"]),
                    "recall": max_over_golds(answer_recall, text, q["answers"]),
                }
                done[(q["id"], order)] = r
                f.write(json.dumps(r) + "\n")
                f.flush()
            print(f"  {i + 1}/{len(questions)} {q['id']}", flush=True)
    floor = _floor(m)
    out: dict = {"questions": len({k[0] for k in done}), "noise_floor_same": floor, "orders": {}}
    print(f"\nnoise floor (bf16 vs fp32 full, the fidelity report): same answer {floor}")
    print(
        "| order | n | same answer as the given order [95% CI] | F1 vs given | gold recall given / reordered |"
    )
    print("|---|---|---|---|---|")
    for order in orders:
        recs = [r for (qid, o), r in done.items() if o == order]
        if not recs:
            continue
        same = [r["same"] for r in recs]
        row = {
            "n": len(recs),
            "same": round(statistics.fmean(same), 4),
            "same_ci": bootstrap_ci(same),
            "f1_vs_given": round(statistics.fmean(r["f1_vs_given"] for r in recs), 4),
            "recall_given": round(statistics.fmean(r["recall_given"] for r in recs), 4),
            "recall": round(statistics.fmean(r["recall"] for r in recs), 4),
        }
        row["within_floor"] = (
            floor is not None and row["same_ci"][1] >= floor and row["recall"] >= row["recall_given"]
        )
        out["orders"][order] = row
        print(
            f"| {order} | {row['n']} | {row['same']:.2f} [{row['same_ci'][0]:.2f}, {row['same_ci'][1]:.2f}] "
            f"| {row['f1_vs_given']:.2f} | {row['recall_given']:.2f} / {row['recall']:.2f} |"
        )
    return out


def _floor(model) -> float | None:
    """The noise floor's same-answer rate (bf16 full prefill) from the model's fidelity report, or None."""
    from ragkv.fidelity import GATE, ReportKey

    report = GATE.report(ReportKey(model.fingerprint))
    return None if report is None else round(float(report.floor.same), 4)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="the first N calibration questions")
    ap.add_argument("--orders", default="reverse,shuffle", help="comma-separated: reverse, shuffle")
    ap.add_argument("--records", type=Path, default=Path("runs/bench_order.jsonl"), help="resumable records")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args(argv)
    out = run(a.limit, [o.strip() for o in a.orders.split(",") if o.strip()], a.records, a.max_new_tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
