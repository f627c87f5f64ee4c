"""The checkout's fault-injection harness and the ingest-load benchmark at smoke size, against the service
started as processes (``eval.faults``, ``eval.bench_ingest_load``)."""

from __future__ import annotations

import json

import pytest

from eval import faults
from tests.helpers import stories_path


@pytest.mark.slow
def test_kill9_during_ingest_loses_no_acknowledged_document(tmp_path, one_thread):
    """2 SIGKILLs at random points of a 16-document ingest, the children forked from a fork server that
    has done their imports (a fresh interpreter costs ~8 s of them on 2 cores); ``python -m eval.faults
    --soak`` runs 20 of a 100-document ingest by hand, in fresh interpreters."""
    res = faults.run(rounds=2, n_docs=16, seed=7, model=str(stories_path()), workdir=tmp_path, fork=True)
    print(json.dumps({k: v for k, v in res.items() if k != "per_round"}))
    assert res["kills"] == 2
    assert res["acknowledged_lost"] == 0
    assert res["half_written_listed"] == 0 and res["unretrievable"] == 0
    assert res["orphan_kv_blobs"] == 0 and res["orphan_tmp_files"] == 0 and res["intents_left"] == 0
    assert res["final_complete"] and res["answers_identical_to_clean"]


@pytest.mark.slow
def test_bench_ingest_load_runs_and_reports_sane_fields():
    """eval.bench_ingest_load at a small size (the 50 MB goal is measured by hand: docs/BENCHMARKS.md)."""
    from eval import bench_ingest_load

    res = bench_ingest_load.main(
        ["--mb", "0.2", "--doc-chars", "100000", "--runs", "1", "--queries", "6", "--load-s", "3"]
        + ["--alone-s", "1", "--base-docs", "10", "--fork-server"]
    )
    assert res["errors"] == 0 and res["healthz_errors"] == 0
    assert res["upload_bytes"] >= 200_000 and res["upload_documents"] == 2
    assert 0 < res["idle_p50_ms"] <= res["idle_p99_ms"] and 0 < res["load_p50_ms"] <= res["load_p99_ms"]
    assert res["p99_ratio"] > 0 and res["healthz_polls_during_load"] >= 20 and res["healthz_max_ms"] > 0
    assert res["ingest_running_at_end"] and res["documents_unchanged_after_cut"]  # cut: nothing committed
