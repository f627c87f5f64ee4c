"""Per-layer step allocation from measured sensitivities (per-layer bit allocation, offline, per model).

Measured on the shared model (docs/VIDEO_CODEC.md): quantizing one (tensor, layer) at a time with
the same step, the first-token KL differs by more than 10x between layers (K of layer 2 alone gave
over half of the total; layer 0 gave exactly 0 under CacheBlend, which recomputes the first layer).
A uniform step therefore spends bits where they buy nothing.

Model: each (tensor, layer) adds ``a_i * s_i**2`` to the KL (error variance grows with the step
squared, contributions add). Minimizing the bits ``sum(-log2 s_i)`` subject to ``sum(a_i s_i**2) = D``
gives equal contributions, ``s_i = sqrt(D / (n a_i))`` (reverse water-filling), clipped to
``[lo, hi]``. ``a_i`` comes from one probe per (tensor, layer): ``a_i = KL_i(probe) / probe**2``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def allocate_layer_steps(
    k_kl: Sequence[float],
    v_kl: Sequence[float],
    probe: float,
    target_kl: float,
    lo: float = 0.1,
    hi: float = 3.0,
) -> tuple[list[float], list[float]]:
    """Per-layer steps (multiples of each channel's std) for K and V meeting ``target_kl`` in total.

    ``k_kl[l]`` / ``v_kl[l]``: KL measured with only that tensor of layer ``l`` quantized at step
    ``probe``. Layers measured as insensitive (KL ~ 0) get the coarsest step ``hi``.
    """
    if probe <= 0 or target_kl <= 0 or not 0 < lo <= hi:
        raise ValueError("probe, target_kl must be positive and 0 < lo <= hi")
    if len(k_kl) != len(v_kl) or not k_kl:
        raise ValueError("need one K and one V sensitivity per layer")
    sens = [max(float(x), 0.0) / probe**2 for x in (*k_kl, *v_kl)]
    n = sum(1 for a in sens if a > 0) or 1
    share = target_kl / n
    steps = [hi if a <= 0 else min(hi, max(lo, math.sqrt(share / a))) for a in sens]
    half = len(k_kl)
    return steps[:half], steps[half:]
