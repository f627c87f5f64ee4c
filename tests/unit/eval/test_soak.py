"""The soak (issue 54) at its short size: the service under three clients and every fault kind for a
few minutes on the tiny model, then the same checks as the hour-long run (``python -m eval.soak``)."""

from __future__ import annotations

import json

import pytest

from eval import soak
from eval.soak_clients import Ledger
from tests.helpers import stories_path


@pytest.mark.slow
def test_short_soak_loses_nothing_and_serves_no_wrong_answer(tmp_path):
    """2.5 minutes, 2 faults of each kind (a kill, a Redis restart, corrupt blobs and tree pages, a full
    store, a full disk where tmpfs can be mounted, a slow store): no acknowledged document lost, no
    deleted one listed or served, every exact answer equal to full prefill's, every error clean."""
    res = soak.run(
        minutes=2.5,
        clients=3,
        seed=3,
        model=str(stories_path()),
        workdir=tmp_path,
        fork=True,
        faults_per_kind=2,
        window_s=3.0,
    )
    print(soak.summary(res))
    print(json.dumps(res))
    kinds = set(soak.FAULT_KINDS) - (set() if res["disk_full_available"] else {"disk_full"})
    assert set(res["faults"]) == kinds and res["faults"]["kill_service"] == 2, res["faults"]
    assert res["acknowledged_lost"] == [] and res["deleted_listed"] == [] and res["unretrievable"] == []
    assert res["deleted_served"] == [] and res["wrong_answers"] == []
    assert res["answers_checked"] > 50 and res["answers_not_exact_mode"].get(None, 0) == 0
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
