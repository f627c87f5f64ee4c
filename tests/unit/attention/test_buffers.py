"""The K/V buffer pool (ragkv/attention/buffers.py): a buffer is handed out again only when nothing
views it, and the next pass's copy lands on pages already mapped."""

from __future__ import annotations

import torch

from ragkv.attention.buffers import ROW_QUANTUM, BufferPool

SHAPE = (30, 1000, 3, 64)  # 23 MB of float32: pooled


def test_a_buffer_comes_back_only_when_no_view_of_it_is_alive():
    pool = BufferPool()
    a = pool.empty(SHAPE, torch.float32)
    kept = a[:, :10]  # e.g. a tree node or a PromptKV still viewing the pass's rows
    a.fill_(7.0)
    del a
    b = pool.empty(SHAPE, torch.float32)
    assert (pool.allocated, pool.reused) == (2, 0)  # the first one is still in use
    assert torch.equal(kept, torch.full_like(kept, 7.0))
    b.fill_(1.0)
    assert torch.equal(kept, torch.full_like(kept, 7.0))  # b is other memory
    del kept
    c = pool.empty((30, 1010, 3, 64), torch.float32)  # a prompt one turn longer fits the same buffer
    assert (pool.allocated, pool.reused) == (2, 1) and c.shape == (30, 1010, 3, 64)


def test_rows_are_rounded_up_and_other_shapes_get_their_own_buffer():
    pool = BufferPool()
    a = pool.empty(SHAPE, torch.float32)
    assert a.untyped_storage().nbytes() == 30 * ROW_QUANTUM * 2 * 3 * 64 * 4
    del a
    pool.empty((30, 1000, 4, 64), torch.float32)  # another head count
    pool.empty(SHAPE, torch.bfloat16)  # another dtype
    assert (pool.allocated, pool.reused) == (3, 0)
    small = pool.empty((2, 10, 3, 64), torch.float32)  # small buffers are not pooled
    assert pool.allocated == 3 and small.shape == (2, 10, 3, 64)


def test_free_buffers_beyond_the_budget_are_dropped():
    pool = BufferPool(max_bytes=60 << 20)
    held = [pool.empty(SHAPE, torch.float32) for _ in range(2)]  # 2 x 24.6 MB, both in use
    del held
    third = pool.empty((30, 1600, 3, 64), torch.float32)  # does not fit a free one: a new buffer
    assert pool.allocated == 3 and pool.nbytes() <= 60 << 20  # free ones dropped to the budget
    del third
    pool.clear()
    assert pool.nbytes() == 0


def test_the_next_pass_writes_into_the_same_memory():
    """A turn's pass gets the previous turn's buffer back (the same pages: no page faults to map fresh
    ones; how much that saves is measured in docs/EXACT_REUSE.md, not asserted here)."""
    pool = BufferPool()
    first = pool.empty((30, 2450, 3, 64), torch.float32)  # a 2,450-token prompt's K (56 MB)
    address = first.data_ptr()
    del first
    for rows in (2450, 2491, 2534):  # the next turns, a little longer each
        again = pool.empty((30, rows, 3, 64), torch.float32)
        assert again.data_ptr() == address
        del again
    assert (pool.allocated, pool.reused) == (1, 3)


def test_a_free_buffer_behind_others_in_the_pool_is_found():
    """Regression: picking a free buffer that is not the pool's first one (list.remove compared tensors)."""
    pool = BufferPool()
    busy = pool.empty(SHAPE, torch.float32)
    other = pool.empty((30, 2000, 3, 64), torch.float32)
    del other
    again = pool.empty((30, 1500, 3, 64), torch.float32)
    assert pool.reused == 1 and busy.shape == SHAPE and again.shape == (30, 1500, 3, 64)
    del busy, again
    for _ in range(3):
        pool.empty(SHAPE, torch.float32)
    assert pool.reused == 4 and pool.allocated == 2


def test_buffers_made_in_inference_mode_go_only_to_inference_mode():
    """Regression: a buffer allocated under ``torch.inference_mode`` (an inference tensor) was handed to
    a pass outside it, whose in-place copy then raised."""
    pool = BufferPool()
    with torch.inference_mode():
        a = pool.empty(SHAPE, torch.float32)
    del a
    b = pool.empty(SHAPE, torch.float32)
    b[:, :2] = 1.0  # writable here
    assert not b.is_inference() and pool.allocated == 2
    del b
    with torch.inference_mode():
        c = pool.empty(SHAPE, torch.float32)
        c.fill_(0.0)
    assert pool.reused == 1


def test_head_major_buffers_round_their_rows_not_their_heads():
    """A decode cache is head-major ``[L, Hkv, rows, D]``: the rows (dim 2) are rounded up, the heads kept,
    and a longer prompt of the same shape gets the same memory back."""
    pool = BufferPool()
    a = pool.empty((30, 3, 1000, 64), torch.float32, rows_dim=2)
    assert a.shape == (30, 3, 1000, 64)
    assert a.untyped_storage().nbytes() == 30 * 3 * ROW_QUANTUM * 2 * 64 * 4
    ptr = a.untyped_storage().data_ptr()
    del a
    b = pool.empty((30, 3, 1010, 64), torch.float32, rows_dim=2)
    assert (pool.allocated, pool.reused) == (1, 1) and b.untyped_storage().data_ptr() == ptr
    assert (
        pool.empty((30, 1010, 3, 64), torch.float32).untyped_storage().data_ptr() != ptr
    )  # row-major: its own


def test_kept_buffers_are_handed_out_last_and_claimed_by_their_tag():
    pool = BufferPool()
    k, v = pool.empty(SHAPE, torch.float32), pool.empty(SHAPE, torch.float32)
    tag = object()
    pool.keep({"k": k, "v": v}, tag)
    ptrs = {k.data_ptr(), v.data_ptr()}
    other = pool.empty(SHAPE, torch.float32)  # both kept ones are in use still: a new buffer
    del k, v
    spare = pool.empty(SHAPE, torch.float32)  # `other` is in use; a free untagged one is preferred ...
    assert spare.data_ptr() in ptrs  # ... but there is none: a kept one, which loses its tag
    del spare, other
    assert pool.claim(lambda t: 1, {"k": SHAPE, "v": SHAPE}, torch.float32) is None  # its pair is broken
    a, b = pool.empty(SHAPE, torch.float32), pool.empty(SHAPE, torch.float32)
    pool.keep({"k": a, "v": b}, tag)
    held = a
    del a, b
    assert pool.claim(lambda t: 1, {"k": SHAPE, "v": SHAPE}, torch.float32) is None  # `k` still viewed
    del held
    assert pool.claim(lambda t: 0, {"k": SHAPE, "v": SHAPE}, torch.float32) is None  # scored out
    got = pool.claim(lambda t: 5 if t is tag else 0, {"k": (30, 900, 3, 64), "v": SHAPE}, torch.float32)
    assert got is not None and got[0] is tag and got[1]["k"].shape == (30, 900, 3, 64)
    assert pool.claimed == 2
    del got
    assert pool.claim(lambda t: 1, {"k": SHAPE, "v": SHAPE}, torch.float32) is None  # claimed: untagged
