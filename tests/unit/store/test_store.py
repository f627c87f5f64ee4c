"""Chunk KV store backends: round trips, per-layer reads, LRU, persistence, corruption, Redis outages."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ragkv.kv.chunk import ChunkKV
from ragkv.store import (
    LocalDirStore,
    MemoryStore,
    TieredStore,
    parse_bytes,
    store_from_url,
)
from ragkv.store.blob import HEAD_READ_SIZE, PREFIX_SIZE
from tests.helpers import REPO

FP = "f" * 64
L, T, H, D = 4, 16, 2, 8
BACKENDS = ["memory", "file", "redis", "tiered+file", "tiered+redis"]


def make_chunk(
    seed: int, num_layers: int = L, tokens: int = T, dtype=torch.float16, fingerprint: str = FP, **kw
):
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(
        token_ids=torch.randint(0, 32000, (tokens,), generator=g),
        k=torch.randn(num_layers, tokens, H, D, generator=g).to(dtype),
        v=torch.randn(num_layers, tokens, H, D, generator=g).to(dtype),
        start_pos=1,
        fingerprint=fingerprint,
        meta={"doc": f"d{seed}"},
        **kw,
    )


def open_store(kind: str, request, tmp_path: Path, **opts):
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    if kind == "memory":
        return store_from_url("memory://", **opts)
    if kind in ("file", "tiered+file"):
        return store_from_url(f"{kind}://{tmp_path / 'kv'}", **opts)
    server = request.getfixturevalue("redis_server")
    return store_from_url(f"{kind}://127.0.0.1:{server.port}/0?prefix={prefix}", **opts)


def store_with_chunk(kind: str, request, tmp_path: Path, *chunk_args, store_opts=None, **chunk_kw):
    """A fresh store of ``kind`` (:func:`open_store`) holding ``make_chunk(*chunk_args, **chunk_kw)``."""
    store = open_store(kind, request, tmp_path, **(store_opts or {}))
    chunk = make_chunk(*chunk_args, **chunk_kw)
    store.put(chunk)
    return store, chunk


def assert_same(a: ChunkKV, b: ChunkKV) -> None:
    assert torch.equal(a.token_ids, b.token_ids)
    assert a.k.dtype == b.k.dtype and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert (a.start_pos, a.fingerprint, a.convention, a.meta) == (
        b.start_pos,
        b.fingerprint,
        b.convention,
        b.meta,
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "ragkv.store" and r.levelno == logging.WARNING
    ]


# -- round trips and partial reads ------------------------------------------------------------------
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_raw_round_trip_is_bit_exact(kind, dtype, request, tmp_path):
    store = open_store(kind, request, tmp_path)
    chunk = make_chunk(1, dtype=dtype)
    assert not store.contains(chunk.key) and store.get(chunk.key, FP) is None
    assert store.put(chunk)
    assert store.contains(chunk.key) and store.keys() == [chunk.key]
    got = store.get(chunk.key, FP)
    assert_same(got, chunk)
    got.k.zero_()  # the caller owns what it gets: the stored chunk is unaffected
    assert_same(store.get(chunk.key, FP), chunk)
    assert store.get(chunk.key, FP, dtype=torch.float64).k.dtype == torch.float64
    hdr = store.header(chunk.key)
    assert hdr.shape == (L, T, H, D) and hdr.codec == "raw" and hdr.token_ids == chunk.token_ids.tolist()
    assert store.nbytes() == hdr.total_size
    assert store.delete(chunk.key) and not store.contains(chunk.key) and store.get(chunk.key, FP) is None
    st = store.stats()
    assert st["hits"] >= 3 and st["misses"] == 2 and st["errors"] == 0
    store.close()


@pytest.mark.parametrize("kind", BACKENDS)
def test_int8_round_trip_within_bound_and_smaller(kind, request, tmp_path):
    store, chunk = store_with_chunk(kind, request, tmp_path, 2, tokens=64, store_opts={"codec": "int8"})
    got = store.get(chunk.key, FP)
    assert got.k.dtype == torch.float16
    # gaussian data, 8 bits: relative error ~0.5%; 1.5% is a hard upper bound for this data
    assert rel_err(got.k, chunk.k) < 0.015 and rel_err(got.v, chunk.v) < 0.015
    hdr = store.header(chunk.key)
    # head_dim 8 makes per-token V scales costly (12 bytes per 8 values); real head dims are 64-128
    assert hdr.codec == "int8" and hdr.data_size < 0.72 * chunk.nbytes()
    store.close()


@pytest.mark.parametrize("kind", ["memory", "file", "redis"])
def test_per_layer_reads_equal_slices_and_read_fewer_bytes(kind, request, tmp_path):
    store, chunk = store_with_chunk(kind, request, tmp_path, 3, num_layers=8, tokens=64)
    store.header(chunk.key)  # warm the header cache, so the next reads are tensor bytes only
    before = store.stats()["bytes_read"]
    k, v = store.load_layers(chunk.key, 5, 6, FP)
    one_layer = store.stats()["bytes_read"] - before
    assert torch.equal(k, chunk.k[5:6]) and torch.equal(v, chunk.v[5:6])
    full = store.get(chunk.key, FP)
    whole = store.stats()["bytes_read"] - before - one_layer
    assert torch.equal(full.k[5:6], k)
    layer_bytes = 2 * T * 4 * H * D * 2  # K+V of one layer, 64 tokens, fp16
    assert layer_bytes <= one_layer < layer_bytes + 64 and one_layer * 7 < whole
    k, v = store.load_layers(chunk.key, 2, 7, FP, dtype=torch.float32)
    assert (
        k.dtype == torch.float32
        and torch.equal(k, chunk.k[2:7].float())
        and torch.equal(v, chunk.v[2:7].float())
    )
    with pytest.raises(ValueError):
        store.load_layers(chunk.key, 6, 9, FP)
    with pytest.raises(ValueError):
        store.load_layers(chunk.key, 3, 3, FP)
    assert store.load_layers("0" * 64, 0, 1, FP) is None


@pytest.mark.parametrize("codec,group", [("raw", 1), ("raw", 3), ("int8", 1)])
def test_load_layers_into_caller_buffers(codec, group, tmp_path):
    from ragkv.store import OutBufferError

    store = LocalDirStore(
        tmp_path, codec=codec, codec_options={"group_size": group} if codec == "raw" else None
    )
    chunk = make_chunk(8, num_layers=7, tokens=64)
    store.put(chunk)
    expect = store.get(chunk.key, FP)  # raw: the chunk itself; int8: its decoded version
    k_buf, v_buf = (
        torch.empty(2, 64, H, D, dtype=torch.float16),
        torch.empty(2, 64, H, D, dtype=torch.float16),
    )
    for a in range(0, 6):
        k, v = store.load_layers(chunk.key, a, a + 2, FP, out=(k_buf, v_buf))
        assert k is k_buf and v is v_buf
        assert torch.equal(k_buf, expect.k[a : a + 2]) and torch.equal(v_buf, expect.v[a : a + 2])
    k32, v32 = torch.zeros(3, 64, H, D), torch.zeros(3, 64, H, D)  # conversion on the way in
    store.load_layers(chunk.key, 4, 7, FP, out=(k32, v32))
    expect32 = store.get(chunk.key, FP, dtype=torch.float32)  # int8 dequantizes straight to fp32
    assert torch.equal(k32, expect32.k[4:7]) and torch.equal(v32, expect32.v[4:7])
    with pytest.raises(OutBufferError):
        store.load_layers(chunk.key, 0, 3, FP, out=(k_buf, v_buf))
    tiered = TieredStore(store)
    assert tiered.load_layers(chunk.key, 1, 3, FP, out=(k_buf, v_buf))[0] is k_buf
    assert torch.equal(v_buf, expect.v[1:3])


def test_header_reads_no_tensor_bytes(tmp_path):
    store = LocalDirStore(tmp_path)
    chunk = make_chunk(4, num_layers=8, tokens=512)
    store.put(chunk)
    hdr = store.header(chunk.key)
    assert (hdr.num_layers, hdr.num_tokens, hdr.fingerprint, hdr.start_pos) == (8, 512, FP, 1)
    assert hdr.meta == {"doc": "d4"} and len(hdr.segments) == 8
    assert store.stats()["bytes_read"] <= HEAD_READ_SIZE < chunk.nbytes() // 4


@pytest.mark.parametrize("kind", ["memory", "file", "redis"])
def test_header_longer_than_the_first_read(kind, request, tmp_path):
    # ~24 KB of token ids in the header
    store, chunk = store_with_chunk(kind, request, tmp_path, 9, num_layers=2, tokens=4000)
    hdr = store.header(chunk.key)
    assert hdr.data_start > HEAD_READ_SIZE and hdr.token_ids == chunk.token_ids.tolist()
    k, v = store.load_layers(chunk.key, 1, 2, FP)
    assert torch.equal(k, chunk.k[1:2]) and torch.equal(v, chunk.v[1:2])
    assert_same(store.get(chunk.key, FP), chunk)


def test_grouped_codec_segments_cover_layer_groups(tmp_path):
    store = LocalDirStore(tmp_path, codec="raw", codec_options={"group_size": 3})
    chunk = make_chunk(5, num_layers=7)
    store.put(chunk)
    assert [(s.start, s.stop) for s in store.header(chunk.key).segments] == [(0, 3), (3, 6), (6, 7)]
    for a, b in [(0, 1), (2, 4), (1, 7), (6, 7)]:
        k, v = store.load_layers(chunk.key, a, b, FP)
        assert torch.equal(k, chunk.k[a:b]) and torch.equal(v, chunk.v[a:b])


def test_header_records_the_codec_so_a_store_with_another_default_decodes(tmp_path):
    chunk = make_chunk(6, tokens=64)
    LocalDirStore(tmp_path, codec="int8").put(chunk)
    reopened = LocalDirStore(tmp_path, codecs="int8")  # default codec raw now, int8 allowed
    assert reopened.header(chunk.key).codec == "int8"
    got = reopened.get(chunk.key, FP)
    assert rel_err(got.k, chunk.k) < 0.015
    strict = LocalDirStore(tmp_path)  # only its own codec: an int8 blob is unusable (recomputed)
    assert strict.get(chunk.key, FP) is None and strict.known_corrupt(chunk.key)


def test_an_old_raw_store_keeps_serving_after_the_default_codec_changed(tmp_path):
    """A store written with the old default (raw) under the new application default: raw blobs still
    decode exactly, new chunks are written compactly; a store without the legacy allowance recomputes
    a raw chunk (a miss) and rewrites it with its own codec, without crashing."""
    from ragkv.store import default_store
    from ragkv.store.codecs import DEFAULT_CODEC

    old_chunk, new_chunk = make_chunk(40, tokens=64, dtype=torch.float32), make_chunk(41, tokens=64)
    url = f"file://{tmp_path / 'kv'}"
    assert store_from_url(url).put(old_chunk)  # the old default: raw
    app = default_store(url)
    assert app.codec.name == DEFAULT_CODEC != "raw" and "raw" in app.allowed_codecs
    assert app.header(old_chunk.key).codec == "raw"
    assert_same(app.get(old_chunk.key, FP), old_chunk)  # still decoded, bit for bit
    k, v = app.load_layers(old_chunk.key, 1, 3, FP)
    assert torch.equal(k, old_chunk.k[1:3]) and torch.equal(v, old_chunk.v[1:3])
    assert app.put(new_chunk) and app.header(new_chunk.key).codec == DEFAULT_CODEC
    got = app.get(new_chunk.key, FP)
    assert got.k.dtype == new_chunk.k.dtype and rel_err(got.k, new_chunk.k) < 0.1
    assert rel_err(got.v, new_chunk.v) < 0.1
    raw_bytes = old_chunk.nbytes()
    assert app.stats()["bytes_written"] < raw_bytes / 4  # fp16 chunk vs fp32, still far smaller

    strict = LocalDirStore(tmp_path / "kv", codec=DEFAULT_CODEC)  # no legacy codecs allowed
    assert strict.get(old_chunk.key, FP) is None and strict.known_corrupt(old_chunk.key)
    assert strict.put(old_chunk)  # the recomputed chunk replaces the raw blob
    assert strict.header(old_chunk.key).codec == DEFAULT_CODEC
    assert rel_err(strict.get(old_chunk.key, FP).k, old_chunk.k) < 0.1
    # the URL's own codec wins, raw stays an option
    assert default_store(url + "?codec=raw").codec.name == "raw"
    assert default_store(url, codec="int8").codec.name == "int8"
    assert default_store(url + "?codecs=int8").allowed_codecs == {DEFAULT_CODEC, "int8"}


# -- writes: idempotence, bounds, persistence -------------------------------------------------------
@pytest.mark.parametrize("kind", BACKENDS)
def test_put_is_idempotent(kind, request, tmp_path):
    store = open_store(kind, request, tmp_path)
    chunk = make_chunk(7)
    assert store.put(chunk)
    written = store.stats()["bytes_written"]
    assert store.put(chunk) and store.put(make_chunk(7))
    st = store.stats()
    assert st["bytes_written"] == written and st["puts_skipped"] == 2
    assert store.keys() == [chunk.key]


def test_put_rejects_invalid_chunks_and_keys():
    store = MemoryStore()
    chunk = make_chunk(8)
    with pytest.raises(ValueError):
        store.put(ChunkKV(chunk.token_ids, chunk.k, chunk.v[:, :3], 1, FP))
    with pytest.raises(ValueError):
        store.put(ChunkKV(chunk.token_ids[:3], chunk.k, chunk.v, 1, FP))
    with pytest.raises(ValueError):
        store.put(ChunkKV(chunk.token_ids, chunk.k, chunk.v, 1, FP, meta={"x": object()}))
    with pytest.raises(ValueError):
        store.put_blob(chunk.key, b"not a blob at all")
    for key in ("../etc/passwd", "a/b", "", ".hidden", "x" * 300):
        with pytest.raises(ValueError):
            store.get(key, FP)
    assert store.keys() == [] and store.stats()["puts"] == 0


def test_memory_lru_eviction_by_bytes():
    chunks = [make_chunk(10 + i) for i in range(4)]
    probe = MemoryStore()
    probe.put(chunks[0])
    size = probe.nbytes()
    store = MemoryStore(max_bytes=int(2.5 * size))
    store.put(chunks[0])
    store.put(chunks[1])
    assert store.get(chunks[0].key, FP) is not None  # 0 is now more recent than 1
    store.put(chunks[2])
    assert store.keys() == [chunks[0].key, chunks[2].key]
    assert store.nbytes() <= 2.5 * size and store.stats()["evictions"] == 1
    store.load_layers(chunks[0].key, 0, 1, FP)  # per-layer reads count as use too
    store.put(chunks[3])
    assert set(store.keys()) == {chunks[0].key, chunks[3].key}


def test_memory_refuses_a_blob_larger_than_its_bound(caplog):
    store = MemoryStore(max_bytes=1000)
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.put(make_chunk(14)) is False
    assert any("exceeds" in m for m in warnings_of(caplog)) and store.keys() == []


def test_localdir_lru_eviction_by_bytes(tmp_path):
    chunks = [make_chunk(20 + i) for i in range(4)]
    size = len(_encoded(chunks[0]))
    store = LocalDirStore(tmp_path, max_bytes=int(2.5 * size), access_flush_s=0.0)
    store.put(chunks[0])
    time.sleep(0.01)
    store.put(chunks[1])
    time.sleep(0.01)
    assert store.load_layers(chunks[0].key, 1, 2, FP) is not None  # 0 is now more recent than 1
    time.sleep(0.01)
    store.put(chunks[2])
    assert set(store.keys()) == {chunks[0].key, chunks[2].key}
    assert not store.path_of(chunks[1].key).exists()
    assert store.nbytes() <= 2.5 * size and store.stats()["evictions"] == 1
    blobs = list(tmp_path.glob("??/*.kvb"))
    assert len(blobs) == 2


def _encoded(chunk: ChunkKV) -> bytes:
    from ragkv.store.blob import encode_chunk
    from ragkv.store.codecs import get_codec

    return encode_chunk(chunk, get_codec("raw"))


def test_localdir_survives_restart_without_rewriting(tmp_path):
    chunks = [make_chunk(30 + i) for i in range(3)]
    store = LocalDirStore(tmp_path)
    for c in chunks:
        store.put(c)
    store.close()
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.glob("??/*.kvb")}

    again = LocalDirStore(tmp_path)
    assert sorted(again.keys()) == sorted(c.key for c in chunks) and all(
        again.contains(c.key) for c in chunks
    )
    assert again.stats()["bytes_read"] == 0  # contains/keys come from the index, not the blobs
    assert again.nbytes() == sum(p.stat().st_size for p in mtimes)
    for c in chunks:
        assert again.put(c)
        assert_same(again.get(c.key, FP), c)
    assert again.stats()["bytes_written"] == 0 and again.stats()["puts_skipped"] == 3
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("??/*.kvb")} == mtimes
    again.close()

    # a lost index is rebuilt from the blobs' headers
    (tmp_path / "index.sqlite").unlink()
    for extra in tmp_path.glob("index.sqlite-*"):
        extra.unlink()
    rebuilt = LocalDirStore(tmp_path)
    assert sorted(rebuilt.keys()) == sorted(c.key for c in chunks)
    assert_same(rebuilt.get(chunks[1].key, FP), chunks[1])


def test_localdir_writes_are_atomic_and_leave_no_temp_files(tmp_path):
    store = LocalDirStore(tmp_path, fsync=True)
    chunk = make_chunk(35)
    store.put(chunk)
    shard = store.path_of(chunk.key).parent
    assert [p.name for p in shard.iterdir()] == [f"{chunk.key}.kvb"]


def test_two_localdir_instances_share_a_directory(tmp_path):
    a, b = LocalDirStore(tmp_path), LocalDirStore(tmp_path)
    c1, c2 = make_chunk(36), make_chunk(37)
    a.put(c1)
    b.put(c2)
    assert_same(b.get(c1.key, FP), c1) and sorted(a.keys()) == sorted([c1.key, c2.key])
    assert a.delete(c2.key) and b.get(c2.key, FP) is None and not b.contains(c2.key)


# -- corruption, truncation, mismatches -------------------------------------------------------------
def _flip_byte(store, key: str, offset: int) -> None:
    if isinstance(store, LocalDirStore):
        with open(store.path_of(key), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x5A]))
    else:
        r, bkey = store._r, store._bkey(key)
        r.setrange(bkey, offset, bytes([r.getrange(bkey, offset, offset)[0] ^ 0x5A]))


def _truncate(store, key: str, size: int) -> None:
    if isinstance(store, LocalDirStore):
        os.truncate(store.path_of(key), size)
    else:
        r, bkey = store._r, store._bkey(key)
        r.set(bkey, r.getrange(bkey, 0, size - 1))


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_flipped_byte_is_a_miss_and_other_segments_still_read(kind, request, tmp_path, caplog):
    store, chunk = store_with_chunk(kind, request, tmp_path, 40)
    hdr = store.header(chunk.key)
    seg = hdr.segments[2]
    _flip_byte(store, chunk.key, hdr.data_start + seg.offset + seg.length // 2)
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.load_layers(chunk.key, 2, 3, FP) is None
        assert store.get(chunk.key, FP) is None
    msgs = warnings_of(caplog)
    assert len(msgs) == 2 and all("digest mismatch" in m for m in msgs)
    k, v = store.load_layers(chunk.key, 1, 2, FP)  # an intact segment of the same blob
    assert torch.equal(k, chunk.k[1:2]) and torch.equal(v, chunk.v[1:2])
    assert store.stats()["corrupt"] == 2
    # the caller recomputes and puts again: the corrupt blob is replaced, not skipped
    assert store.put(chunk)
    assert_same(store.get(chunk.key, FP), chunk)


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_flipped_header_byte_is_a_miss(kind, request, tmp_path, caplog):
    store, chunk = store_with_chunk(kind, request, tmp_path, 41)
    _flip_byte(store, chunk.key, PREFIX_SIZE + 5)
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.header(chunk.key) is None
        assert store.load_layers(chunk.key, 0, 1, FP) is None
    assert any("header fails sha256 verification" in m for m in warnings_of(caplog))


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_truncated_blob_is_a_miss(kind, request, tmp_path, caplog):
    store, chunk = store_with_chunk(kind, request, tmp_path, 42)
    hdr = store.header(chunk.key)
    last = hdr.segments[-1]
    _truncate(store, chunk.key, hdr.data_start + last.offset + 10)
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.get(chunk.key, FP) is None
        assert store.load_layers(chunk.key, L - 1, L, FP) is None
    assert (
        all("truncated" in m or "bytes" in m for m in warnings_of(caplog)) and len(warnings_of(caplog)) == 2
    )
    assert torch.equal(store.load_layers(chunk.key, 0, 1, FP)[0], chunk.k[0:1])
    _truncate(store, chunk.key, 9)  # not even a whole prefix
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.load_layers(chunk.key, 0, 1, FP) is None
        assert store.get(chunk.key, FP) is None


def test_empty_file_is_a_miss_and_gets_rewritten(tmp_path, caplog):
    store = LocalDirStore(tmp_path)
    chunk = make_chunk(43)
    store.put(chunk)
    _truncate(store, chunk.key, 0)  # what a torn write can leave after a crash without fsync
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.get(chunk.key, FP) is None
    assert warnings_of(caplog)
    assert store.put(chunk) and store.stats()["puts"] == 2
    assert_same(store.get(chunk.key, FP), chunk)


@pytest.mark.parametrize("kind", BACKENDS)
def test_wrong_fingerprint_or_convention_is_a_miss(kind, request, tmp_path, caplog):
    store = open_store(kind, request, tmp_path)
    chunk = make_chunk(44)
    foreign = make_chunk(45, convention=99)
    store.put(chunk)
    store.put(foreign)
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.get(chunk.key, "0" * 64) is None
        assert store.load_layers(chunk.key, 0, 1, "0" * 64) is None
        assert store.get(foreign.key, FP) is None
    msgs = warnings_of(caplog)
    assert any("computed by model" in m for m in msgs) and any("convention" in m for m in msgs)
    assert_same(store.get(chunk.key, FP), chunk)  # the right model still gets its KV


def test_blob_under_the_wrong_key_is_a_miss(tmp_path, caplog):
    store = LocalDirStore(tmp_path)
    a, b = make_chunk(46), make_chunk(47)
    store.put(a)
    store.put(b)
    os.replace(store.path_of(a.key), store.path_of(b.key))
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        assert store.get(b.key, FP) is None
    assert any("holds chunk" in m for m in warnings_of(caplog))


# -- tiering -------------------------------------------------------------------------------------
def test_tiered_read_through_promotes_whole_and_layerwise_reads(tmp_path):
    backend = LocalDirStore(tmp_path)
    c1, c2 = make_chunk(50), make_chunk(51)
    backend.put(c1)
    backend.put(c2)
    tiered = TieredStore(backend, mem_bytes=1 << 20)
    assert tiered.keys() == sorted([c1.key, c2.key]) and not tiered.memory.contains(c1.key)
    assert_same(tiered.get(c1.key, FP), c1)
    assert tiered.memory.contains(c1.key)
    read = backend.stats()["bytes_read"]
    assert_same(tiered.get(c1.key, FP), c1)
    assert backend.stats()["bytes_read"] == read  # second read served from memory
    for layer in range(L):  # pipelined loading reads layer by layer; promoted after the last one
        assert not tiered.memory.contains(c2.key)
        k, _ = tiered.load_layers(c2.key, layer, layer + 1, FP)
        assert torch.equal(k, c2.k[layer : layer + 1])
    assert tiered.memory.contains(c2.key)
    assert_same(tiered.memory.get(c2.key, FP), c2)
    st = tiered.stats()
    assert st["memory_hits"] == 1 and st["backend_hits"] == 1 + L and st["misses"] == 0


def test_tiered_write_through(tmp_path):
    tiered = store_from_url(f"tiered+file://{tmp_path}?mem_bytes=4MiB")
    chunk = make_chunk(52)
    assert tiered.put(chunk)
    assert tiered.memory.contains(chunk.key) and tiered.backend.contains(chunk.key)
    assert tiered.memory.max_bytes == 4 << 20
    assert_same(LocalDirStore(tmp_path).get(chunk.key, FP), chunk)


# -- Redis: processes and outages ------------------------------------------------------------------
@pytest.mark.slow  # two processes
def test_two_processes_share_one_redis_store(redis_server):
    from ragkv.store.redis_store import RedisStore

    prefix = f"mp{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.url, prefix=prefix)
    mine = make_chunk(60)
    assert store.put(mine)
    child = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from tests.unit.store.test_store import make_chunk, FP
        from ragkv.store import store_from_url
        store = store_from_url({redis_server.url + "?prefix=" + prefix!r})
        parent = make_chunk(60)
        got = store.get(parent.key, FP)
        assert got is not None and torch.equal(got.k, parent.k) and torch.equal(got.v, parent.v), "parent chunk"
        assert store.put(make_chunk(61))
        print("child ok", store.stats()["hits"])
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "child ok 1" in out.stdout
    theirs = make_chunk(61)
    assert_same(store.get(theirs.key, FP), theirs)
    assert sorted(store.keys()) == sorted([mine.key, theirs.key])


def test_redis_killed_mid_run_gives_misses_and_one_warning(make_redis_server, caplog, monkeypatch):
    """A killed Redis: every call is a miss or a failed put, with one warning. After the first failed
    call no call touches the network until ``down_backoff_s`` is over (a query with 6 chunks x 32
    layers must not wait 192 connect timeouts): connection attempts are counted while the store's
    clock stands still, then the clock is moved past the back-off and the store reconnects."""
    import redis

    from ragkv.store import redis_store
    from ragkv.store.redis_store import RedisStore

    now = [1000.0]  # the store's clock (its back-off deadline), moved by the test only
    monkeypatch.setattr(redis_store, "time", SimpleNamespace(monotonic=lambda: now[0]))
    connects: list[int] = []
    connect = redis.connection.AbstractConnection.connect
    monkeypatch.setattr(
        redis.connection.AbstractConnection, "connect", lambda c: connects.append(1) or connect(c)
    )
    server = make_redis_server()
    store = RedisStore(server.url, prefix="kill:", down_backoff_s=0.3, warn_every_s=60.0, socket_timeout=1.0)
    a, b = make_chunk(70), make_chunk(71)
    assert store.put(a) and store.get(a.key, FP) is not None
    server.kill()
    with caplog.at_level(logging.WARNING, "ragkv.store"):
        before = len(connects)
        assert store.get(a.key, FP) is None
        first = len(connects)
        assert 1 <= first - before <= 2  # the failed call: one attempt and its one retry at most
        for layer in range(L):
            assert store.load_layers(a.key, layer, layer + 1, FP) is None
        assert store.put(b) is False
        assert store.contains(a.key) is False and store.keys() == [] and store.nbytes() == 0
        assert store.header(a.key) is None and store.ping() is False
    assert len(connects) == first  # backing off: none of those calls tried to connect
    msgs = warnings_of(caplog)
    assert len(msgs) == 1 and "unavailable" in msgs[0] and "recomputed" in msgs[0]  # rate-limited
    st = store.stats()
    assert st["errors"] >= 8 and st["put_errors"] == 1 and st["misses"] >= 5

    server.start()  # back (empty: no persistence)
    assert store.get(a.key, FP) is None and len(connects) == first  # still backing off: not asked
    now[0] += 0.3  # the back-off is over: the store reconnects
    assert store.get(a.key, FP) is None and len(connects) > first
    assert store.put(b)
    assert_same(store.get(b.key, FP), b)


def test_tiered_memory_keeps_serving_when_redis_dies(make_redis_server):
    server = make_redis_server()
    tiered = store_from_url(f"tiered+{server.url}?mem_bytes=1MiB&down_backoff_s=0.2")
    hot = make_chunk(72)
    tiered.put(hot)
    server.kill()
    assert_same(tiered.get(hot.key, FP), hot)
    assert torch.equal(tiered.load_layers(hot.key, 1, 3, FP)[1], hot.v[1:3])
    assert tiered.get(make_chunk(73).key, FP) is None
    assert tiered.put(make_chunk(74))  # kept in memory although the backend is down


# -- concurrency -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "file", "redis", "tiered+file"])
def test_concurrent_puts_and_gets(kind, request, tmp_path):
    store = open_store(kind, request, tmp_path)
    chunks = [make_chunk(100 + i, tokens=8) for i in range(24)]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(w, len(chunks), 4):
                assert store.put(chunks[i])
            for c in chunks:  # everyone reads everything, some not written yet
                got = store.get(c.key, FP)
                if got is not None:
                    assert torch.equal(got.k, c.k) and torch.equal(got.v, c.v)
                kv = store.load_layers(c.key, 1, 2, FP)
                if kv is not None:
                    assert torch.equal(kv[0], c.k[1:2])
            for c in chunks[w::4]:
                assert store.put(c)  # racing idempotent re-puts
        except BaseException as e:  # noqa: BLE001 - collected for the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(store.keys()) == sorted(c.key for c in chunks)
    assert all(store.get(c.key, FP) is not None for c in chunks)
    assert store.stats()["errors"] == 0


# -- configuration ----------------------------------------------------------------------------------
def test_store_from_url_and_parse_bytes(tmp_path):
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes(123) == 123
    with pytest.raises(ValueError):
        parse_bytes("lots")
    m = store_from_url("memory://?max_bytes=2MiB&codec=int8")
    assert isinstance(m, MemoryStore) and m.max_bytes == 2 << 20 and m.codec.name == "int8"
    f = store_from_url(str(tmp_path / "a"))
    assert isinstance(f, LocalDirStore) and f.root == (tmp_path / "a").resolve()
    f2 = store_from_url({"url": f"file://{tmp_path / 'b'}", "max_bytes": "1GiB", "fsync": "true"})
    assert isinstance(f2, LocalDirStore) and f2.max_bytes == 1 << 30 and f2.fsync is True
    t = store_from_url(f"tiered+file://{tmp_path / 'c'}?mem_bytes=3MiB&codec=int8")
    assert isinstance(t, TieredStore) and t.memory.max_bytes == 3 << 20 and t.backend.codec.name == "int8"
    assert store_from_url(t) is t
    for bad in ("ftp://x", "memory://?max_bytes=huge", {"path": "x"}, f"file://{tmp_path}?fsync=maybe"):
        with pytest.raises(ValueError):
            store_from_url(bad)


def test_store_from_url_redis(redis_server):
    r = store_from_url(f"{redis_server.url}?prefix=cfg:&socket_timeout=0.5&codec=int4")
    assert type(r).__name__ == "RedisStore" and r.prefix == "cfg:" and r.codec.name == "int4" and r.ping()
    assert r.describe() == f"RedisStore({redis_server.url}, prefix='cfg:')"
