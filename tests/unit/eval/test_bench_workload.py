"""eval.bench_workload (issue 52's benchmark): the workloads' pieces (Zipf draw, paraphrase rules, burst
windows, chat turns), its figures and table from made-up records, and a ``--quick`` run on the tiny
model end to end (slow)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eval.bench_workload import (
    Rec,
    burst_windows,
    cached_of,
    chat_turns,
    common_prefix,
    first_user_message,
    main,
    paraphrase,
    restart_figures,
    summarize,
    summarize_chat,
    table,
    zipf_draw,
)


def test_zipf_draw_is_seeded_and_favours_low_ranks():
    a = zipf_draw(20, 400, 1.0, seed=3)
    assert a == zipf_draw(20, 400, 1.0, seed=3)
    assert a != zipf_draw(20, 400, 1.0, seed=4)
    assert len(a) == 400 and set(a) <= set(range(20))
    counts = Counter(a).most_common()
    # the most drawn item is drawn far more than the median one; a larger s concentrates more
    assert counts[0][1] > 4 * sorted(c for _, c in counts)[len(counts) // 2]
    top = lambda s: Counter(zipf_draw(20, 400, s, seed=3)).most_common(1)[0][1]  # noqa: E731
    assert top(1.2) > top(0.8)
    assert zipf_draw(1, 5, 1.0) == [0] * 5
    with pytest.raises(ValueError):
        zipf_draw(0, 5, 1.0)


@pytest.mark.parametrize(
    "question",
    [
        "Who is the father of the director of film Wilhelm Tell?",
        "When did the performer of Ice Ice Baby die?",
        "Where was the author of Hannibal and Scipio educated at?",
        "Are both films from the same country?",
        "zzz",
    ],
)
def test_paraphrases_change_the_words_and_are_deterministic(question):
    assert paraphrase(question, 0) == question
    for k in range(1, 10):
        p = paraphrase(question, k)
        assert p != question and p.strip() and p == paraphrase(question, k)


def test_paraphrase_rules_hand_checked():
    q = "Who is the father of the director of film Wilhelm Tell?"
    assert paraphrase(q, 1) == "Tell me who is the father of the director of film Wilhelm Tell?"
    assert paraphrase(q, 2) == "Who is the dad of the filmmaker of movie Wilhelm Tell?"
    assert paraphrase(q, 3) == "Regarding the director of film Wilhelm Tell, who is the father?"
    assert paraphrase(q, 4) == f"Could you tell me: {q}"
    assert paraphrase("What is X?", 1) == "Tell me what is X?"


def test_burst_windows_overlap_in_shifted_order():
    w = burst_windows(9, 6, 4)
    assert w == [list(range(j, j + 6)) for j in range(4)]
    for a, b in zip(w, w[1:], strict=False):
        assert len(set(a) & set(b)) == 5  # k - 1 passages shared
        assert b.index(a[1]) == a.index(a[1]) - 1  # each one place earlier
    assert burst_windows(3, 6, 4) == [[0, 1, 2], [1, 2], [2], [2]]  # too few ranks: shorter, never empty
    with pytest.raises(ValueError):
        burst_windows(3, 0, 2)


def test_chat_turns_cover_one_to_five():
    assert [chat_turns(c) for c in range(6)] == [5, 1, 2, 3, 4, 5]
    m = first_user_message(["A\ntext a ", "B\ntext b"], "Who?")
    assert m == "Context:\nA\ntext a\n\nB\ntext b\n\nQuestion: Who?"
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


def test_cached_tokens_prefer_the_exact_count_then_rows_then_usage():
    assert cached_of({"cached_tokens": 7, "num_exact_rows": 3}) == (7, "stats.cached_tokens")
    assert cached_of({"num_exact_rows": 3, "num_reused_rows": 2}) == (5, "stats.rows")
    assert cached_of({}, 4) == (4, "usage.cached_tokens")
    assert cached_of(None) == (None, None)


def _rec(arm, i, ttft, rep=0, cached=0, prompt=100, ids=(1, 2), text="x", turn=None, prev=None):
    return Rec("w", arm, i, rep, ttft, prompt, cached, "stats.rows", list(ids), text, turn, prev)


def test_summary_figures_from_made_up_records():
    recs = []
    for rep in range(3):
        for i in range(4):
            recs.append(_rec("full", i, 1.0 + 0.01 * rep, rep, cached=0))
            recs.append(_rec("default", i, 0.25 + 0.01 * rep, rep, cached=90, ids=(1, 2) if i else (9,)))
            recs.append(_rec("llamacpp", i, 0.5, rep, cached=50, text="x" if i < 2 else "y"))
    s = summarize(recs)
    assert s["n_requests"] == 4
    assert s["default_ttft_p50_s"] == pytest.approx(0.26) and s["full_ttft_p50_s"] == pytest.approx(1.01)
    assert s["speedup_vs_full_median"] == pytest.approx(1.01 / 0.26)
    assert s["default_over_llamacpp_p50"] == pytest.approx(0.26 / 0.5)
    assert s["default_hit_rate"] == pytest.approx(0.9) and s["full_hit_rate"] == 0.0
    assert s["llamacpp_hit_rate"] == pytest.approx(0.5)
    assert s["default_same_answer_as_full"] == pytest.approx(0.75)  # request 0's ids differ
    assert s["llamacpp_same_answer_as_full"] == pytest.approx(0.5)
    # no llama.cpp records: its figures are null, not an error
    s2 = summarize([r for r in recs if r.arm != "llamacpp"])
    assert s2["llamacpp_ttft_p50_s"] is None and s2["speedup_vs_llamacpp_median"] is None


def test_chat_summary_per_turn_and_restart_figures():
    recs = []
    for c in range(2):
        prev = None
        for t in range(1, 4):
            prompt = 100 * t
            recs.append(_rec("full", c, 1.0, cached=0, prompt=prompt, turn=t, prev=prev))
            cached = 0 if t == 1 else prev
            recs.append(
                _rec("default", c, 1.0 if t == 1 else 0.1, cached=cached, prompt=prompt, turn=t, prev=prev)
            )
            prev = prompt
    s = summarize_chat(recs)
    turns = {row["turn"]: row for row in s["per_turn"]}
    assert set(turns) == {1, 2, 3} and turns[1]["cached_over_prev_prompt"] is None
    assert turns[2]["cached_over_prev_prompt"] == 1.0 and turns[3]["cached_share"] == pytest.approx(2 / 3)
    assert s["turn2plus"]["speedup_vs_full_median"] == pytest.approx(10.0)
    r = _rec("default", 0, 0.1, cached=90, prompt=100)
    r.extra["reference_text"] = "x"
    f = restart_figures([r, _rec("default", 1, 0.1, cached=0, prompt=100)])
    assert f["cached_share"] == pytest.approx(0.45) and f["cached_share_min"] == 0.0
    assert f["same_answer_as_first_time"] == 1.0
    text = table({"chat": {**s, "rss_bytes": 1e9, "disk_bytes": 2e6}, "two-process": {"skipped": "no redis"}})
    assert "turn 2" in text and "skipped: no redis" in text and "chat" in text


def test_unknown_workload_is_refused():
    with pytest.raises(SystemExit, match="unknown workload"):
        main(["--workloads", "natural,nope", "--no-llamacpp"])


@pytest.mark.slow
def test_quick_run_on_the_tiny_model_ends_with_one_json_line(tmp_path, capsys):
    """Every workload once on the tiny model (~2-3 minutes on 2 busy cores: a service, a restart, two
    services on a Redis store when redis-server is installed), one JSON line of every figure at the end."""
    out = tmp_path / "out"
    argv = ["--quick", "--model", "tiny", "--no-llamacpp", "--out", str(out), "--work-dir", str(tmp_path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["bench"] == "workload" and res["llamacpp_skipped"] == "--no-llamacpp"
    w = res["workloads"]
    assert set(w) == {
        "natural",
        "zipf-0.8",
        "zipf-1",
        "zipf-1.2",
        "bursts",
        "chat",
        "zipf-1-service",
        "restart",
        "two-process",
    }
    for name in ("natural", "zipf-1", "bursts", "chat", "zipf-1-service", "restart"):
        f = w[name]
        assert f["n_requests"] >= 1 and f["default_ttft_p50_s"] > 0 and f["full_ttft_p50_s"] > 0, name
        assert f["default_hit_rate"] is not None and f["llamacpp_ttft_p50_s"] is None
        assert f["default_same_answer_as_full"] is not None
    assert w["zipf-1"]["n_requests"] == 4 and w["chat"]["per_turn"][0]["turn"] == 1
    assert (out / "results.json").is_file() and (out / "ttft_chat_per_turn.png").stat().st_size > 0
    assert (out / "ttft_natural.png").stat().st_size > 0
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in recs} == {"default", "full"} and {r["workload"] for r in recs} >= {
        "natural",
        "chat",
    }
    assert "two-process" in w and ("skipped" in w["two-process"] or "cached_share" in w["two-process"])
