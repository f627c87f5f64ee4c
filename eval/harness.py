"""Small helpers the benchmarks share: a median wall time, a progress line, a free loopback port, and the
HTTP service started on one from this checkout and stopped (ragkv_server.testing's launcher)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ragkv.testing import free_port  # noqa: F401  (the benchmarks' free port)
from ragkv_server import testing as service_processes
from ragkv_server.testing import ForkedProcess, stop_server, wait_for_server  # noqa: F401  (re-exported)

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


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for a child that runs this checkout's ragkv and ragkv-server (``apps/``), installed
    (editable) or not, then whatever the caller's ``PYTHONPATH`` held."""
    path = [str(REPO), str(REPO / "apps"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(path))


def spawn_server(
    env: dict[str, str], log_path: Path, fork: bool = False
) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """:func:`ragkv_server.testing.spawn_server` run from this checkout (its working directory, and
    :func:`checkout_pythonpath` unless ``env`` names another ``PYTHONPATH``)."""
    return service_processes.spawn_server({"PYTHONPATH": checkout_pythonpath(), **env}, log_path, fork, REPO)


def launch_server(
    env: dict[str, str], log_path: Path, timeout_s: float = 300, fork: bool = False
) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """:func:`spawn_server`, then :func:`wait_for_server`: (process, base URL) of a server that answers."""
    proc, base = spawn_server(env, log_path, fork)
    wait_for_server(proc, base, log_path, timeout_s)
    return proc, base


def fork_module(module: str, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
    """:func:`ragkv_server.testing.fork_module` run from this checkout's root."""
    return service_processes.fork_module(module, argv, env, log_path, REPO)
