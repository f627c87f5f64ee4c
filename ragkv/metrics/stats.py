"""Summary statistics of measured values: the one percentile (the engine's metrics, the benchmarks)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float | None], q: float, empty: float | None = math.nan) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values`` by linear interpolation between the two
    closest ranks (numpy's default). None and NaN values are left out; ``empty`` when none is left."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return empty
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
