"""The soak's processes and faults: Redis and the service on loopback (restarted when killed), and the
faults :mod:`eval.soak` injects into them.

Faults, each real (no wrapper in the service):

* ``kill_service``: SIGKILL the service; it is started again at once and the time until ``/healthz``
  answers is measured.
* ``restart_redis``: SIGKILL Redis (no persistence: every stored blob and tree page is gone) and start
  it again on the same port.
* ``corrupt_blob`` / ``corrupt_tree``: flip 4 bytes in, or truncate, a tenth of the stored chunk KV
  blobs / exact KV tree pages in Redis (``SETRANGE`` / ``SET`` of a prefix of the value).
* ``store_full``: Redis' ``maxmemory`` lowered to what it holds, with ``noeviction``: every write of
  KV is refused (OOM) for the fault's window, as a full store.
* ``disk_full``: the data folder lives on a small tmpfs made for the run (needs ``mount``: root); a
  filler file takes its free space for the window, so the index's writes meet ENOSPC. Without
  ``mount`` this fault is not available (and reported so).
* ``slow_store``: Redis paused (``CLIENT PAUSE``) 200 ms of every 300 ms for the window: a store that
  answers, slowly.

With ``--store file`` (the service's default store: files under its data folder, :class:`FileStore`)
the blobs and pages are damaged in place, the full disk takes the KV writes too, and the faults of
Redis itself do not apply.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from eval.harness import spawn_server, wait_for_server
from ragkv.testing.fixtures import RedisServer

#: every fault kind, in the order the figures list them
FAULT_KINDS = (
    "kill_service",
    "restart_redis",
    "corrupt_blob",
    "corrupt_tree",
    "store_full",
    "disk_full",
    "slow_store",
)
#: the faults of Redis itself (not injected with the file store)
REDIS_FAULTS = ("restart_redis", "store_full", "slow_store")


def fault_kinds(redis_store: bool, small_disk: bool) -> list[str]:
    """The fault kinds a run injects: the Redis ones with a Redis store, ``disk_full`` with a small disk."""
    return [
        k for k in FAULT_KINDS if (redis_store or k not in REDIS_FAULTS) and (small_disk or k != "disk_full")
    ]


#: most blobs (or tree pages) one corruption fault damages
MAX_CORRUPT = 20
#: the key prefix of the service's store in Redis (tree pages: ``PREFIX + "tree:"``)
PREFIX = "soak:"


@dataclass
class FaultEvent:
    """One injected fault: its kind, when it started and ended (seconds since the run's start), what it
    hit, and (``kill_service``) the seconds until the service answered again."""

    kind: str
    start: float
    end: float = 0.0
    detail: str = ""
    recovery_s: float | None = None


class Redis:
    """A ``redis-server`` on a loopback port (:class:`ragkv.testing.fixtures.RedisServer`), bounded by
    ``maxmemory`` with LRU eviction (a deployed store's bound), restartable."""

    def __init__(self, maxmemory: int) -> None:
        self.maxmemory = maxmemory
        self.server = RedisServer()
        self.configure()

    @property
    def url(self) -> str:
        return self.server.url

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def configure(self) -> None:
        with self.client() as r:
            r.config_set("maxmemory", self.maxmemory)
            r.config_set("maxmemory-policy", "allkeys-lru")

    def restart(self) -> None:
        self.server.kill()
        self.server.start()
        self.configure()

    def used_bytes(self) -> int:
        with self.client() as r:
            return int(r.info("memory")["used_memory"])

    def keys(self, tree: bool) -> list[bytes]:
        """The service's stored chunk blobs (``tree``: tree pages) now in Redis."""
        with self.client() as r:
            keys = list(r.scan_iter(match=f"{PREFIX}tree:*" if tree else f"{PREFIX}*", count=1000))
        keys = sorted(k for k in keys if b"@" not in k)
        return keys if tree else [k for k in keys if not k.startswith(f"{PREFIX}tree:".encode())]

    def chunk_bytes(self) -> dict[str, int]:
        """Stored chunk KV blobs (no tree pages): key (without the prefix) -> bytes."""
        keys = self.keys(tree=False)
        with self.client() as r:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(k)
            sizes = pipe.execute()
        return {k.decode()[len(PREFIX) :]: n for k, n in zip(keys, sizes, strict=True) if n}

    def store_url(self) -> str | None:
        """The service's ``RAGKV_STORE``."""
        return f"{self.url}?prefix={PREFIX}"

    def damage(self, key: bytes, rng: random.Random) -> str | None:
        """Flip 4 bytes of the blob under ``key`` or truncate it: which (None: it is gone)."""
        with self.client() as r:
            value = r.get(key)
            if not value:
                return None
            if rng.random() < 0.5:
                at = rng.randrange(len(value))
                r.setrange(key, at, bytes(b ^ 0xFF for b in value[at : at + 4]))
                return "flipped"
            r.set(key, value[: rng.randrange(len(value))], xx=True)
            return "truncated"

    def close(self) -> None:
        self.server.cleanup()


class FileStore:
    """The service's default store: files under its data folder (``data/kv``; tree pages ``data/kv/tree``),
    damaged in place as a bad disk would."""

    maxmemory = None

    def __init__(self, data: Path) -> None:
        self.root = data / "kv"

    def store_url(self) -> str | None:
        return None  # RAGKV_STORE unset: data_dir/kv

    def keys(self, tree: bool) -> list[Path]:
        return sorted((self.root / "tree" if tree else self.root).glob("??/*.kvb"))

    def chunk_bytes(self) -> dict[str, int]:
        out = {}
        for p in self.keys(tree=False):
            try:
                out[p.name[: -len(".kvb")]] = p.stat().st_size
            except FileNotFoundError:
                continue
        return out

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root.exists() else 0

    def damage(self, path: Path, rng: random.Random) -> str | None:
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                if not size:
                    return None
                if rng.random() < 0.5:
                    at = rng.randrange(size)
                    f.seek(at)
                    raw = f.read(4)
                    f.seek(at)
                    f.write(bytes(b ^ 0xFF for b in raw))
                    return "flipped"
                f.truncate(rng.randrange(size))
                return "truncated"
        except (FileNotFoundError, OSError):  # deleted meanwhile, or the disk is full
            return None

    def close(self) -> None:
        pass


class Service:
    """The service as a process of its own (``python -m ragkv_server.server``, fresh or forked), started
    again after a kill; each start's output in its own log."""

    def __init__(self, env: dict[str, str], logs: Path, fork: bool, t0: float) -> None:
        self.env, self.logs, self.fork, self.t0 = env, logs, fork, t0
        self.starts = 0
        self.proc = None
        self.base = ""
        self.up = True  # False between a kill and the service answering again

    def log_path(self, n: int) -> Path:
        return self.logs / f"server-{n}.log"

    def start(self, timeout_s: float = 300) -> float:
        """Start it and wait until ``/healthz`` answers; the seconds that took. The port is new each
        start (clients follow :attr:`base`)."""
        t = time.monotonic()
        self.starts += 1
        log = self.log_path(self.starts)
        self.proc, base = spawn_server(self.env, log, self.fork)
        wait_for_server(self.proc, base, log, timeout_s)
        self.base = base
        self.up = True
        return time.monotonic() - t

    def kill(self) -> None:
        self.up = False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        from eval.harness import stop_server

        if self.proc is not None and self.proc.poll() is None:
            stop_server(self.proc, 30)

    def rss_bytes(self) -> int:
        """The service process's resident memory (``VmRSS``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def tracebacks(self) -> int:
        """Tracebacks written to the logs of every start (a 500 logs one)."""
        return sum(self.log_path(n).read_text().count("Traceback") for n in range(1, self.starts + 1))

    def idle(self, timeout_s: float = 120) -> None:
        from ragkv_server.testing import wait_until_idle

        wait_until_idle(self.base, timeout_s)


def mount_small_fs(path: Path, mib: int) -> bool:
    """A tmpfs of ``mib`` MiB at ``path`` (the data folder's disk, filled by ``disk_full``); False where
    mounting is not allowed (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "ragkv-soak", str(path)],
        capture_output=True,
        text=True,
    )
    return p.returncode == 0


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> int:
    """Write zeros to ``path`` until its filesystem is full (ENOSPC); the bytes written."""
    n = 0
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            while True:
                try:
                    n += f.write(block[:size])
                except OSError:
                    break
    return n


@dataclass
class Injector:
    """Injects one fault at a time into ``service`` and ``store`` (``rng`` picks what it hits); the
    faults of Redis itself only when the store is :class:`Redis`."""

    service: Service
    store: Redis | FileStore
    rng: random.Random
    disk: Path | None  # the mounted small filesystem (None: disk_full unavailable)
    window_s: float
    events: list[FaultEvent] = field(default_factory=list)

    def kinds(self) -> list[str]:
        return fault_kinds(isinstance(self.store, Redis), self.disk is not None)

    def inject(self, kind: str, now) -> FaultEvent:
        ev = FaultEvent(kind, now())
        getattr(self, kind)(ev)
        ev.end = now()
        self.events.append(ev)
        return ev

    def kill_service(self, ev: FaultEvent) -> None:
        self.service.kill()
        ev.detail = f"pid {self.service.proc.pid}"
        ev.recovery_s = round(self.service.start(), 3)

    def restart_redis(self, ev: FaultEvent) -> None:
        self.store.restart()

    def _corrupt(self, ev: FaultEvent, tree: bool) -> None:
        """Flip 4 bytes in, or truncate, a tenth (1 to :data:`MAX_CORRUPT`) of the stored blobs or pages."""
        keys = self.store.keys(tree)
        if not keys:
            ev.detail = "nothing stored"
            return
        hit = self.rng.sample(keys, max(1, min(MAX_CORRUPT, len(keys) // 10)))
        done = [self.store.damage(k, self.rng) for k in hit]
        flips, cuts = done.count("flipped"), done.count("truncated")
        ev.detail = f"{flips} flipped, {cuts} truncated of {len(keys)}" if flips + cuts else "gone"

    def corrupt_blob(self, ev: FaultEvent) -> None:
        self._corrupt(ev, tree=False)

    def corrupt_tree(self, ev: FaultEvent) -> None:
        self._corrupt(ev, tree=True)

    def store_full(self, ev: FaultEvent) -> None:
        with self.store.client() as r:
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", used)
            ev.detail = f"maxmemory {used}"
            try:
                time.sleep(self.window_s)
            finally:
                self.store.configure()

    def disk_full(self, ev: FaultEvent) -> None:
        filler = self.disk / "filler"
        try:
            ev.detail = f"filled {fill(filler)} bytes"
            time.sleep(self.window_s)
        finally:
            filler.unlink(missing_ok=True)

    def slow_store(self, ev: FaultEvent) -> None:
        end = time.monotonic() + self.window_s
        pauses = 0
        with self.store.client() as r:
            while time.monotonic() < end:
                r.execute_command("CLIENT", "PAUSE", 200, "ALL")
                pauses += 1
                time.sleep(0.3)
        ev.detail = f"{pauses} pauses of 200 ms"


def healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
