"""eval.bench_fidelity's method grammar and paired summary (the benchmark itself runs the real model)."""

import pytest

from eval.bench_fidelity import DEEP_LAYERS, NOT_IN_PASSAGES, bootstrap_ci, parse_method, summarize
from ragkv.blend import BlendSchedule


def test_method_names_parse_into_schedules_oracles_and_neighbour_conditioning():
    m = parse_method("kdev+off-k+w-one+seam2@0.12")
    assert m.mode == "blend" and m.oracle is None
    assert m.schedule == BlendSchedule.single(
        0.12, selector="kdev", offset="k", offset_weight="one", seam=2, offset_min_probes=1
    )
    assert parse_method("qpass+off-k+minp4@0.12").schedule == BlendSchedule.single(0.12)  # the default
    assert parse_method("kdev@0.15").schedule.offset == "none"  # CacheBlend as the paper has it
    q = parse_method("qpass+deep@0.2")
    assert q.schedule.selector == "qpass" and q.schedule.score_layers == DEEP_LAYERS
    o = parse_method("odev@0.15")
    assert o.oracle == "odev" and o.schedule.target_ratio == 0.15
    assert parse_method("kdev+off-oracle@0.15").offset_oracle
    n = parse_method("nbr3x:kdev@0.15")
    assert (n.neighbours, n.exclude_own, n.schedule.target_ratio) == (3, True, 0.15)
    assert parse_method("default").schedule == BlendSchedule()
    assert parse_method("reuse").mode == "reuse" and parse_method("full").schedule is None
    for bad in ("kdev", "kdev+nope@0.1", "kdev@x"):
        with pytest.raises(ValueError):
            parse_method(bad)


def test_not_in_passages_flags_refusals_only():
    assert NOT_IN_PASSAGES.search("The passages do not mention his birthplace.")
    assert NOT_IN_PASSAGES.search("This information is not provided.")
    assert not NOT_IN_PASSAGES.search("He was born in Exeter.")


def test_bootstrap_interval_brackets_the_mean_and_shrinks_with_more_data():
    lo, hi = bootstrap_ci([0.0, 1.0] * 10)
    lo2, hi2 = bootstrap_ci([0.0, 1.0] * 200)
    assert lo < 0.5 < hi and lo2 < 0.5 < hi2 and (hi2 - lo2) < (hi - lo)
    assert bootstrap_ci([0.3] * 5) == (pytest.approx(0.3), pytest.approx(0.3))


def _rec(method, sample, nll, kl, f1=1.0):
    return {
        "method": method,
        "sample": sample,
        "nll_full_answer": nll,
        "kl": kl,
        "f1_vs_full": f1,
        "same_as_full": f1 == 1.0,
    }


def test_summary_pairs_questions_and_reports_gap_closed_and_kl_over_reuse():
    recs = []
    for s in range(4):
        recs += [
            _rec("full", s, 1.0, 0.0),
            _rec("reuse", s, 2.0, 0.4, 0.5),
            _rec("blend", s, 1.25, 0.1, 0.75),
        ]
    recs.append(_rec("blend", 99, 9.0, 9.0))  # a question full and reuse lack: not paired, left out
    out = summarize(recs, ["full", "reuse", "blend"], baseline="reuse")
    assert out["n_samples"] == 4
    row = out["methods"]["blend"]
    assert row["nll_gap_closed"] == pytest.approx(0.75)
    assert row["kl_over_reuse"] == pytest.approx(0.25)
    assert row["f1_vs_full_minus_reuse"]["mean"] == pytest.approx(0.25)
    assert row["same_as_full"]["mean"] == 0.0


def test_summary_survives_a_question_where_reuse_equals_full():
    # a question with no NLL gap (reuse's answer as likely as full's) must not divide by zero
    recs = [_rec("full", 0, 1.0, 0.0), _rec("reuse", 0, 1.0, 0.0), _rec("blend", 0, 1.0, 0.0)]
    recs += [_rec("full", 1, 1.0, 0.0), _rec("reuse", 1, 2.0, 0.4), _rec("blend", 1, 1.5, 0.2)]
    row = summarize(recs, ["full", "reuse", "blend"], baseline=None)["methods"]["blend"]
    assert row["nll_gap_closed"] == pytest.approx(0.5)
