"""The soak (issue 54) at its short size: the service under three clients and every fault kind for a
few minutes on the tiny model, then the same checks as the hour-long run (``python -m eval.soak``)."""

from __future__ import annotations

import json

import pytest

from eval import soak
from eval.soak_check import check_answers, check_errors
from eval.soak_clients import Ledger
from eval.soak_faults import fault_kinds
from tests.helpers import stories_path


@pytest.mark.slow
@pytest.mark.parametrize("store", ["redis", "file"])
def test_short_soak_loses_nothing_and_serves_no_wrong_answer(tmp_path, store):
    """2.5 minutes (the file store: 2), 2 faults of each kind (a kill, corrupt blobs and tree pages, a
    full disk where tmpfs can be mounted; with Redis also a Redis restart, a full store, a slow store):
    no acknowledged document lost, no deleted one listed or served, no stored KV left unreferenced,
    every exact answer equal to full prefill's, every error clean."""
    res = soak.run(
        minutes=2.5 if store == "redis" else 2.0,
        clients=3,
        seed=3,
        model=str(stories_path()),
        workdir=tmp_path,
        fork=True,
        faults_per_kind=2,
        window_s=3.0,
        store=store,
    )
    print(soak.summary(res))
    print(json.dumps(res))
    kinds = fault_kinds(store == "redis", res["disk_full_available"])
    assert res["faults"] == dict.fromkeys(sorted(kinds), 2), res["faults"]
    assert res["acknowledged_lost"] == [] and res["deleted_listed"] == [] and res["unretrievable"] == []
    assert res["deleted_served"] == [] and res["wrong_answers"] == [] and res["orphan_chunk_blobs"] == 0
    assert res["answers_checked"] > 50 and res["answers_not_exact_mode"] == {}
    assert res["unclean_errors"] == [] and res["hangs"] == [] and res["dropped_while_up"] == []
    assert res["tracebacks"] == 0 and res["healthy_at_end"] and res["clients_stuck"] == 0
    assert res["rss_factor"] <= soak.RSS_FACTOR and res["store_factor"] <= soak.STORE_FACTOR
    assert res["ok"]


def test_ledger_knows_when_a_document_was_absent_throughout():
    """A source cited by an answer counts as a deleted one only when the request ran wholly inside a
    span that began at a delete's acknowledgement and ended at the next ingest's start."""
    ledger = Ledger({"a": {"id": "a", "text": "x"}})
    ledger.begin_ingest("a", 1.0)
    ledger.end("a", "present", 2.0)
    ledger.end("a", "absent", 5.0)  # a delete acknowledged at 5
    ledger.begin_ingest("a", 9.0)  # an ingest began at 9: refused whole (as before: absent)
    ledger.end("a", "absent", 10.0)
    ledger.close(20.0)
    assert ledger.absent_throughout("a", 0.0, 0.5)  # never ingested yet
    assert not ledger.absent_throughout("a", 0.5, 1.5)  # the first ingest began inside
    assert ledger.absent_throughout("a", 5.5, 8.0)
    assert not ledger.absent_throughout("a", 4.0, 6.0)  # the delete was not acknowledged at 4
    assert not ledger.absent_throughout("a", 8.5, 9.5)  # the ingest began at 9
    assert ledger.absent_throughout("a", 11.0, 19.0)


def test_answer_check_finds_an_answer_that_is_not_full_prefills(one_thread):
    """The offline check recomputes full prefill's greedy answer: the served one passes, one token
    changed fails, a completion's text prompt is tokenized as the service does (BOS, specials)."""
    from ragkv import LLM

    llm = LLM(str(stories_path()))
    text = "Once upon a time there was a little girl"
    ids = llm.model.encode(text, add_bos=True, specials=True)
    full = llm.generate(ids, [], [], mode="full", max_new_tokens=6, temperature=0.0).token_ids
    base = {"status": 200, "mode": "prefix", "max_tokens": 6, "t0": 0.0, "t1": 1.0, "stream": False}
    records = [
        {**base, "op": "chat", "prompt_ids": ids, "token_ids": full},
        {**base, "op": "completion_stream", "stream": True, "done": True, "prompt": text, "token_ids": full},
        {**base, "op": "chat", "prompt_ids": ids, "token_ids": [*full[:-1], (full[-1] + 1) % 500]},
        {**base, "op": "chat", "prompt_ids": ids, "token_ids": full[:3], "stream": True},  # cut: not checked
        {**base, "op": "query_blend", "mode": "blend", "prompt_ids": ids, "token_ids": [1]},  # not exact
    ]
    res = check_answers(records, llm, None, 0)
    assert res["answers_checked"] == 3 and res["distinct_prompts_checked"] == 1
    assert len(res["wrong_answers"]) == 1 and res["wrong_answers"][0]["full"] == full
    assert res["answers_not_exact_mode"] == {"blend": 1}


def test_error_check_tells_clean_errors_from_unclean_ones_and_hangs():
    def rec(op="chat", t0=10.0, t1=11.0, **kw):
        return {"op": op, "t0": t0, "t1": t1, **kw}

    clean = {"message": "busy", "type": "rate_limit_exceeded", "code": 429}
    records = [
        rec(status=200),
        rec(status=429, error=clean),
        rec(status=507, error={**clean, "type": "insufficient_storage"}),
        rec(op="delete", status=404, error={**clean, "type": "not_found"}),
        rec(status=500, error={"message": "boom", "type": "internal_error"}),  # unclean: 500
        rec(status=503, body="<html>"),  # unclean: no JSON error
        rec(status=404, error={**clean, "type": "not_found"}),  # unclean: 404 only for deletes
        rec(transport="ConnectError", t0=20.0, t1=20.1),  # during the kill: expected
        rec(transport="ReadError", t0=30.0, t1=30.2),  # the service was up: dropped
        rec(transport="timeout: ReadTimeout", t0=40.0, t1=130.0),  # a hang
        rec(status=200, stream=True, t0=50.0, t1=51.0),  # a stream without [DONE], service up
        rec(status=200, stream=True, error={"message": "x", "type": "server_error", "code": "unavailable"}),
        rec(
            status=200,
            stream=True,
            t0=60.0,
            error={"message": "x", "type": "server_error", "code": "internal_error"},
        ),
        rec(bug="KeyError('choices')"),
    ]
    res = check_errors(records, kills=[(19.5, 22.0)])
    assert [r.get("status", r.get("bug")) for r in res["unclean_errors"]] == [
        500,
        503,
        404,
        200,
        "KeyError('choices')",
    ]
    assert [r["t0"] for r in res["hangs"]] == [40.0]
    assert [r["t0"] for r in res["dropped_while_up"]] == [30.0, 50.0]
    assert res["stream_errors"] == 2
