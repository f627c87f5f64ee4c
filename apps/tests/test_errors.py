"""Errors are visible: data faults are counted misses, bugs propagate, server faults are 5xx and logged."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ragkv.kv import KVMismatchError
from ragkv.model.forward import compute_chunk_kv
from ragkv.store import MemoryStore
from ragkv.testing import stories_model


class _BuggyStore(MemoryStore):
    """A memory store whose read path has a programming error (fault injection on a real store)."""

    def _read(self, key, offset, length):
        raise TypeError("a bug in the read path")


def test_a_bug_in_a_store_read_propagates_instead_of_passing_for_a_miss():
    """Bug: any exception in a store read became a cache miss, so a codec bug showed up only as
    "blend recomputes everything"."""
    model = stories_model()
    store = _BuggyStore()
    kv = compute_chunk_kv(model, [5, 6, 7])
    store.put(kv)
    with pytest.raises(TypeError, match="a bug"):
        store.get(kv.key, model.fingerprint)


def test_corrupt_data_is_still_a_counted_miss(tmp_path):
    from ragkv.store import LocalDirStore

    model = stories_model()
    store = LocalDirStore(tmp_path)
    kv = compute_chunk_kv(model, [5, 6, 7])
    store.put(kv)
    path = store.path_of(kv.key)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # a flipped byte in the KV data: its segment digest fails
    path.write_bytes(bytes(blob))
    assert store.get(kv.key, model.fingerprint) is None
    assert store.stats()["corrupt"] >= 1


def test_server_faults_are_5xx_and_logged_request_faults_are_4xx(caplog):
    from ragkv_server.server import report

    with caplog.at_level(logging.ERROR, logger="ragkv"):
        status, kind, _ = report(KVMismatchError("KV of model a, asked by model b"))
        assert (status, kind) == (500, "internal_error")  # was an unlogged 422
        try:
            np.zeros(-1)  # a ValueError raised inside a library: a server fault
        except ValueError as e:
            assert report(e)[0] == 500
        n = len(caplog.records)
        assert n == 2 and all(r.exc_info for r in caplog.records)
        assert report(ValueError("empty question"))[0] == 422  # ours: the request's fault, not logged
        assert len(caplog.records) == n
