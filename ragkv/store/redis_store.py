"""Redis chunk KV store, shared by processes and machines (redis-py).

Each blob is one string ``{prefix}{key}``; per-layer reads are ``GETRANGE`` of the segments only.
A hash ``{prefix}@index`` (key -> blob bytes) serves ``keys`` and ``nbytes``; ``contains`` asks
``EXISTS`` on the blob itself, so it stays right when Redis evicts blobs under ``maxmemory`` (bound
a shared store with Redis' own ``maxmemory`` + ``volatile-lru``/``allkeys-lru``; stale index entries
are dropped by ``keys``).

When Redis is down every call is a miss or a failed put with one WARNING per ``warn_every_s``.
After a connection failure the store does not touch the network for ``down_backoff_s`` (a query
with 6 chunks x 32 layers must not wait 192 connect timeouts), then tries again. redis-py's own
retry loop (10 retries with backoff by default) is reduced to ``retries`` immediate retries.
"""

from __future__ import annotations

import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ragkv.store.base import BlobStore


class RedisDownError(redis.exceptions.ConnectionError):
    """Raised without a network call while the store backs off after a connection failure."""


class RedisStore(BlobStore):
    """Chunk KV in Redis; safe to share between threads and processes."""

    backend_errors = (redis.exceptions.RedisError, OSError)

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "ragkv:kv:",
        socket_timeout: float = 2.0,
        connect_timeout: float = 1.0,
        retries: int = 1,
        down_backoff_s: float = 2.0,
        warn_every_s: float = 30.0,
        client: redis.Redis | None = None,
        **options,
    ) -> None:
        """``options``: :class:`BlobStore`'s (``codec``, ``codec_options``, ``verify``, ``hmac_key``, ``codecs``)."""
        super().__init__(**options)
        if not prefix or "@" in prefix:
            raise ValueError(f"invalid Redis key prefix {prefix!r}")
        self.url = url
        self.prefix = prefix
        self._options = dict(
            options,
            socket_timeout=socket_timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            down_backoff_s=down_backoff_s,
            warn_every_s=warn_every_s,
        )
        self.index_key = f"{prefix}@index"
        self.down_backoff_s = down_backoff_s
        self._warn.every_s = warn_every_s
        self._down_until = 0.0
        self._down_lock = threading.Lock()
        self._r = client or redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), retries),
        )

    def sibling(self, name: str) -> RedisStore:
        """The same server (and connection pool) under the key prefix ``prefix + name + ':'``."""
        opts = {k: v for k, v in self._options.items() if k != "hmac_key"}
        return RedisStore(self.url, f"{self.prefix}{name}:", client=self._r, hmac_key=self.auth, **opts)

    def describe(self) -> str:
        return f"RedisStore({_redact(self.url)}, prefix={self.prefix!r})"

    def ping(self) -> bool:
        """True when the server answers (no exception either way)."""
        try:
            return bool(self._call(self._r.ping))
        except self.backend_errors:
            return False

    # -- primitives -----------------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        """Run one Redis command; fail fast while backing off after a connection failure."""
        if time.monotonic() < self._down_until:
            raise RedisDownError(f"Redis at {_redact(self.url)} was unreachable; retrying in a moment")
        try:
            return fn(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            with self._down_lock:
                self._down_until = time.monotonic() + self.down_backoff_s
            raise

    def _bkey(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _read(self, key: str, offset: int, length: int | None) -> bytes | None:
        if offset == 0 and length is None:
            return self._call(self._r.get, self._bkey(key))
        end = -1 if length is None else offset + length - 1
        data = self._call(self._r.getrange, self._bkey(key), offset, end)
        if offset == 0 and not data:
            return None  # GETRANGE answers "" for a missing key; blobs are never empty
        return data

    def _tx(self, queue) -> list:
        """The replies of the commands ``queue(pipeline)`` adds, run as one MULTI/EXEC transaction."""
        return self._call(lambda: queue(self._r.pipeline(transaction=True)).execute())

    def _write(self, key: str, blob: bytes, overwrite: bool) -> bool:
        bkey, n = self._bkey(key), len(blob)
        set_ok, _ = self._tx(lambda p: p.set(bkey, blob, nx=not overwrite).hset(self.index_key, key, n))
        return bool(set_ok)

    def _exists(self, key: str) -> bool:
        return bool(self._call(self._r.exists, self._bkey(key)))

    def _delete(self, key: str) -> bool:
        deleted, _ = self._tx(lambda p: p.delete(self._bkey(key)).hdel(self.index_key, key))
        return bool(deleted)

    def _keys(self) -> list[str]:
        keys = [k.decode() for k in self._call(self._r.hkeys, self.index_key)]
        if not keys:
            return []

        def exists_all():
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._bkey(k))
            return pipe.execute()

        alive = self._call(exists_all)
        stale = [k for k, a in zip(keys, alive, strict=True) if not a]
        if stale:
            self._call(self._r.hdel, self.index_key, *stale)
        return [k for k, a in zip(keys, alive, strict=True) if a]

    def _nbytes(self) -> int:
        return sum(int(v) for v in self._call(self._r.hvals, self.index_key))

    def _close(self) -> None:
        self._r.close()


def _redact(url: str) -> str:
    """URL without a password, for logs."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
