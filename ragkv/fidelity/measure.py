"""Measure a model's fidelity report on the package's calibration set (``ragkv calibrate``).

Per question, on the same token ids (the library's prompt convention, each passage its own chunk):
float32 full prefill is the reference; against it full prefill in bfloat16 (the noise floor), exact
prefill (the instruction prefix's exact KV reused), plain reuse and the blend ladder with the
model's blend schedule. Per point: same greedy answer, output F1 vs full, first-token KL, gold
recall, charged compute and the TTFT speed-up (prefill + first token, chunk KV in memory, paired
with full's on the same question), with bootstrap intervals. Records go to a JSONL file as they
finish, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from ragkv.blend.core import BlendSchedule
from ragkv.blend.kvtree import KVTree
from ragkv.blend.prefill import prefill
from ragkv.fidelity.choose import RECALL_SLACK
from ragkv.fidelity.report import (
    CALIBRATION_SET,
    FidelityReport,
    PointStats,
    ReportKey,
    cache_path,
    calibration_set_digest,
)
from ragkv.generate import SamplingParams, generate
from ragkv.metrics import first_token_kl, normalize_answer, token_f1
from ragkv.metrics.text import answer_recall, max_over_golds
from ragkv.model.forward import compute_chunk_kv
from ragkv.prompt import prompt_parts

#: the blend ratios measured (0 is plain reuse, 1 is full prefill and needs no measuring)
LADDER = (0.12, 0.5, 0.7, 0.8, 0.9)
MAX_NEW_TOKENS = 16


@dataclass(frozen=True)
class Point:
    name: str
    mode: str
    ratio: float | None = None


#: full prefill: the reference every point is measured against
FULL = Point("full", "full")


def ladder_points(ladder: tuple[float, ...] = LADDER) -> list[Point]:
    return [Point("exact", "prefix"), Point("reuse", "reuse", 0.0)] + [
        Point(f"blend@{r:g}", "blend", r) for r in ladder
    ]


def load_calibration_set(path: Path = CALIBRATION_SET) -> tuple[dict[str, str], list[dict]]:
    """(passage id -> text, questions) of the calibration set."""
    data = json.loads(path.read_text())
    return {p["id"]: p["text"] for p in data["passages"]}, data["questions"]


def bootstrap_ci(values: list[float], stat: Callable = statistics.fmean, n_boot: int = 1000, seed: int = 0):
    """95% percentile interval of ``stat`` over resampled questions."""
    if not values:
        return (float("nan"), float("nan"))
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(values), (n_boot, len(values)), generator=g)
    if stat is statistics.median:
        s = x[idx].median(dim=1).values
    else:
        s = x[idx].mean(dim=1)
    return (round(float(s.quantile(0.025)), 4), round(float(s.quantile(0.975)), 4))


class Measurer:
    """Runs every point of the ladder on one question at a time, paired with full prefill."""

    def __init__(
        self,
        model,
        bf16_model,
        schedule: BlendSchedule | None,
        max_new_tokens: int = MAX_NEW_TOKENS,
        adapter=None,
    ):
        self.model, self.bf16 = model, bf16_model
        # a chunk-KV writer writes the chunks' KV; a KV adapter reads it (prefill(adapter=...)). By what
        # it does, not its class: ragkv.adapter imports this package, not the other way round
        self.writer = adapter if hasattr(adapter, "chunk_kvs") else None
        self.adapter = None if self.writer is not None else adapter
        self.schedule = schedule or BlendSchedule()
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        self.prefix_cache = KVTree(max_bytes=1 << 28)

    def _timed(self, prefix, items, suffix, point: Point):
        mode, kw = point.mode, {}
        if mode != "full":  # the instruction head is cached (exact) for every mode but full, as in serving
            # nothing is inserted: a prompt's own chunks cached as an exact prefix would flatter its later points
            kw.update(prefix_cache=self.prefix_cache, prefix_cache_insert=False)
        if mode == "blend":
            kw["schedule"] = BlendSchedule(**{**self.schedule.__dict__, "ratios": (float(point.ratio),)})
        if mode in ("reuse", "blend") and self.adapter is not None:
            kw["adapter"] = self.adapter
        t0 = time.perf_counter()
        res = prefill(self.model, prefix, items, suffix, mode, **kw)
        int(res.logits.argmax())
        return res, time.perf_counter() - t0

    def question(
        self, q: dict, passages: dict[str, str], points: list[Point], floor: bool = True
    ) -> list[dict]:
        """Every point's record for ``q`` ([] when its prompt does not fit the model's context);
        ``floor=False``: without bf16's (an adapter's run takes it from the model's own run)."""
        m = self.model
        prefix, suffix = prompt_parts(m, q["question"])
        chunks = [m.encode(passages[pid]) for pid in q["passages"]]
        n = len(prefix) + len(suffix) + sum(map(len, chunks)) + self.params.max_new_tokens
        if n > m.config.max_position:
            return []
        if self.writer is not None:  # read with the model's fingerprint: measured, never stored
            kvs = [compute_chunk_kv(self.writer.model(m), c, m.fingerprint) for c in chunks]
        else:
            kvs = [compute_chunk_kv(m, c) for c in chunks]
        warm = self.prefix_cache.match(m, prefix)
        self.prefix_cache.release(warm)
        if warm.tokens < len(prefix):
            prefill(m, prefix, [], [], "prefix", prefix_cache=self.prefix_cache)
        full, t_full = self._timed(prefix, chunks, suffix, FULL)
        full_text = generate(m, full, self.params).text
        golds = q["answers"]
        base = {"id": q["id"], "split": q["split"], "full_output": full_text, "ttft_full_s": t_full}
        base["full_recall"] = max_over_golds(answer_recall, full_text, golds)
        out = []
        if floor:
            bf = prefill(self.bf16, prefix, chunks, suffix, "full")
            text = generate(self.bf16, bf, self.params).text
            out.append(self._record(base, "full-bf16", bf, text, full, golds, t_full))
        for p in points:
            res, t = self._timed(prefix, chunks if p.mode == "prefix" else kvs, suffix, p)
            out.append(self._record(base, p.name, res, generate(m, res, self.params).text, full, golds, t))
        return out

    @staticmethod
    def _record(base: dict, name: str, res, text: str, full, golds, ttft: float) -> dict:
        return dict(
            base,
            point=name,
            output=text,
            same=float(normalize_answer(text) == normalize_answer(base["full_output"])),
            f1_vs_full=token_f1(text, base["full_output"]),
            kl=first_token_kl(full.logits, res.logits),
            recall=max_over_golds(answer_recall, text, golds),
            charged=float(res.stats.get("recompute_fraction", 1.0)),
            ttft_s=ttft,
        )


