"""The fidelity gate: reports are verified before they are trusted, targets pick the right operating
point, every fallback is said, and the surfaces report the point they ran at."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from ragkv import LLM, SamplingParams
from ragkv.fidelity import GATE, ReportKey, choose, parse_fidelity
from ragkv.fidelity.measure import Point, load_calibration_set, measure, monotone_violations, summarize
from ragkv.fidelity.plan import RequestSettings
from ragkv.fidelity.report import (
    CALIBRATION_SET,
    SHIPPED_DIR,
    FidelityReport,
    ReportError,
    cache_path,
    calibration_set_digest,
    check_report,
    load_report,
    report_id,
    save_report,
)
from ragkv.kv.chunk import CHUNK_CONVENTION_VERSION
from ragkv.testing import fidelity_ladder
from ragkv.testing import fidelity_point as _point
from ragkv.testing import fidelity_report as _report
from tests.helpers import stories_model

QUESTION = "What did Lily hold?"
CHUNKS = ["Lily had a red ball. She liked to play with it.", "Tom ran in the park with his dog."]
LADDER = fidelity_ladder()


@pytest.mark.parametrize(
    "value,canon",
    [
        (None, "floor"),
        ("floor", "floor"),
        ("EXACT", "exact"),
        ("fast", "fast"),
        ("fast:3", "fast:3"),
        (0.9, "0.9"),
        ("0.85", "0.85"),
    ],
)
def test_fidelity_settings_are_canonical(value, canon):
    assert parse_fidelity(value) == canon


@pytest.mark.parametrize("bad", ["fastest", "fast:0.5", "fast:x", 0.0, 1.5, -1, True, "", "0"])
def test_fidelity_settings_outside_the_allowed_set_are_refused(bad):
    with pytest.raises(ValueError, match="fidelity"):
        parse_fidelity(bad)


def test_floor_takes_the_cheapest_point_whose_ladder_above_meets_the_noise_floor():
    m = stories_model()
    op = choose(_report(m, LADDER), "floor")
    # 0.5 meets the floor alone but 0.7 under it does not: the first trusted point is 0.8
    assert (op.point, op.mode, op.ratio, op.source) == ("blend@0.8", "blend", 0.8, "report")
    assert op.noise_floor_same == 0.8 and op.changed_answers == "7 of 40" and not op.outside_gate


def test_floor_falls_back_to_exact_when_the_faithful_blend_costs_as_much():
    m = stories_model()
    ladder = [p for p in LADDER if p.name != "blend@0.8"]  # only 0.9 meets, at more than exact's compute
    op = choose(_report(m, ladder), "floor")
    assert (op.point, op.mode, op.source) == ("exact", "prefix", "report")


def test_floor_also_needs_gold_recall_within_the_slack():
    m = stories_model()
    ladder = [dataclasses.replace(p, recall=0.45) if p.mode == "blend" else p for p in LADDER]
    op = choose(_report(m, ladder, full_recall=0.5), "floor")
    assert op.point == "exact" and op.source == "not-met"


def test_fast_and_numeric_targets():
    m = stories_model()
    rep = _report(m, LADDER)
    fast = choose(rep, "fast")
    assert fast.point == "blend@0.3" and fast.speedup >= 2.5  # the most faithful point at >= 2.5x
    assert choose(rep, "fast:6").source == "not-met"
    assert choose(rep, "0.3").point == "blend@0.3"  # every point above 0.3 keeps >= 30%
    assert choose(rep, "0.95").point == "exact"
    assert choose(rep, "exact").mode == "prefix"


def test_no_report_falls_back_to_exact_and_says_so_once(fidelity_cache, caplog):
    m = stories_model()
    caplog.set_level(logging.WARNING, "ragkv.fidelity")
    llm = LLM(m)
    a = llm.generate("", CHUNKS, QUESTION, max_new_tokens=3)
    b = llm.generate("", CHUNKS, QUESTION, max_new_tokens=3)
    assert a.stats["mode"] == b.stats["mode"] == "prefix"
    assert a.stats["fidelity"]["source"] == "no-report" and a.stats["fidelity"]["point"] == "exact"
    said = [r for r in caplog.records if "falls back to exact prefill" in r.getMessage()]
    assert len(said) == 1 and "ragkv calibrate" in said[0].getMessage()


def test_the_gates_point_runs_and_an_explicit_ratio_is_outside_the_gate(fidelity_cache):
    m = stories_model()
    save_report(_report(m, LADDER), cache_path(m.fingerprint))
    llm = LLM(m)
    a = llm.generate("", CHUNKS, QUESTION, max_new_tokens=3)
    assert a.stats["mode"] == "blend" and a.stats["ratio"] == 0.8
    assert a.stats["fidelity"]["point"] == "blend@0.8" and not a.stats["fidelity"]["outside_gate"]
    b = llm.generate("", CHUNKS, QUESTION, ratio=0.3, max_new_tokens=3)
    assert b.stats["ratio"] == 0.3 and b.stats["fidelity"]["outside_gate"]
    c = llm.generate("", CHUNKS, QUESTION, fidelity="exact", max_new_tokens=3)
    assert c.stats["mode"] == "prefix" and c.stats["fidelity"]["target"] == "exact"
    assert LLM(m, fidelity="fast").operating_point().point == "blend@0.3"
    with pytest.raises(ValueError, match="fidelity"):
        llm.generate("", CHUNKS, QUESTION, fidelity="bogus")


def test_the_exact_fallback_equals_full_prefill(fidelity_cache):
    """The gate's fallback is exact: the same greedy tokens and logits (fp32) as a full prefill."""
    m = stories_model()
    llm = LLM(m)
    for _ in range(2):  # the second run reuses the cached instruction prefix
        gated = llm.prefill("Read this.", CHUNKS, QUESTION, mode="blend")
        full = llm.prefill("Read this.", CHUNKS, QUESTION, mode="full")
        assert gated.stats["mode"] == "prefix"
        torch.testing.assert_close(gated.logits, full.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change",
    [
        ("fingerprint", "0" * 64),
        ("convention", CHUNK_CONVENTION_VERSION + 1),
        ("schedule", "BlendSchedule(selector='kdev')"),
        ("calibration_set", "f" * 64),
        ("version", 0),
    ],
)
def test_a_report_of_another_model_convention_schedule_or_set_is_not_trusted(fidelity_cache, change, caplog):
    m = stories_model()
    rep = _report(m, LADDER)
    setattr(rep, *change)
    save_report(rep, cache_path(m.fingerprint))  # sealed: only the content disagrees
    caplog.set_level(logging.WARNING, "ragkv.fidelity")
    assert load_report(ReportKey(m.fingerprint)) is None
    assert any("ignoring fidelity report" in r.getMessage() for r in caplog.records)
    assert choose(None, "floor").source == "no-report"


