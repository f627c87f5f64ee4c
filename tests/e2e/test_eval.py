"""eval.run end to end on the shared model, answer scoring, prompt fitting, resume, bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.fit import FitError, PassageFitter, contains_gold, find_gold, select_passages
from eval.prompts import ChatFrame, PromptBuilder, chat_frame, get_spec, load_samples, normalize_question
from eval.run import main
from eval.scoring import parse_generation, score_answer
from tests.helpers import musique_samples, stories_model

# one torch thread: on the shared 2-core machine, tiny matmuls under contention are far slower with two
SMALL = [
    "--model",
    "tiny",  # the repository's stories260k: fast (the default is the real model)
    "--num-chunks",
    "3",
    "--chunk-tokens",
    "32",
    "--max-new-tokens",
    "4",
    "--no-progress",
    "--threads",
    "1",
]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """The first four MuSiQue samples (so --retrieval indexes 40 passages, not 1,255)."""
    rows = musique_samples(4)
    p = tmp_path_factory.mktemp("data") / "musique4.json"
    p.write_text(json.dumps(rows))
    return p


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ---- scoring (hand-checked) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "output,golds,f1,em",
    [
        ("The Exeter College.", ["Exeter College"], 1.0, 1.0),  # article + punctuation dropped
        ("Exeter College, Oxford", ["Exeter College"], 0.8, 0.0),  # P 2/3, R 1
        ("an apple", ["Apple Inc."], 2 * 0.5 / 1.5, 0.0),  # "apple" vs "apple inc": P 1, R 1/2
        ("Charles County", ["Prince George's County", "Charles County"], 1.0, 1.0),  # max over golds
        ("1912", [["April 1912", "1912"], ["1913"]], 1.0, 1.0),  # 2Wiki list of lists
        ("april", [["April 1912"], ["May"]], 2 / 3, 0.0),
        ("", ["Exeter College"], 0.0, 0.0),  # empty output
        ("\n\n", ["Paris"], 0.0, 0.0),
        ("\nParis\nThe capital of France is Paris.", ["Paris"], 1.0, 1.0),  # first line only
        ("Yes, it is.", ["yes"], 1.0, 1.0),
        ("Norway", ["Norway"], 1.0, 1.0),  # the reference's startswith("No") bug is not copied
    ],
)
def test_score_answer_hand_checked(output, golds, f1, em):
    got_f1, got_em = score_answer(output, golds)
    assert got_f1 == pytest.approx(f1)
    assert got_em == em


def test_parse_generation_and_question_normalisation():
    assert parse_generation("no.") == "No"
    assert parse_generation("Nobel Prize") == "Nobel Prize"
    assert normalize_question("Who wrote Hamlet") == "who wrote Hamlet?"


# ---- prompts and fitting ---------------------------------------------------------------------------
def test_chat_template_head_goes_to_prefix_and_tail_to_suffix():
    model = stories_model()
    assert chat_frame(model.tokenizer) == ChatFrame()  # stories260k has no template
    import copy

    tok = copy.deepcopy(model.tokenizer)
    tok.chat_template = MISTRAL_TEMPLATE
    frame = chat_frame(tok)
    assert frame == ChatFrame("[INST] ", " [/INST]")
    assert chat_frame(tok, use_template=False) == ChatFrame()
    spec = get_spec("musique")
    b = PromptBuilder(model, frame, spec.prefix, spec.query)
    p = b.build("Who is it?", ["\n\nsome passage text\n\n"])
    assert p.prefix[0] == model.config.bos_token_id
    assert model.decode(p.prefix[1:]).startswith("[INST] You will be asked")
    assert model.decode(p.suffix).rstrip().endswith("Question:who is it?\nAnswer: [/INST]")
    assert model.decode(p.chunks[0]).strip() == "some passage text"


def test_fit_prefers_gold_passages_and_keeps_the_answer_in_the_cut():
    model = stories_model()
    texts = [
        "alpha beta gamma " * 30,
        "the river flows " * 20 + "exeter college is old " + "more words " * 40,
    ]
    golds = ["Exeter College"]
    assert select_passages(texts, golds, 1) == [1]
    assert select_passages(texts, golds, 1, prefer_gold=False) == [0]
    assert contains_gold(texts[1], golds) and not contains_gold(texts[0], golds)
    fitter = PassageFitter(model.encode, 40)
    cut = fitter.cut("", texts[1], golds)
    assert cut.cut and cut.gold_kept and len(cut.ids) <= 40
    assert "exeter college" in model.decode(cut.ids)
    assert find_gold("The Exeter, College".split(), golds) == (1, 3)
    with pytest.raises(FitError):
        PassageFitter(model.encode, 2)


def test_data_files_load_with_both_gold_formats():
    mus = load_samples(get_spec("musique"))
    wiki = load_samples(get_spec("2wikimqa"))
    assert len(mus) == 150 and len(wiki) == 102
    assert isinstance(mus[0].answers[0], str) and isinstance(wiki[0].answers[0], list)
    assert all(len(s.texts) == 10 for s in mus[:5])


# ---- end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_end_to_end_every_mode_every_file_and_retrieval(tmp_path, small_data, capsys):
    out = tmp_path / "run"
    modes = "full,prefix,reuse,blend,mapreduce,maprerank"
    argv = ["--dataset", "musique", "--data", str(small_data), "--limit", "2", "--modes", modes]
    argv += ["--ratios", "0.15,0.3", "--out", str(out), "--retrieval", "--summary-json", "--attn-dev", *SMALL]
    assert main(argv) == 0
    summary = _summary(capsys)
    for name in (
        "records.jsonl",
        "results.json",
        "results.md",
        "quality_vs_ttft.png",
        "quality_vs_ratio.png",
    ):
        assert (out / name).stat().st_size > 0, name
    recs = _records(out)
    labels = {"full", "prefix", "reuse", "blend@0.15", "blend@0.3", "mapreduce", "maprerank"}
    assert {r["label"] for r in recs} == labels and len(recs) == 2 * len(labels)
    for key in (
        "blend_kl",
        "blend@0.15_kl",
        "blend@0.3_kl",
        "reuse_kl",
        "prefix_kl",
        "blend_first_token_agreement",
        "full_f1",
        "full_ttft_median_s",
        "mapreduce_ttft_median_s",
        "maprerank_f1",
        "retrieval_gold_hit_rate",
        "blend_attn_dev",
        "blend_recall",
    ):
        assert key in summary, key
    assert summary["blend_kl"] == summary["blend@0.15_kl"]
    assert summary["full_kl"] == 0.0 and summary["full_first_token_agreement"] == 1.0
    assert summary["prefix_kl"] < 1e-4  # exact prefix caching equals full prefill up to rounding
    # CacheBlend's point: recomputing some rows brings the output closer to full prefill than reuse,
    # and recomputing more brings it closer still
    assert summary["blend@0.3_kl"] <= summary["blend@0.15_kl"] < summary["reuse_kl"]
    assert 0.0 <= summary["retrieval_original_recall"] <= 1.0
    res = json.loads((out / "results.json").read_text())
    assert res["n_samples"] == 2 and not res["partial"] and len(res["records"]) == len(recs)
    assert "| musique | blend@0.15 |" in (out / "results.md").read_text()
    for r in recs:
        assert r["ttft_s"] > 0 and 0.0 <= r["f1"] <= 1.0


def test_resume_skips_finished_samples_and_reproduces_numbers(tmp_path, small_data, capsys):
    base = [
        "--dataset",
        "musique",
        "--data",
        str(small_data),
        "--modes",
        "full,reuse,blend",
        "--no-plots",
        *SMALL,
    ]
    out = tmp_path / "resumed"
    assert main([*base, "--limit", "1", "--out", str(out)]) == 0
    first = _records(out)
    assert {r["sample"] for r in first} == {0}
    assert main([*base, "--limit", "2", "--out", str(out)]) == 0  # the "interrupted" run continues
    second = _records(out)
    assert second[: len(first)] == first  # finished records untouched (same finished_at stamps)
    assert len(second) == 2 * len(first) and {r["sample"] for r in second[len(first) :]} == {1}
    res = json.loads((out / "results.json").read_text())
    assert res["records_written_this_run"] == len(first)
    # a fresh run with the same arguments gives the same numbers (timings aside)
    fresh = tmp_path / "fresh"
    assert main([*base, "--limit", "2", "--out", str(fresh)]) == 0
    keep = ("label", "sample", "output", "f1", "kl", "first_token", "attn_dev", "recompute_fraction")
    assert [{k: r.get(k) for k in keep} for r in _records(fresh)] == [
        {k: r.get(k) for k in keep} for r in second
    ]
    # other settings in the same folder are refused rather than mixed
    with pytest.raises(SystemExit) as e:
        main([*base, "--chunk-tokens", "24", "--limit", "1", "--out", str(out)])
    assert e.value.code == 2
    assert "another configuration" in capsys.readouterr().err


def test_default_mode_runs_the_llm_with_no_mode_or_ratio(tmp_path, small_data, capsys):
    """``default`` is what a user gets (``LLM.prefill`` with no mode and no ratio: the fidelity gate's
    point; the tiny model has no fidelity report, so exact prefill), recorded beside full with the point
    it ran; it is among the default modes, so the evaluation measures it unless told otherwise."""
    from eval.run import DEFAULT_MODE, build_parser

    assert DEFAULT_MODE in build_parser().parse_args(["--dataset", "musique"]).modes.split(",")
    out = tmp_path / "run"
    argv = ["--dataset", "musique", "--data", str(small_data), "--limit", "1", "--modes", "full,default"]
    assert main([*argv, "--no-plots", "--summary-json", "--out", str(out), *SMALL]) == 0
    summary = _summary(capsys)
    recs = {r["label"]: r for r in _records(out)}
    assert set(recs) == {"full", "default"}
    d = recs["default"]
    assert d["mode"] == "default" and d["ratio"] is None and d["fidelity"]
    assert d["mode_run"] in ("full", "prefix", "reuse", "blend")
    assert d["kl"] < 1e-4 and d["first_token_agreement"] == 1.0  # exact prefill: full's logits up to rounding
    assert d["same_as_full"] == 1.0 and recs["full"]["same_as_full"] == 1.0
    assert summary["default_n"] == 1 and summary["default_ttft_median_s"] > 0
    assert "default_same_as_full" in summary


def test_truncated_record_line_is_ignored_on_resume(tmp_path, small_data):
    base = ["--dataset", "musique", "--data", str(small_data), "--modes", "full,reuse", "--no-plots", *SMALL]
    out = tmp_path / "run"
    assert main([*base, "--limit", "1", "--out", str(out)]) == 0
    path = out / "records.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # killed mid-write
    assert main([*base, "--limit", "1", "--out", str(out)]) == 0
    recs = _records(out)
    assert [r["label"] for r in recs] == ["full", "reuse"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--dataset", "nope"], "unknown dataset 'nope'"),
        (["--dataset", "musique", "--modes", "full,turbo"], "unknown mode(s) ['turbo']"),
        (["--dataset", "musique", "--ratios", "0.1,x"], "bad ratio list"),
        (["--dataset", "musique", "--ratios", "1.5"], "must be in [0, 1]"),
        (["--dataset", "musique", "--data", "/nonexistent/file.json"], "not found"),
        (
            [
                "--dataset",
                "musique",
                "--model",
                "tiny",
                "--limit",
                "1",
                "--num-chunks",
                "10",
                "--threads",
                "1",
            ],
            "lower --num-chunks",
        ),
    ],
)
def test_bad_arguments_give_clear_errors(extra, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*extra, "--out", str(tmp_path / "x"), "--no-progress"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
