"""CFF (chunks fast fusion): Algorithm 1 over the chunks of one long prompt.

The paper fuses blocks across input chunks during chunked prefill (512-token chunks; the public
patch fuses the last 4 chunks every 4 chunks). ragkv prefills a prompt in one pass, so CFF runs on
the prompt's KV right after prefill: its full blocks are cut into chunks of ``chunk_tokens``,
consecutive chunks are grouped ``every`` at a time, and each group is fused as one tree whose
leaves are its chunks. Deviation: the fused blocks do not feed the rest of the same prompt's
prefill (no computation reuse, which the paper claims but did not implement either); they save
decode memory. A trailing group with at least ``min_group`` chunks is fused too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.bff import FusionConfig, FusionConfigError, FusionResult, fast_fusion


@dataclass(frozen=True)
class ChunkGroup:
    """Consecutive full blocks ``[start, start + sum(chunk_sizes))`` of one prompt, as chunk leaves."""

    start: int
    chunk_sizes: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return sum(self.chunk_sizes)


def cff_plan(num_full_blocks: int, block_size: int, cfg: FusionConfig) -> list[ChunkGroup]:
    """How ``num_full_blocks`` blocks of a prompt split into fusion groups of chunks."""
    if cfg.chunk_tokens % block_size:
        raise FusionConfigError(
            f"CFF chunk_tokens ({cfg.chunk_tokens}) must be a multiple of the block size ({block_size})"
        )
    per = cfg.chunk_tokens // block_size
    chunks = [min(per, num_full_blocks - s) for s in range(0, num_full_blocks, per)]
    groups = []
    start = 0
    for g in range(0, len(chunks), cfg.every):
        sizes = tuple(chunks[g : g + cfg.every])
        if len(sizes) >= max(2, cfg.min_group):
            groups.append(ChunkGroup(start, sizes))
        start += sum(sizes)
    return groups


def cff_fuse(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, group: ChunkGroup, cfg: FusionConfig
) -> FusionResult:
    """Fuse one group: ``k/v_blocks [n, ...]`` are all the prompt's full blocks of one layer."""
    sl = slice(group.start, group.start + group.num_blocks)
    k = k_blocks[sl].reshape(group.num_blocks, -1)
    v = v_blocks[sl].reshape(group.num_blocks, -1)
    sizes = list(group.chunk_sizes)
    return fast_fusion(k, v, sizes, cfg.threshold_for(k, v, sizes), cfg.multi_match)
