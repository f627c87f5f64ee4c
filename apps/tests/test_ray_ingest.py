"""``ragkv-server ingest --ray`` beside running services: two services on one data folder and one Redis
store serve what the Ray pipeline ingested after ``POST /v1/admin/reload`` (no restart), a prompt one of
them computed is cached on the other, and a pipeline whose driver is killed (``kill -9``) finishes the
rest when started again, losing no acknowledged document and computing no stored chunk twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers_service import LIMITS

from ragkv.testing import committed_documents, musique_docs
from ragkv_server.testing import launch_server, stop_server, wait_until_idle

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray (2 CPUs, a small object store) the command line joins with ``--address``."""
    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _cli(data: Path, store: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ragkv_server.cli",
        "ingest",
        "--data-dir",
        str(data),
        "--store",
        store,
        *args,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, **LIMITS, "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # two live servers, a Ray pipeline
def test_two_services_serve_what_the_ray_pipeline_ingested_after_a_reload(
    tmp_path, redis_server, ray_address
):
    data = tmp_path / "data"
    store = f"{redis_server.url}?prefix=two-{os.getpid()}:"
    env = {**LIMITS, "RAGKV_DATA_DIR": str(data), "RAGKV_STORE": store}
    servers = [launch_server(env, tmp_path / f"server-{n}.log", 180, fork=True) for n in "ab"]
    try:
        a, b = (httpx.Client(base_url=base, timeout=120) for _, base in servers)
        docs = musique_docs(2, chars=300)
        f = tmp_path / "docs.jsonl"
        f.write_text("".join(json.dumps(d) + "\n" for d in docs))
        p = subprocess.run(
            _cli(data, store, str(f), "--ray", "--address", ray_address, "-q"),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        report = json.loads(p.stdout.strip().splitlines()[-1])
        assert report["documents_added"] == len(docs) and report["errors"] == 0
        for c in (a, b):  # running services take the new documents in without a restart
            r = c.post("/v1/admin/reload", json={})
            assert r.status_code == 200 and r.json()["documents"] == len(docs), r.text
            assert c.get("/healthz").json()["documents"] == len(docs)
        question = {"question": docs[0]["text"][:60], "top_k": 2, "mode": "prefix", "max_tokens": 2}
        on_a = a.post("/v1/query", json=question).json()
        assert on_a["sources"][0]["doc_id"] in {d["id"] for d in docs}
        # the first retrieved chunk's exact KV after the prompt head was precomputed by the Ray workers
        assert on_a["stats"]["store_tokens"] > 0, on_a["stats"]
        wait_until_idle(servers[0][1])  # a's worker commits the prompt's KV after the response
        on_b = b.post("/v1/query", json=question).json()
        assert on_b["answer"] == on_a["answer"] and on_b["sources"] == on_a["sources"]
        assert on_b["stats"]["cached_tokens"] >= 0.9 * on_b["stats"]["num_tokens"], on_b["stats"]
    finally:
        for proc, _ in servers:
            stop_server(proc, 30)


@pytest.mark.slow  # a Ray pipeline's driver killed and restarted
def test_a_killed_driver_restarted_finishes_the_rest(tmp_path, ray_address):
    data = tmp_path / "data"
    store = f"file://{tmp_path / 'kv'}?codec=raw"
    docs = musique_docs(8, per_sample=10, chars=300)
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))
    # commit a few documents at a time, so that the driver dies between commits
    cmd = _cli(data, store, str(f), "--ray", "--address", ray_address, "-q", "--commit-every", "4")
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and committed_documents(data) < 4:
            time.sleep(0.1)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        proc.kill()  # SIGKILL to the driver, mid-run: its workers go with its job
        proc.wait(30)
        log.close()
    acked = committed_documents(data)
    assert 0 < acked < len(docs)
    stored = {p.name for p in (tmp_path / "kv").glob("??/*.kvb")}  # chunk KV (tree pages: kv/tree/)
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["documents_unchanged"] == acked  # no acknowledged document lost
    assert report["documents_added"] == len(docs) - acked and report["errors"] == 0
    assert committed_documents(data) == len(docs)
    # no chunk whose KV was stored before the kill is computed again
    after = {p.name for p in (tmp_path / "kv").glob("??/*.kvb")}
    assert report["kv_computed"] <= len(after - stored) and report["kv_already_stored"] > 0
