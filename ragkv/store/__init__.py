"""Chunk KV store: one interface (:class:`ChunkStore`), memory / local dir / Redis / tiered backends.

``store_from_url`` builds one from a URL or config dict:

* ``memory://?max_bytes=2GiB``
* ``file:///var/lib/ragkv/kv?max_bytes=50GB&codec=int8`` (or a bare path)
* ``redis://127.0.0.1:6379/0?prefix=ragkv:kv:&socket_timeout=2``
* ``tiered+file:///path?mem_bytes=1GiB`` / ``tiered+redis://host:6379/0?mem_bytes=512MiB``

Common options: ``codec`` (``raw``, ``int8``, ``int4``, ``video``), ``codecs`` (comma-separated
other codecs the store may decode; by default only its own), ``verify`` (segment digests). The
HMAC key that authenticates blobs is a keyword argument only (``hmac_key=...``), never in a URL.

The store classes and ``store_from_url`` default to the lossless ``raw`` codec (exact KV); the
application stores (``ragkv-server ingest``, the service, the demo) are opened with :func:`default_store`,
which uses :data:`ragkv.store.codecs.DEFAULT_CODEC` unless the URL names a codec.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from ragkv.store.base import (
    BlobStore,
    ChunkStore,
    FingerprintMismatch,
    LayerRangeError,
    StoreFullError,
    StoreWriteError,
)
from ragkv.store.blob import BlobAuth, BlobError, BlobHeader, KVGeometry, OutBufferError, Segment
from ragkv.store.localdir import LocalDirStore
from ragkv.store.memory import MemoryStore
from ragkv.store.tiered import TieredStore

__all__ = [
    "DEFAULT_FILE_STORE_MAX_BYTES",
    "default_store_url",
    "BlobAuth",
    "BlobError",
    "BlobHeader",
    "BlobStore",
    "ChunkStore",
    "FingerprintMismatch",
    "KVGeometry",
    "LayerRangeError",
    "LocalDirStore",
    "MemoryStore",
    "OutBufferError",
    "RedisStore",
    "Segment",
    "StoreFullError",
    "StoreWriteError",
    "TieredStore",
    "default_store",
    "parse_bytes",
    "store_from_url",
]

#: byte-size suffixes (lower case): decimal ``k``/``kb`` ... ``t``/``tb``, binary ``kib`` ... ``tib``
_UNITS = {"": 1, "b": 1} | {
    unit: size
    for i, p in enumerate("kmgt", 1)
    for unit, size in ((p, 1000**i), (f"{p}b", 1000**i), (f"{p}ib", 1024**i))
}
_INT_OPTS = {"max_bytes", "mem_bytes", "retries", "max_staged"}
_FLOAT_OPTS = {"socket_timeout", "connect_timeout", "down_backoff_s", "warn_every_s", "access_flush_s"}
_BOOL_OPTS = {"verify", "fsync"}
_STORE_OPTS = _INT_OPTS | _FLOAT_OPTS | _BOOL_OPTS | {"codec", "codecs", "prefix"}


def __getattr__(name: str):
    if name == "RedisStore":  # redis-py is an optional extra: import it only when asked for
        from ragkv.store.redis_store import RedisStore

        return RedisStore
    raise AttributeError(name)


def parse_bytes(value: str | int | float) -> int:
    """``"512MiB"``, ``"1.5GB"``, ``"1e9"`` or a number -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse byte size {value!r} (examples: 1073741824, 1e9, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


#: size bound of the default store under a RAG's ``data_dir`` (``data_dir/kv``): least recently used
#: KV that no chunk references is evicted first; a write that only evicting referenced KV could fit
#: is refused (:class:`StoreFullError`) and that chunk is recomputed when used
DEFAULT_FILE_STORE_MAX_BYTES = 20 << 30


def default_store_url(data_dir) -> str:
    """The chunk store a RAG uses when none is given: a file store under ``data_dir``, bounded."""
    return f"file://{(Path(data_dir) / 'kv').resolve()}?max_bytes={DEFAULT_FILE_STORE_MAX_BYTES}"


def store_from_url(spec: str | dict | ChunkStore, **overrides) -> ChunkStore:
    """Build a store from a URL (see module docstring), a dict ``{"url": ..., **options}`` or a store."""
    if isinstance(spec, ChunkStore):
        return spec
    if isinstance(spec, dict):
        opts = dict(spec)
        if "url" not in opts:
            raise ValueError(f"store config needs a 'url' key, got {sorted(opts)}")
        url = opts.pop("url")
        return store_from_url(url, **{**opts, **overrides})
    if not isinstance(spec, (str, Path)):
        raise TypeError(f"store spec must be a URL string, dict or ChunkStore, got {type(spec).__name__}")
    url = str(spec)
    scheme, _, _ = url.partition("://")
    if "://" not in url:
        return LocalDirStore(url, **_typed(overrides))
    if scheme.startswith("tiered+"):
        parts = urlsplit(url[len("tiered+") :])
        query = dict(parse_qsl(parts.query))
        mem_bytes = parse_bytes(query.pop("mem_bytes", overrides.pop("mem_bytes", 1 << 30)))
        max_staged = int(query.pop("max_staged", overrides.pop("max_staged", 64)))
        inner = urlunsplit(parts._replace(query=urlencode(query)))
        backend = store_from_url(inner, **overrides)
        if not isinstance(backend, BlobStore):
            raise ValueError(f"tiered store needs a blob backend, got {backend.describe()}")
        return TieredStore(backend, mem_bytes=mem_bytes, max_staged=max_staged)
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    ours = {k: query.pop(k) for k in list(query) if k in _STORE_OPTS}
    opts = _typed({**ours, **overrides})
    if parts.scheme == "memory":
        return MemoryStore(**opts)
    if parts.scheme == "file":
        path = unquote(parts.netloc + parts.path)
        if not path:
            raise ValueError(f"file store URL without a path: {url!r}")
        return LocalDirStore(path, **opts)
    if parts.scheme in ("redis", "rediss", "unix"):
        from ragkv.store.redis_store import RedisStore

        return RedisStore(urlunsplit(parts._replace(query=urlencode(query))), **opts)
    raise ValueError(
        f"unknown store URL scheme {parts.scheme!r} in {url!r} (memory, file, redis, tiered+...)"
    )


def default_store(url: str, model=None, codec: str | None = None, **overrides) -> ChunkStore:
    """An application's store: ``url`` with ``codec`` (default :data:`~ragkv.store.codecs.DEFAULT_CODEC`)
    unless the URL's own ``codec=`` says otherwise.

    A store written by an earlier default stays usable: unless ``codecs=`` is given, the store also
    decodes :data:`~ragkv.store.codecs.LEGACY_CODECS` blobs (``raw``: lossless, bounded size), so an
    existing raw store keeps serving its KV while new chunks are written compactly. With ``model``,
    a ``stepz`` store's steps are calibrated for it once (cached by fingerprint, see
    :func:`ragkv.store.codecs.calibrate.ensure_profile`).
    """
    from ragkv.store.codecs import DEFAULT_CODEC, LEGACY_CODECS

    query = dict(parse_qsl(str(url).partition("?")[2])) if "://" in str(url) else {}
    opts = dict(overrides)
    if "codec" not in query and "codec" not in opts:
        opts["codec"] = codec or DEFAULT_CODEC
    if "codecs" not in query and "codecs" not in opts:
        opts["codecs"] = ",".join(LEGACY_CODECS)
    store = store_from_url(url, **opts)
    if model is not None and getattr(getattr(store, "codec", None), "name", None) == "stepz":
        from ragkv.store.codecs.calibrate import ensure_profile

        ensure_profile(model)
    return store


def _typed(opts: dict) -> dict:
    out = {}
    for k, v in opts.items():
        if k in ("max_bytes", "mem_bytes"):
            out[k] = None if v in (None, "", "none", "None") else parse_bytes(v)
        elif k in _INT_OPTS:
            out[k] = int(v)
        elif k in _FLOAT_OPTS:
            out[k] = float(v)
        elif k in _BOOL_OPTS and isinstance(v, str):
            if v.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"option {k} expects a boolean, got {v!r}")
            out[k] = v.lower() in ("1", "true", "yes")
        else:
            out[k] = v
    return out
