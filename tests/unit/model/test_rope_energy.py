"""ragkv.model.rope_energy: bits per RoPE frequency block from the blocks' energies (the stepz codec's key
steps and HACK's key bits come from it). The calibration files themselves: tests/unit/store/test_codecs.py
(stepz) and tests/unit/attention/test_hack.py (HACK key plans)."""

import pytest


def test_block_bits_go_to_the_energetic_block_within_budget():
    import numpy as np

    from ragkv.model.rope_energy import allocate_block_bits

    e = np.ones((3, 2, 32))
    e[0, 0, 5] = 1e4  # one frequency block carries most of the energy
    e[1, 1, :] = np.logspace(-3, 3, 32)
    bits = allocate_block_bits(e, base_bits=4)
    assert (bits.sum(-1) == 4 * 32).all()  # the budget, exactly, per layer and head
    assert bits.min() >= 1 and bits.max() <= 7  # base -/+ 3
    assert bits[0, 0].argmax() == 5 and bits[0, 0, 5] == 7
    assert (bits[2] == 4).all() and (bits[0, 1] == 4).all()  # equal energies: uniform
    assert (np.diff(bits[1, 1]) >= 0).all() and bits[1, 1, 0] < bits[1, 1, -1]
    # greedy by marginal gain is optimal here: no single bit move lowers sum(e * 4**-b)
    cost = lambda b: float((e[1, 1] * 4.0**-b).sum())  # noqa: E731
    b = bits[1, 1].astype(float)
    for i in range(32):
        for j in range(32):
            if i != j and 1 < b[i] and b[j] < 7:
                moved = b.copy()
                moved[i] -= 1
                moved[j] += 1
                assert cost(moved) >= cost(b) - 1e-12
    with pytest.raises(ValueError):
        allocate_block_bits(e, base_bits=4, min_bits=5)
