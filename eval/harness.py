"""Small helpers the benchmarks (and the server tests) share: a median wall time, a progress line, a
free loopback port, and the HTTP service started on one and stopped."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def median_time(fn, runs: int) -> float:
    """Median seconds of ``runs`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def progress(what: str, done: int, total: int, per_s: float) -> None:
    """One stderr line for a log file: ``done`` of ``total`` ``what``, ``per_s`` each, and the time left."""
    print(
        f"{what}: {done}/{total}, {per_s:.1f} s each, about {per_s * (total - done) / 60:.1f} min left",
        file=sys.stderr,
        flush=True,
    )


def free_port() -> int:
    """A loopback TCP port free right now (for a server the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for a child that runs this checkout's ragkv and ragkv-server (``apps/``), installed
    (editable) or not, then whatever the caller's ``PYTHONPATH`` held."""
    path = [str(REPO), str(REPO / "apps"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(path))


def launch_server(
    env: dict[str, str], log_path: Path, timeout_s: float = 300
) -> tuple[subprocess.Popen, str]:
    """``python -m ragkv_server.server`` on a free loopback port, with ``env`` (``RAGKV_*`` settings) over this
    process's environment (a ``RAGKV_CONFIG`` file is not used) and its output in ``log_path``.

    Returns (process, base URL) once ``/healthz`` answers; RuntimeError (with the log's tail) if the
    server exits first or is not up within ``timeout_s``."""
    import httpx

    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), **env}
    full_env.pop("RAGKV_CONFIG", None)
    with open(log_path, "w") as log:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "ragkv_server.server", "--port", str(port)],
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not start within {timeout_s:g} s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Terminate a server :func:`launch_server` started; kill it if it is not gone within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
