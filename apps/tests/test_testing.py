"""ragkv_server.testing's server launcher (the tests' and the benchmarks'): a forked server behaves as
``python -m ragkv_server.server`` does (its output in the log, its exit status, SIGTERM a clean stop), for
the tests that start ~20 of them."""

from __future__ import annotations

import signal

import pytest
from helpers_service import LIMITS

from ragkv_server.testing import ForkedProcess, launch_server, stop_server

pytestmark = pytest.mark.slow  # the fork server imports the service once (~10 s on 2 cores)


def test_a_forked_server_reports_a_bad_setting_like_the_command_and_exits_2(tmp_path):
    log = tmp_path / "server.log"
    env = {**LIMITS, "RAGKV_DATA_DIR": str(tmp_path / "data"), "RAGKV_MAX_CONCURRENCY": "0"}
    with pytest.raises(RuntimeError, match="server exited"):
        launch_server(env, log, 120, fork=True)
    assert "error: invalid settings" in log.read_text() and "max_concurrency" in log.read_text()


def test_a_forked_server_answers_and_stops_cleanly_on_sigterm(tmp_path):
    import httpx

    log = tmp_path / "server.log"
    env = {**LIMITS, "RAGKV_DATA_DIR": str(tmp_path / "data"), "RAGKV_LOG_LEVEL": "info"}
    proc, base = launch_server(env, log, 120, fork=True)
    assert isinstance(proc, ForkedProcess) and proc.poll() is None
    try:
        r = httpx.get(base + "/v1/models", timeout=30)
        assert r.status_code == 200 and r.json()["data"], r.text
    finally:
        stop_server(proc, 30)
    text = log.read_text()
    assert "ragkv service ready" in text and "Traceback" not in text
    # uvicorn's graceful shutdown, then the signal re-raised (what the command's process returns too)
    assert "Application shutdown complete" in text and proc.returncode == -signal.SIGTERM