def point_stats(point: Point, recs: list[dict], floor: list[dict] | None) -> PointStats:
    """Summary of one point's records (``floor``: bf16's records in the same question order)."""
    col = lambda k: [float(r[k]) for r in recs]  # noqa: E731
    speed = [r["ttft_full_s"] / r["ttft_s"] for r in recs]
    splits = {}
    for split in sorted({r["split"] for r in recs}):
        sub = [r for r in recs if r["split"] == split]
        splits[split] = {
            "n": len(sub),
            "same": round(statistics.fmean(r["same"] for r in sub), 4),
            "recall": round(statistics.fmean(r["recall"] for r in sub), 4),
            "speedup": round(statistics.median(r["ttft_full_s"] / r["ttft_s"] for r in sub), 3),
        }
    diff = [a["same"] - b["same"] for a, b in zip(recs, floor, strict=True)] if floor else [0.0]
    return PointStats(
        name=point.name,
        mode=point.mode,
        ratio=point.ratio,
        n=len(recs),
        same=round(statistics.fmean(col("same")), 4),
        same_ci=bootstrap_ci(col("same")),
        f1_vs_full=round(statistics.fmean(col("f1_vs_full")), 4),
        f1_vs_full_ci=bootstrap_ci(col("f1_vs_full")),
        kl=round(statistics.fmean(col("kl")), 5),
        kl_ci=bootstrap_ci(col("kl")),
        recall=round(statistics.fmean(col("recall")), 4),
        recall_ci=bootstrap_ci(col("recall")),
        charged=round(statistics.fmean(col("charged")), 4),
        speedup=round(statistics.median(speed), 3),
        speedup_ci=bootstrap_ci(speed, statistics.median),
        same_minus_floor_ci=bootstrap_ci(diff),
        splits=splits,
    )


def monotone_violations(ladder: list[PointStats]) -> list[str]:
    """Ladder steps where the same-answer rate drops by more than the interval allows (a defect).

    A drop counts when the higher ratio's upper bound is below the lower ratio's point estimate:
    noise moves a point inside its interval, an index bug moves it outside (LMCache-Ascend 277).
    """
    bad = []
    for lo, hi in zip(ladder, ladder[1:], strict=False):
        if hi.same_ci[1] < lo.same:
            bad.append(f"{hi.name} ({hi.same:.2f}, CI {hi.same_ci}) below {lo.name} ({lo.same:.2f})")
    return bad


