"""The chunk KV type: its content key and the checks that refuse KV from another model or convention."""

import pytest
import torch

from ragkv.kv import CHUNK_CONVENTION_VERSION, ChunkKV, KVMismatchError, chunk_key


def _kv(ids=(5, 6, 7), fp="model-a", layers=2, heads=1, dim=4) -> ChunkKV:
    t = len(ids)
    return ChunkKV(
        token_ids=torch.tensor(ids),
        k=torch.randn(layers, t, heads, dim),
        v=torch.randn(layers, t, heads, dim),
        start_pos=1,
        fingerprint=fp,
    )


def test_the_key_covers_content_model_and_convention():
    kv = _kv()
    assert (
        kv.key == chunk_key([5, 6, 7], "model-a") == chunk_key([5, 6, 7], "model-a", CHUNK_CONVENTION_VERSION)
    )
    others = {
        chunk_key([5, 6, 8], "model-a"),
        chunk_key([5, 6, 7], "model-b"),
        chunk_key([5, 6, 7], "model-a", CHUNK_CONVENTION_VERSION + 1),
        chunk_key([5, 6], "model-a"),
    }
    assert kv.key not in others and len(others) == 4


def test_kv_from_another_model_convention_or_shape_is_refused():
    kv = _kv()
    kv.check_compatible("model-a", 2, 1, 4)  # its own model: accepted
    with pytest.raises(KVMismatchError, match="not by this model"):
        kv.check_compatible("model-b", 2, 1, 4)
    with pytest.raises(KVMismatchError, match="shape"):
        kv.check_compatible("model-a", 3, 1, 4)
    old = _kv()
    old.convention = CHUNK_CONVENTION_VERSION + 1
    with pytest.raises(KVMismatchError, match="convention"):
        old.check_compatible("model-a", 2, 1, 4)


def test_to_converts_the_tensors_and_keeps_the_identity():
    kv = _kv()
    half = kv.to(dtype=torch.float16)
    assert half.k.dtype == half.v.dtype == torch.float16 and half.key == kv.key
    assert half.layer_kv(1)[0].shape == (3, 1, 4) and half.nbytes() == kv.nbytes() // 2
    assert half.num_tokens == 3 and half.num_layers == 2