def test_a_hand_edited_or_corrupt_report_is_not_trusted(fidelity_cache):
    m = stories_model()
    path = cache_path(m.fingerprint)
    save_report(_report(m, LADDER), path)
    assert load_report(ReportKey(m.fingerprint)) is not None
    doc = json.loads(path.read_text())
    doc["points"][3]["same"] = 0.99  # a better-looking point, digest left as it was
    path.write_text(json.dumps(doc))
    with pytest.raises(ReportError, match="digest"):
        FidelityReport.from_json(path.read_text())
    assert load_report(ReportKey(m.fingerprint)) is None
    path.write_text(path.read_text()[:100])  # truncated
    assert load_report(ReportKey(m.fingerprint)) is None
    path.write_bytes(b"\xff\xfe not json")
    assert load_report(ReportKey(m.fingerprint)) is None


def test_monotonicity_defects_are_reported():
    ok = [_point("blend@0.3", 0.3, 0.4, 2.0), _point("blend@0.5", 0.5, 0.6, 1.5)]
    assert monotone_violations(ok) == []
    drop = [_point("blend@0.3", 0.6, 0.4, 2.0), _point("blend@0.5", 0.2, 0.6, 1.5)]  # 0.5's CI tops at 0.3
    assert monotone_violations(drop) and "blend@0.5" in monotone_violations(drop)[0]


def test_the_shipped_calibration_set_is_large_disjoint_and_deterministic():
    from eval.make_fidelity_set import build

    passages, questions = load_calibration_set()
    assert len(questions) >= 48 and {q["split"] for q in questions} == {"short", "long"}
    assert all(q["gold_passage"] in q["passages"] for q in questions)
    assert all(any(q["answers"][0] in passages[p] for p in q["passages"]) for q in questions)
    demo = (CALIBRATION_SET.parents[1] / "demo" / "corpus.json").read_text().lower()
    assert not any(p.lower()[:40] in demo for p in passages.values())
    data = json.loads(CALIBRATION_SET.read_text())
    assert build(data["seed"], **data["shape"]) == data  # what the package ships is what the script writes


def test_shipped_reports_verify():
    """Every report the package ships parses, verifies its digest and is of this convention and set."""
    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert files, "the default model's report ships with the package"
    for f in files:
        rep = FidelityReport.from_json(f.read_text())
        assert rep.convention == CHUNK_CONVENTION_VERSION and rep.calibration_set == calibration_set_digest()
        assert rep.n_questions >= 48 and f.stem == report_id(rep.fingerprint, rep.adapter)
        # the key the gate looks it up by (the default blend options) is the one it was measured for
        check_report(rep, ReportKey(rep.fingerprint, rep.adapter), rep.calibration_set)