def summarize(
    model,
    key: ReportKey,
    records: list[dict],
    points: list[Point],
    max_new_tokens: int,
    set_digest: str,
) -> FidelityReport:
    """The report of ``key`` (model, KV adapter, blend options) from the per-question records (every
    question that finished every point)."""
    by: dict[str, dict[str, dict]] = {}
    for r in records:
        by.setdefault(r["id"], {})[r["point"]] = r
    names = ["full-bf16"] + [p.name for p in points]
    ids = [i for i, recs in by.items() if all(n in recs for n in names)]
    if not ids:
        raise ValueError("no question finished every point: nothing to report")
    floor_recs = [by[i]["full-bf16"] for i in ids]
    floor = point_stats(Point("full-bf16", "full"), floor_recs, None)
    stats = [point_stats(p, [by[i][p.name] for i in ids], floor_recs) for p in points]
    ladder = [s for s in stats if s.mode in ("reuse", "blend")]
    full_recall = round(statistics.fmean(by[i]["full-bf16"]["full_recall"] for i in ids), 4)
    meets = [
        s
        for s in ladder
        if s.mode == "blend" and s.same >= floor.same and s.recall >= full_recall - RECALL_SLACK
    ]
    return FidelityReport(
        model=model.name,
        fingerprint=key.fingerprint,
        schedule=key.schedule,
        calibration_set=set_digest,
        n_questions=len(ids),
        max_new_tokens=max_new_tokens,
        full_recall=full_recall,
        full_ttft_s=round(statistics.median(by[i]["full-bf16"]["ttft_full_s"] for i in ids), 5),
        floor=floor,
        points=stats,
        monotone_ok=not monotone_violations(ladder),
        monotone_violations=monotone_violations(ladder),
        compute_to_floor=min((s.charged for s in meets), default=None),
        measured_at=datetime.now(UTC).strftime("%Y-%m-%d"),
        machine=f"{platform.machine()} {torch.get_num_threads()} threads, {model.device.type}",
        adapter=key.adapter,
    ).seal()


def measure(
    model,
    bf16_model,
    schedule: BlendSchedule | None = None,
    limit: int | None = None,
    records_path: Path | None = None,
    ladder: tuple[float, ...] = LADDER,
    max_new_tokens: int = MAX_NEW_TOKENS,
    progress: bool = True,
    set_path: Path = CALIBRATION_SET,
    adapter=None,
) -> FidelityReport:
    """Measure (or resume) ``model``'s report on the calibration set; ``limit``: the first N questions.

    Questions whose prompt does not fit the model's context are left out (the report counts those it
    holds). ``set_path``: another calibration set of the same format (the gate trusts only reports of
    the package's own set; another set's report is for reading). ``adapter``: a KV adapter that reuse and
    blend read stored chunk KV through, or a chunk-KV writer (:class:`~ragkv.adapter.writer.WriterLoRA`)
    that writes it; its report is the (model, adapter) pair's, and the points the
    adapter cannot change (bf16 full prefill, exact prefill) are taken from the model's own records
    when it has them."""
    from tqdm.auto import tqdm

    passages, questions = load_calibration_set(set_path)
    questions = questions[:limit] if limit else questions
    points = ladder_points(ladder)
    adapter_id = adapter.identity if adapter is not None else ""
    report_key = ReportKey(model.fingerprint, adapter_id, (schedule or BlendSchedule()).options_key())
    key = {
        "schedule": report_key.schedule,
        "set": calibration_set_digest(set_path),
        "max_new_tokens": max_new_tokens,
    }
    records_path = records_path or cache_path(model.fingerprint, adapter=adapter_id).with_suffix(
        ".records.jsonl"
    )
    records = _read_records(records_path, {**key, "adapter": adapter_id} if adapter_id else key)
    if adapter_id:  # what the adapter cannot change, from the model's own run
        own = cache_path(model.fingerprint).with_suffix(".records.jsonl")
        have = {(r["id"], r["point"]) for r in records}
        records += [
            r
            for r in _read_records(own, key)
            if r["point"] in ("full-bf16", "exact") and (r["id"], r["point"]) not in have
        ]
        key = {**key, "adapter": adapter_id}
    done = {(r["id"], r["point"]) for r in records}
    names = ["full-bf16"] + [p.name for p in points]
    todo = [q for q in questions if not all((q["id"], n) in done for n in names)]
    records = [r for r in records if r["id"] in {q["id"] for q in questions}]
    runner = Measurer(model, bf16_model, schedule, max_new_tokens, adapter)
    records_path.parent.mkdir(parents=True, exist_ok=True)
    with records_path.open("a") as f:
        for q in tqdm(todo, desc="fidelity", unit="question", disable=not progress):
            floor = (q["id"], "full-bf16") not in done
            run = [p for p in points if (q["id"], p.name) not in done]
            for r in runner.question(q, passages, run, floor=floor):
                r["key"] = key
                records.append(r)
                f.write(json.dumps(r) + "\n")
            f.flush()
    report = summarize(model, report_key, records, points, max_new_tokens, key["set"])
    return report  # newest record wins


def _read_records(path: Path, key: dict) -> list[dict]:
    """The records of ``path`` measured under ``key`` (a torn last line is skipped)."""
    out: list[dict] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a torn last line from an interrupted run
            if r.get("key") == key:
                out.append(r)
    return out
