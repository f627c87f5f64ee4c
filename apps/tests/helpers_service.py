"""What ragkv-server's tests share: a real ``python -m ragkv_server.server`` on a loopback port with small
limits, the settings of an in-process service on the tiny model, the documents they ingest, and a
``/metrics`` reader."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from ragkv.blend import DEFAULT_RATIO
from ragkv.testing import stories_path
from ragkv_server.testing import launch_server, stop_server

NEW = 8
LIMITS = {  # small limits keep every request (and the schemathesis run) cheap on 2 cores
    "RAGKV_MODEL": str(stories_path()),  # the tiny test model (the default is the real one)
    "RAGKV_TORCH_THREADS": "1",
    "RAGKV_MAX_NEW_TOKENS": str(NEW),
    "RAGKV_MAX_NEW_TOKENS_LIMIT": "48",
    "RAGKV_TOP_K": "3",
    "RAGKV_CHUNK_TOKENS": "64",
    "RAGKV_MAX_CONCURRENCY": "2",
    "RAGKV_MAX_QUEUE": "34",
    "RAGKV_MAX_BODY_BYTES": str(64 << 10),
    "RAGKV_MAX_UPLOAD_BYTES": str(256 << 10),
    "RAGKV_MAX_DOCUMENTS": "4",
    "RAGKV_MAX_DOCUMENT_CHARS": "1500",
    "RAGKV_MAX_QUESTION_CHARS": "400",
    "RAGKV_MAX_CHUNK_IDS": "8",
    "RAGKV_MAX_MESSAGES": "6",
    "RAGKV_LOG_LEVEL": "warning",
    # the service's tests check the reuse/blend paths: an explicit ratio (outside the fidelity gate;
    # the tiny model has no fidelity report, so the gate's default would run exact prefill)
    "RAGKV_RATIO": str(DEFAULT_RATIO),
}


@contextlib.contextmanager
def running_server(data: Path, **env_extra: str):
    """``python -m ragkv_server.server`` on a free loopback port with a fresh data directory; yields its base URL.
    The server is forked from a fork server that imported it once (``launch_server(fork=True)``)."""
    log_path = data / "server.log"
    try:
        proc, base = launch_server(
            {**LIMITS, **env_extra, "RAGKV_DATA_DIR": str(data / "data")}, log_path, 180, fork=True
        )
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield base
    finally:
        stop_server(proc, 30)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-3000:]


def chat_openai(base: str, model: str, max_tokens: int, **fields):
    """LangChain's ``ChatOpenAI`` on the service at ``base`` (the test is skipped without langchain-openai):
    greedy, no retries; ``fields``: more of its settings (``extra_body``...)."""
    lc_openai = pytest.importorskip("langchain_openai")
    client = {"api_key": "unused", "max_retries": 0, "temperature": 0}
    return lc_openai.ChatOpenAI(base_url=base + "/v1", model=model, max_tokens=max_tokens, **client, **fields)


def tiny_settings(data_dir: Path, **overrides):
    """ragkv-server ``Settings`` of an in-process service (``TestClient``) on the tiny model: short
    chunks, one thread, two new tokens; ``overrides`` on top."""
    from ragkv_server.config import Settings

    base = dict(
        model=str(stories_path()),
        data_dir=data_dir,
        chunk_tokens=32,
        torch_threads=1,
        max_new_tokens=2,
        allowed_hosts=["testserver"],
    )
    return Settings(**{**base, **overrides})


def service_docs(samples) -> list[dict]:
    return [
        {"id": f"s{i}-p{j}", "text": c["text"][:300], "metadata": {"title": c["title"]}}
        for i, s in enumerate(samples)
        for j, c in enumerate(s["ctxs"][:3])
    ]


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name{labels}`` in a ``/metrics`` text (any label order; None if absent),
    parsed with prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None
