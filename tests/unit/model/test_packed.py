"""Prefill's GEMMs on prepacked weights (ragkv/model/packed.py): the same products as ``F.linear`` up to
rounding, a row's bits independent of the rows beside it, and never a stale copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragkv.blend.kvtree import tree_root
from ragkv.model import random_model
from ragkv.model.packed import PackedWeight, linear, packing_enabled

needs_packing = pytest.mark.skipif(not packing_enabled(), reason="no oneDNN packed linear in this torch")


@needs_packing
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536)])
def test_rows_get_the_same_bits_whatever_rows_share_the_call(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    slot = PackedWeight(w)
    x = torch.randn(400, shape[1], generator=g)
    ref = torch.cat([linear(x[i : i + 16], w, slot) for i in range(0, 400, 16)])
    torch.testing.assert_close(ref, F.linear(x, w), rtol=1e-4, atol=1e-3)  # rounding apart
    for n in [*range(2, 40), 63, 64, 65, 127, 257, 400]:
        assert torch.equal(linear(x[:n], w, slot), ref[:n]), n
    for at in (3, 17, 100):
        assert torch.equal(linear(x[at : at + 37], w, slot), ref[at : at + 37]), at


@needs_packing
def test_a_weight_changed_or_replaced_is_packed_again():
    w = torch.randn(64, 32)
    slot = PackedWeight(w)
    x = torch.randn(8, 32)
    before = linear(x, w, slot)
    w.mul_(2.0)  # in place: its version counter moves
    torch.testing.assert_close(linear(x, w, slot), 2.0 * before, rtol=1e-5, atol=1e-5)
    other = torch.randn(64, 32)  # another tensor in its place
    torch.testing.assert_close(linear(x, other, slot), F.linear(x, other), rtol=1e-5, atol=1e-5)


def test_off_or_unpackable_is_plain_f_linear(monkeypatch):
    monkeypatch.setenv("RAGKV_PACKED_GEMM", "0")
    w, x = torch.randn(64, 32), torch.randn(8, 32)
    slot = PackedWeight(w)
    assert slot.packed is None and torch.equal(linear(x, w, slot), F.linear(x, w))
    m = random_model("llama", seed=1)
    assert m.gemm == "aten"
    w16 = torch.randn(64, 32, dtype=torch.bfloat16)  # only float32 is packed
    assert PackedWeight(w16).packed is None


@needs_packing
def test_the_tree_root_names_the_gemm(monkeypatch):
    """Pages of packed and plain GEMMs differ in their last bits: they never match each other."""
    packed = random_model("llama", seed=1)
    monkeypatch.setenv("RAGKV_PACKED_GEMM", "0")
    plain = random_model("llama", seed=1)
    assert (packed.gemm, plain.gemm) == ("onednn-packed", "aten")
    assert packed.fingerprint == plain.fingerprint and tree_root(packed) != tree_root(plain)


@needs_packing
def test_weights_made_in_inference_mode_or_needing_gradients():
    """An inference-mode weight keeps no version counter: it is packed all the same; a weight or input
    that needs gradients takes the plain path (no autograd through the packed op)."""
    with torch.inference_mode():
        w = torch.randn(64, 32)
        slot = PackedWeight(w)
        x = torch.randn(8, 32)
        torch.testing.assert_close(linear(x, w, slot), F.linear(x, w), rtol=1e-5, atol=1e-5)
    wg = torch.randn(64, 32, requires_grad=True)
    out = linear(torch.randn(8, 32), wg, PackedWeight(wg.detach()))
    out.sum().backward()
    assert wg.grad is not None
