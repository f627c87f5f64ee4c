"""What a paged pool's KV storage is to the engine: one interface, two backends.

:class:`KVBackend` is where a :class:`~ragkv.engine.paged_cache.KVPool`'s blocks live and how a
:class:`~ragkv.engine.paged_cache.PagedSequence`'s rows are written and read. The default is
:class:`~ragkv.engine.paged_cache.DenseBlocks` (K and V in the model's dtype); ``EngineConfig(attention="hack")``
uses HACK's quantized pages (:class:`ragkv.attention.hack_seq.HackKV`, imported only then).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class KVBackend(Protocol):
    """A pool's block storage and the per-sequence operations that depend on it."""

    dtype: torch.dtype  # of the rows kept unquantized
    staged: bool  # rows are also held beside the blocks (HACK's fp16 staging): peak bytes are sampled
    scaled_representatives: bool  # a fused representative is stored scaled by its home member's norm

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (one layer's ``block_size`` rows)."""

    def nbytes(self) -> int:
        """Physical bytes of the storage."""

    def staging_bytes_in_use(self) -> int:
        """Bytes held beside the blocks by live sequences now."""

    def sealed_rows(self, num_tokens: int) -> int:
        """Leading rows of a ``num_tokens``-row sequence that are final (shareable, fusable)."""

    def read_blocks(self, phys: torch.Tensor, layers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks ``phys`` (of ``layers``): ``[n, bs, Hkv, D]`` each."""

    def write_blocks(
        self, phys: torch.Tensor, layers: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor
    ) -> None:
        """Overwrite whole blocks; ``first[i]``: block ``i`` is its sequence's block 0."""

    def new_state(self) -> Any:
        """A new sequence's state in this backend (None when it needs none)."""

    def load_prompt(self, seq, k: torch.Tensor, v: torch.Tensor, js: list[int]) -> None:
        """A prefill's ``k, v [L, N, Hkv, D]`` into ``seq``'s blocks (layer ``l``'s first ``js[l]`` shared)."""

    def attend(self, seq, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Attention of query rows ``q`` at ``q_pos`` over one sequence's rows of ``layer``."""

    def seq_bytes(self, seq) -> int:
        """Bytes ``seq`` holds beside its blocks."""

    def fusable_blocks(self, seq, layer: int) -> int:
        """Leading blocks of ``seq`` that BFF/CFF may fuse."""

    def release(self, seq) -> None:
        """Give back what ``seq`` holds beside its blocks."""

    def decode_kv(self, seqs: list, pos: torch.Tensor, tables: torch.Tensor, norms: torch.Tensor | None):
        """One batched decode step's ``LayerKV`` (``run_layers``) over ``seqs`` at positions ``pos``."""