def test_a_reports_key_holds_the_blend_options_without_the_ratio():
    """A report's ladder varies the ratio alone: a schedule at another ratio is the same report, one
    with other options (a selector) another; the key's default is the default schedule's."""
    from ragkv.blend.core import BlendSchedule

    default = ReportKey("f" * 64)
    assert default.schedule == BlendSchedule().options_key() == BlendSchedule.single(0.7).options_key()
    assert BlendSchedule.single(0.3, selector="kdev").options_key() != default.schedule
    assert "ratios=(1.0,)" in default.schedule


def test_measure_resumes_and_reports_every_point(fidelity_cache, tmp_path):
    """A small calibration run on the tiny model: exact prefill is exact, reuse is cheapest, records resume."""
    from ragkv.model import load_model
    from tests.helpers import stories_path

    m, bf16 = stories_model(), load_model(stories_path(), dtype="bfloat16")
    passages = {
        f"p{i}": f"Lily had a {c} ball and a {a} cat."
        for i, (c, a) in enumerate([("red", "big"), ("blue", "small"), ("green", "fat"), ("pink", "shy")])
    }
    qs = [
        {
            "id": f"q{i}",
            "split": "short",
            "question": "What color was the ball?",
            "answers": ["red"],
            "passages": [f"p{(i + j) % 4}" for j in range(3)],
            "gold_passage": "p0",
        }
        for i in range(3)
    ]
    set_path = tmp_path / "set.json"
    set_path.write_text(
        json.dumps({"passages": [{"id": k, "text": v} for k, v in passages.items()], "questions": qs})
    )
    records = tmp_path / "records.jsonl"
    kw = dict(
        limit=None, records_path=records, ladder=(0.5,), max_new_tokens=4, progress=False, set_path=set_path
    )
    rep = measure(m, bf16, **kw)
    assert rep.n_questions == 3 and [p.name for p in rep.points] == ["exact", "reuse", "blend@0.5"]
    exact, reuse, half = rep.points
    assert exact.same == 1.0 and exact.kl < 1e-6
    assert reuse.charged < half.charged < 1.0
    assert 0.0 <= rep.floor.same <= 1.0 and rep.calibration_set == calibration_set_digest(set_path)
    lines = records.read_text().splitlines()
    again = measure(m, bf16, **kw)  # nothing left to measure: the same report from the records
    assert records.read_text().splitlines() == lines and again.points == rep.points
    by_id = {}
    for line in lines:
        r = json.loads(line)
        by_id.setdefault(r["id"], set()).add(r["point"])
    assert all(v == {"full-bf16", "exact", "reuse", "blend@0.5"} for v in by_id.values())
    rebuilt = summarize(
        m,
        ReportKey(m.fingerprint),
        [json.loads(x) for x in lines],
        [Point("exact", "prefix"), Point("reuse", "reuse", 0.0), Point("blend@0.5", "blend", 0.5)],
        4,
        rep.calibration_set,
    )
    assert rebuilt.points == rep.points


def test_prefill_refuses_nothing_new_for_plain_modes(fidelity_cache):
    """full / reuse keep running as asked (explicit), with the fidelity entry saying so."""
    m = stories_model()
    llm = LLM(m)
    for mode in ("full", "reuse"):
        res = llm.prefill("", CHUNKS, QUESTION, mode=mode)
        assert res.stats["mode"] == mode and res.stats["fidelity"]["source"] == "explicit"


def test_the_engine_runs_blend_at_the_gates_point(fidelity_cache):
    """``EngineConfig`` with no ratio: blend requests take the gate's point (no report here: exact),
    with the point in the prefill stats; a per-request ratio is explicit; bad settings are refused."""
    from ragkv.engine import Engine, EngineConfig

    m = stories_model()
    pre, chs, q = LLM(m).tokenize_prompt("", CHUNKS, QUESTION)
    with Engine(m, EngineConfig(num_blocks=200)) as eng:
        gated = eng.submit(pre, chs, q, SamplingParams(max_new_tokens=2), mode="blend").result()
        explicit = eng.submit(pre, chs, q, SamplingParams(max_new_tokens=2), mode="blend", ratio=0.5).result()
    assert (
        gated.prefill_stats["mode"] == "prefix" and gated.prefill_stats["fidelity"]["source"] == "no-report"
    )
    assert explicit.prefill_stats["mode"] == "blend" and explicit.prefill_stats["fidelity"]["outside_gate"]
    save_report(_report(m, LADDER), cache_path(m.fingerprint))
    GATE.forget()
    with Engine(m, EngineConfig(num_blocks=200, settings=RequestSettings(fidelity="fast"))) as eng:
        fast = eng.submit(pre, chs, q, SamplingParams(max_new_tokens=2)).result()
    assert fast.prefill_stats["ratio"] == 0.3 and fast.prefill_stats["fidelity"]["point"] == "blend@0.3"
    with pytest.raises(ValueError, match="fidelity"):
        EngineConfig(settings=RequestSettings(fidelity="often"))


