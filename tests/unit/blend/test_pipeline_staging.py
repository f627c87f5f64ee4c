"""The GPU paths of blend's pipeline, made checkable on the CPU: pinned staging reused across layers
(and ``record_stream`` on CUDA). The static-shape decode step: tests/unit/eval/test_static_decode.py."""

from __future__ import annotations

import pytest
import torch

from ragkv.blend import BlendSchedule, prefill
from ragkv.blend.pipeline import PinnedStaging, PipelinedSource
from ragkv.blend.source import LayerSource
from ragkv.model import random_model
from ragkv.model.forward import compute_chunk_kv

CUDA = torch.cuda.is_available()


# ---- pinned staging ------------------------------------------------------------------------------------------
def test_staging_buffers_are_reused_across_layers_pinned_with_cuda_and_grow_only_when_needed():
    st = PinnedStaging(slots=2)
    assert st.pin == CUDA
    g = torch.Generator().manual_seed(0)
    ptrs = set()
    for layer in range(6):
        parts = [torch.randn(n, 2, 8, generator=g) for n in (5, 7, 3)]
        slot, host = st.stage(parts)
        assert slot == layer % 2 and torch.equal(host, torch.cat(parts))
        assert host.is_pinned() == CUDA  # a torch.cat of pinned pieces would not be
        ptrs.add(host.data_ptr())
        st.release(slot, None)
    assert st.allocations == 2 and len(ptrs) == 2  # one buffer per slot for all six layers
    _, host = st.stage([torch.ones(20, 2, 8)])  # a longer layer grows its slot once
    assert st.allocations == 3 and torch.equal(host, torch.ones(20, 2, 8))
    _, host = st.stage([torch.ones(4, 2, 8)])
    assert st.allocations == 3 and host.shape == (4, 2, 8)
    assert all(b.is_pinned() == CUDA for b in st.buffers())


def _pieces(m, n_chunks: int = 3, length: int = 9):
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(3, m.config.vocab_size, (length,), generator=g).tolist() for _ in range(n_chunks)]
    return [compute_chunk_kv(m, c) for c in chunks]


def test_staged_pipelined_source_matches_the_sequential_one_and_never_aliases_its_buffers():
    m = random_model(seed=4, num_hidden_layers=5)
    pieces = _pieces(m)
    seq = LayerSource(pieces, m.device, m.dtype)
    for depth in (1, 2):
        src = PipelinedSource(pieces, m.device, m.dtype, depth=depth, num_layers=5, staged=True)
        try:
            outs = [src.layer(layer) for layer in range(5)]
        finally:
            src.close()
        staged = {b.data_ptr() for b in src.staging.buffers()}
        assert src.staging.allocations == 2 * (depth + 1)  # reused across the 5 layers, K and V each
        for layer, (k, v) in enumerate(outs):  # checked after all loads: later layers did not overwrite
            rk, rv = seq.layer(layer)
            assert torch.equal(k, rk) and torch.equal(v, rv)
            assert k.data_ptr() not in staged and v.data_ptr() not in staged


@pytest.mark.parametrize("staged", [False, True])
def test_a_transform_set_after_the_first_read_ahead_still_applies_to_every_layer(staged):
    """A pipelined source starts reading layer 0 when it is built; a transform (a KV adapter's
    correction) set afterwards must still reach that layer. It did not when the loader thread had
    finished layer 0 first: under load, the adapter test then saw 2 of 3 layers corrected."""
    m = random_model(seed=4, num_hidden_layers=3)
    pieces = _pieces(m)
    seq = LayerSource(pieces, m.device, m.dtype)
    src = PipelinedSource(pieces, m.device, m.dtype, depth=1, num_layers=3, staged=staged)
    try:
        src._futures[0].result()  # the race's losing order, made certain: layer 0 read before the transform
        seen: list[int] = []

        def double(layer, k, v):
            seen.append(layer)
            return 2 * k, 2 * v

        src.transform = double
        outs = [src.layer(layer) for layer in range(3)]
    finally:
        src.close()
    assert sorted(seen) == [0, 1, 2]
    for layer, (k, v) in enumerate(outs):
        rk, rv = seq.layer(layer)
        assert torch.equal(k, 2 * rk) and torch.equal(v, 2 * rv)


def test_blend_through_the_staged_pipeline_equals_the_sequential_blend():
    m = random_model(seed=5, num_hidden_layers=4)
    pieces = _pieces(m, 2, 12)
    sched = BlendSchedule.single(0.3)
    ref = prefill(m, [1], pieces, [5, 6, 7], "blend", schedule=sched)

    def staged(p):
        return PipelinedSource(p, m.device, m.dtype, depth=2, num_layers=4, staged=True)

    got = prefill(m, [1], pieces, [5, 6, 7], "blend", schedule=sched, source_factory=staged)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.kv.k, ref.kv.k)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_pipeline_stages_in_pinned_memory_and_record_streams_on_the_compute_stream(monkeypatch):
    m = random_model(seed=6, num_hidden_layers=4, dtype="bfloat16", device="cuda")
    pieces = [
        type(kv)(kv.token_ids, kv.k.cpu(), kv.v.cpu(), kv.start_pos, kv.fingerprint) for kv in _pieces(m)
    ]
    recorded = []
    original = torch.Tensor.record_stream

    def spy(self, stream):
        recorded.append((self.data_ptr(), stream))
        return original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    seq = LayerSource(pieces, m.device, m.dtype)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        src = PipelinedSource(pieces, m.device, m.dtype, depth=2, num_layers=4)
        try:
            for layer in range(4):
                k, v = src.layer(layer)
                assert (k.data_ptr(), compute) in recorded and (v.data_ptr(), compute) in recorded
                k2 = k * 1  # a kernel on the compute stream reading the loaded tensor
                rk, rv = seq.layer(layer)
                assert torch.equal(k2, rk) and torch.equal(v, rv)
        finally:
            src.close()
    assert src.staging.buffers() and all(b.is_pinned() for b in src.staging.buffers())
    assert src.staging.allocations == 2 * 3
