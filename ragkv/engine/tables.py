"""Block tables of a decode batch, stacked once per step (dense and HACK steps both read them).

Apart from :mod:`ragkv.engine.paged_cache` so that :mod:`ragkv.engine.hack_seq` needs no import of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def batch_tables(seqs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch's (``PagedSequence``s) block tables ``[L, B, NB]`` (padded with block 0: masked by length) and, when some
    entry is fused, its norms ``[2, L, B, NB]`` (else None); stacked once per step."""
    nb = max(s.num_blocks for s in seqs)
    tables = torch.stack([F.pad(s.table, (0, nb - s.num_blocks)) for s in seqs], 1)
    if not any(f for s in seqs for f in s.fused):
        return tables, None
    return tables, torch.stack([F.pad(s.norms, (0, nb - s.num_blocks), value=1.0) for s in seqs], 2)
