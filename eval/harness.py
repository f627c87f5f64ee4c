"""Small helpers the benchmarks share: a median wall time, a free loopback port."""

from __future__ import annotations

import socket
import statistics
import time


def median_time(fn, runs: int) -> float:
    """Median seconds of ``runs`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def free_port() -> int:
    """A loopback TCP port free right now (for a server the benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
