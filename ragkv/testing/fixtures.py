"""Pytest fixtures the suites of ragkv and of its distributions share: one torch thread, the RAG's
embedder, ``redis-server`` processes on free loopback ports, an empty fidelity cache, and a RAG over the
tiny model. A ``conftest.py`` imports the ones it uses (``from ragkv.testing.fixtures import embedder``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from ragkv.testing import free_port

REDIS_BIN = shutil.which("redis-server")
NO_REDIS_REASON = "redis-server binary not found on PATH (install it, e.g. `apt-get install redis-server`)"


class RedisServer:
    """A throwaway ``redis-server`` (no persistence) bound to 127.0.0.1; ``kill`` it to test outages."""

    def __init__(self, port: int | None = None) -> None:
        if REDIS_BIN is None:
            pytest.skip(NO_REDIS_REASON)
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="ragkv-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """(Re)start the server on the same port; waits until it answers PING."""
        flags = {"--port": str(self.port), "--bind": "127.0.0.1", "--dir": self.dir, "--save": ""}
        flags |= {
            "--appendonly": "no",
            "--daemonize": "no",
            "--protected-mode": "yes",
            "--loglevel": "warning",
        }
        argv = [REDIS_BIN, *(x for kv in flags.items() for x in kv)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within 10 s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as in a crash; the port stays free for :meth:`start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One Redis shared by the whole session; tests isolate themselves with unique key prefixes."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def make_redis_server() -> Iterator:
    """Factory for private Redis servers (for tests that kill or restart them); all stopped at teardown."""
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        s = RedisServer()
        servers.append(s)
        return s

    try:
        yield make
    finally:
        for s in servers:
            s.cleanup()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model runs fastest (and fairest to other jobs) on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedder():
    """The RAG's default embedder (one per test module)."""
    from ragkv.rag import Embedder

    return Embedder()


@pytest.fixture
def fidelity_cache(tmp_path, monkeypatch):
    """An empty ragkv cache for this test (fidelity reports, converted models), and a fidelity gate
    that forgets what it read before."""
    from ragkv.fidelity import GATE

    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path))
    GATE.forget()
    yield tmp_path
    GATE.forget()


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    """The first two MuSiQue samples (questions and passages: those :func:`tiny_rag` holds)."""
    from ragkv.testing import musique_samples

    return musique_samples(2)


@pytest.fixture(scope="module")
def tiny_rag(tmp_path_factory, one_thread, embedder):
    """A RAG on the tiny model over six MuSiQue passages, each chunk's KV stored (one per test module)."""
    from ragkv.testing import musique_rag

    rag = musique_rag(tmp_path_factory.mktemp("tiny-rag") / "data", embedder)
    yield rag
    rag.close()
