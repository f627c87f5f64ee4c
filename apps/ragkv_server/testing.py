"""The service started as a process, for tests and benchmarks: ``python -m ragkv_server.server`` on a free
loopback port, fresh or forked from a fork server that imported the service once (a start costs about a
second instead of ~10 s of imports on 2 cores), waited for and stopped. ragkv-server's own tests use it,
and so do the checkout's benchmarks (``eval/harness.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ragkv.testing import free_port

#: what a forked server (or another forked ``python -m`` of this checkout) would otherwise import
#: itself (~8 s of a ~10 s start on 2 cores): imported once by the fork server; each process is a fork
SERVER_PRELOAD = ["ragkv_server.server", "ragkv_server.service", "sentence_transformers", "faiss", "uvicorn"]


class ForkedProcess:
    """A ``python -m MODULE`` process forked from a fork server that has imported
    :data:`SERVER_PRELOAD` (:func:`fork_module`), with the ``subprocess.Popen`` calls callers use
    (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``): still a
    process of its own (its own GIL, killable, its own exit status)."""

    def __init__(self, process, module: str) -> None:
        self.process = process
        self.module = module
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # negative: the signal that ended it, as Popen says

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"{self.module} (forked)", timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


def _run_module_forked(module: str, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """The forked child: this launch's environment, working directory (``cwd``) and output (``log_path``),
    then what ``python -m MODULE ARGV`` runs (the module as ``__main__``)."""
    import multiprocessing
    import runpy

    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # as in a fresh interpreter: a fork server's child would otherwise register the semaphores its
    # libraries make (tqdm's lock) with the launcher's resource tracker, which then warns of leaks
    multiprocessing.set_start_method("fork", force=True)
    sys.argv = [f"python -m {module}", *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


_FORK_CONTEXT = None


def _fork_context():
    """The ``forkserver`` multiprocessing context, its server preloading :data:`SERVER_PRELOAD`
    (started on first use; one per process that forks modules)."""
    global _FORK_CONTEXT
    if _FORK_CONTEXT is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(SERVER_PRELOAD)
        _FORK_CONTEXT = ctx
    return _FORK_CONTEXT


def fork_module(
    module: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None
) -> ForkedProcess:
    """``python -m MODULE ARGV`` with ``env`` as its whole environment, ``cwd`` (default: this process's)
    as its working directory and its stdout and stderr in ``log_path`` (emptied first), forked from the
    fork server instead of started as a fresh interpreter: the test suite's servers and fault-injection
    children (imports done once)."""
    log_path.write_text("")
    args = (module, argv, env, str(log_path), str(cwd or Path.cwd()))
    process = _fork_context().Process(target=_run_module_forked, args=args)
    process.start()
    return ForkedProcess(process, module)


def spawn_server(
    env: dict[str, str], log_path: Path, fork: bool = False, cwd: Path | None = None
) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """Start ``python -m ragkv_server.server`` on a free loopback port, with ``env`` (``RAGKV_*`` settings,
    a ``PYTHONPATH``) over this process's environment (a ``RAGKV_CONFIG`` file is not used), ``cwd``
    (default: this process's) as its working directory and its output in ``log_path``; returns (process,
    base URL) at once (:func:`wait_for_server` waits for it).

    ``fork``: fork the server from a fork server that has imported it already (:class:`ForkedProcess`;
    the test suite starts ~20 servers: ~8 s of imports each on 2 cores) instead of a fresh interpreter
    (what the benchmarks use: nothing shared with this process)."""
    port = free_port()
    full_env = {**os.environ, **env}
    full_env.pop("RAGKV_CONFIG", None)
    argv = ["--port", str(port)]
    if fork:
        return fork_module("ragkv_server.server", argv, full_env, log_path, cwd), f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "ragkv_server.server", *argv],
            cwd=cwd,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, f"http://127.0.0.1:{port}"


def wait_for_server(
    proc: subprocess.Popen | ForkedProcess, base: str, log_path: Path, timeout_s: float = 300
) -> None:
    """Return once the server's ``/healthz`` answers; RuntimeError (with the log's tail) if it exits
    first or is not up within ``timeout_s`` (it is killed then)."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start within {timeout_s:g} s:\n{log_path.read_text()[-3000:]}")


def wait_until_idle(base: str, timeout_s: float = 120) -> None:
    """Return once the server at ``base`` runs and queues no query (``/healthz``): a response ends at
    the answer and its worker then commits the answer's KV, so another process on the same store
    finds it only after that. TimeoutError if still busy after ``timeout_s``."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        h = httpx.get(base + "/healthz", timeout=10).json()
        if not h["running"] and not h["queued"]:
            return
        if time.time() > deadline:
            raise TimeoutError(f"server {base} still busy after {timeout_s:g} s: {h}")
        time.sleep(0.05)


def launch_server(
    env: dict[str, str], log_path: Path, timeout_s: float = 300, fork: bool = False, cwd: Path | None = None
) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """:func:`spawn_server`, then :func:`wait_for_server`: (process, base URL) of a server that answers."""
    proc, base = spawn_server(env, log_path, fork, cwd)
    wait_for_server(proc, base, log_path, timeout_s)
    return proc, base


def stop_server(proc: subprocess.Popen | ForkedProcess, timeout_s: float = 60) -> None:
    """Terminate a server :func:`launch_server` started; kill it if it is not gone within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