def _tiny_calibration_set(tmp_path):
    """Two questions over three passages the tiny model can read, as a calibration-set file."""
    passages = {
        f"p{i}": f"Tom saw a {c} bird near the {p}."
        for i, (c, p) in enumerate([("red", "pond"), ("blue", "tree"), ("grey", "house")])
    }
    qs = [
        {
            "id": f"q{i}",
            "split": "short",
            "question": "What did Tom see?",
            "answers": ["bird"],
            "passages": ["p0", "p1", "p2"][i:] + ["p0", "p1", "p2"][:i],
            "gold_passage": "p0",
        }
        for i in range(2)
    ]
    set_path = tmp_path / "set.json"
    set_path.write_text(
        json.dumps({"passages": [{"id": k, "text": v} for k, v in passages.items()], "questions": qs})
    )
    return set_path


def test_a_kv_adapter_gets_its_own_report_reusing_what_it_cannot_change(fidelity_cache, tmp_path):
    """``measure(adapter=...)``: the pair's report; bf16 and exact come from the model's own records;
    each report is found under its own (model, adapter) key and never for the other."""
    from ragkv.adapter.kv_adapter import KVAdapter
    from ragkv.fidelity.report import cache_path, load_report, save_report
    from ragkv.model import load_model
    from tests.helpers import stories_path

    m, bf16 = stories_model(), load_model(stories_path(), dtype="bfloat16")
    set_path = _tiny_calibration_set(tmp_path)
    kw = dict(limit=None, ladder=(0.5,), max_new_tokens=4, progress=False, set_path=set_path)
    base = measure(m, bf16, **kw)
    ad = KVAdapter.for_model(m, rank=2)  # untrained: reads the stored KV unchanged
    rep = measure(m, bf16, adapter=ad, **kw)
    assert rep.adapter == ad.identity and base.adapter == ""
    own = cache_path(m.fingerprint, adapter=ad.identity).with_suffix(".records.jsonl")
    points = {json.loads(line)["point"] for line in own.read_text().splitlines()}
    assert points == {"reuse", "blend@0.5"}  # bf16 and exact were not measured again
    assert rep.floor == base.floor and rep.point("exact") == base.point("exact")
    assert (
        rep.point("reuse").same == base.point("reuse").same
        and rep.point("reuse").kl == base.point("reuse").kl
    )
    key, pair = (
        ReportKey(m.fingerprint, "", base.schedule),
        ReportKey(m.fingerprint, ad.identity, base.schedule),
    )
    save_report(base, cache_path(m.fingerprint))
    save_report(rep, cache_path(m.fingerprint, adapter=ad.identity))
    # the shipped calibration set is what load_report trusts; these were measured on a test set
    assert load_report(key) is None
    assert load_report(pair) is None
    from ragkv.fidelity.report import FidelityReport, ReportError, check_report

    both = FidelityReport.from_json(cache_path(m.fingerprint, adapter=ad.identity).read_text())
    check_report(both, pair, rep.calibration_set)
    with pytest.raises(ReportError, match="KV adapter"):
        check_report(both, key, rep.calibration_set)
    with pytest.raises(ReportError, match="KV adapter"):
        check_report(base, pair, base.calibration_set)


def test_a_chunk_kv_writer_gets_its_own_report_with_the_kv_it_writes(fidelity_cache, tmp_path):
    """``measure(adapter=writer)``: reuse and blend read the KV the writer writes (an untrained writer
    writes today's KV, so its reuse point is the model's; a trained one moves it), under its own key."""
    from ragkv.adapter.writer import WriterLoRA
    from ragkv.fidelity.report import cache_path
    from ragkv.model import load_model
    from tests.helpers import stories_path

    m, bf16 = stories_model(), load_model(stories_path(), dtype="bfloat16")
    kw = dict(
        limit=None, ladder=(0.5,), max_new_tokens=4, progress=False, set_path=_tiny_calibration_set(tmp_path)
    )
    base = measure(m, bf16, **kw)
    idle = WriterLoRA.for_model(m, rank=2).requires_grad_(False)
    rep = measure(m, bf16, adapter=idle, **kw)
    assert rep.adapter == idle.identity and rep.point("reuse").kl == base.point("reuse").kl
    moved = WriterLoRA.for_model(m, rank=2, seed=3)
    with torch.no_grad():
        moved.b_qkv.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    moved.requires_grad_(False)
    rep2 = measure(m, bf16, adapter=moved, **kw)
    assert rep2.point("reuse").kl != base.point("reuse").kl
    own = cache_path(m.fingerprint, adapter=moved.identity).with_suffix(".records.jsonl")
    assert {json.loads(line)["point"] for line in own.read_text().splitlines()} == {"reuse", "blend@0.5"}
