"""The connector's engine-independent half: row plans, paged addressing and the layer replay.

Everything here runs and is tested on CPU (no vLLM import).

* Row plan: which prompt rows the engine already holds (``EXACT``: its prefix cache), which come
  from stored chunk KV (``REUSED``: HKVD candidates) and which must be computed (``COMPUTED``); and
  how many rows the connector reports to the engine as loaded. The chunk spans it starts from are
  the library's (:mod:`ragkv.blend.spans`).
* Paged addressing: rows -> slots and block ids of a request's block table.
* :func:`blend_rows`: fills rows ``[num_exact, num_rows)`` of a prompt with blended KV (CacheBlend
  HKVD selective recompute) through a :class:`~ragkv.model.forward.LayerModel` (ragkv's own
  :class:`ragkv.model.llama.Model`, or the vLLM adapter in :mod:`ragkv_vllm.model_hook`).
  It is :func:`ragkv.blend.core.selective_prefill`'s blend (the same :class:`~ragkv.blend.core.BlendKV`
  on the same layer loop) with three differences: the engine's prefix-cache rows arrive with
  *post-RoPE* K (what a paged cache holds) and are used as is; the rows after the last chunk (the
  question) are left to the engine, which is exact because causal attention never lets earlier
  rows see later ones; and the last layer's attention and MLP are skipped (no logits are needed).
  Missed chunks are computed for the store by :func:`ragkv.model.forward.compute_chunk_kv` on the same model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.blend.core import COMPUTED, EXACT, REUSED, BlendKV, blend_layers
from ragkv.blend.spans import ChunkSpan, SpanError, check_spans
from ragkv.remote.wire import BlendParams


# ---- row plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of the prompt taken from rows ``[src_start, ...)`` of a stored chunk."""

    span: ChunkSpan
    start: int
    stop: int
    src_start: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass
class RowPlan:
    """Rows ``[0, num_rows)`` of one prompt: the engine holds ``[0, num_exact)``; the rest is ours."""

    num_rows: int
    num_exact: int
    pieces: list[Piece]  # REUSED runs, in prompt order
    row_class: torch.Tensor = field(repr=False)  # int8 [num_rows]

    @property
    def num_external(self) -> int:
        """Rows reported to the engine as loaded by the connector."""
        return self.num_rows - self.num_exact

    @property
    def num_reused(self) -> int:
        return sum(p.num_tokens for p in self.pieces)

    def reused_rows(self) -> torch.Tensor:
        return (self.row_class == REUSED).nonzero().flatten()

    def without(self, span_index: int) -> RowPlan:
        """The same plan with chunk ``span_index`` computed instead of reused (its load failed)."""
        rc = self.row_class.clone()
        keep = []
        for p in self.pieces:
            if p.span.index == span_index:
                rc[p.start : p.stop] = COMPUTED
            else:
                keep.append(p)
        return RowPlan(self.num_rows, self.num_exact, keep, rc)


def plan_rows(prompt_len: int, hits: Sequence[ChunkSpan], num_exact: int) -> RowPlan | None:
    """Plan the rows the connector fills for a prompt whose first ``num_exact`` rows the engine holds.

    ``hits`` are the chunks found in the prompt *and* in the store. Rows end at the last hit chunk
    (the engine computes the rest, the question included) and never include the last prompt row
    (the engine must compute at least one row to produce logits). Text between chunks is COMPUTED.
    None when no stored row would be used (nothing to gain: let the engine prefill).
    """
    if prompt_len <= 0 or num_exact < 0:
        raise ValueError(f"bad prompt length {prompt_len} / cached rows {num_exact}")
    spans = check_spans(hits, prompt_len)
    if not spans:
        return None
    end = min(spans[-1].stop, prompt_len - 1)
    if end <= num_exact:
        return None
    rc = torch.full((end,), COMPUTED, dtype=torch.int8)
    rc[: min(num_exact, end)] = EXACT
    pieces = []
    for s in spans:
        lo, hi = max(s.start, num_exact), min(s.stop, end)
        if hi > lo:
            rc[lo:hi] = REUSED
            pieces.append(Piece(s, lo, hi, lo - s.start))
    if not pieces:
        return None
    return RowPlan(end, num_exact, pieces, rc)


# ---- paged addressing -----------------------------------------------------------------------------
def slot_mapping(block_ids: Sequence[int], block_size: int, rows: torch.Tensor) -> torch.Tensor:
    """Cache slot ``block_ids[r // block_size] * block_size + r % block_size`` of each row ``r``."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    rows = torch.as_tensor(rows, dtype=torch.long)
    if rows.numel() and int(rows.max()) >= len(block_ids) * block_size:
        raise SpanError(f"row {int(rows.max())} beyond the {len(block_ids)} blocks allocated to the request")
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return table[rows // block_size] * block_size + rows % block_size


def blocks_of_rows(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> set[int]:
    """Block ids holding rows ``[start, stop)``."""
    if stop <= start:
        return set()
    return {int(block_ids[b]) for b in range(start // block_size, math.ceil(stop / block_size))}


# ---- the vLLM hook's layer replay ----------------------------------------------------------------
def blend_rows(
    model,
    token_ids: torch.Tensor,
    plan: RowPlan,
    reused_source,
    exact_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    params: BlendParams,
    write: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> dict:
    """Fill rows ``[num_exact, num_rows)`` of every layer with blended KV through ``write``.

    The blend of :func:`ragkv.blend.core.selective_prefill` (one layer loop,
    :func:`ragkv.blend.core.blend_layers`) over a :class:`~ragkv.model.forward.LayerModel`.
    ``reused_source.layer(l)``: pre-RoPE K/V of the REUSED rows in order (closed here).
    ``exact_kv(l)``: post-RoPE K and V of rows ``[0, num_exact)`` (read from the engine's cache).
    ``write(l, rows, k_post, v)`` receives rows ``[num_exact, num_rows)``. ``params``: the request's
    settings (its ``kv_transfer_params``), run as :meth:`BlendParams.schedule` (the vLLM hook's: no
    question pass; mode ``reuse``: no recompute).
    """
    t0 = time.perf_counter()
    n, n_exact = plan.num_rows, plan.num_exact
    if int(token_ids.numel()) < n:
        raise ValueError(f"{token_ids.numel()} token ids for a plan of {n} rows")
    out_rows = torch.arange(n_exact, n, device=model.device)

    def emit(layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        write(layer, out_rows, K[n_exact:], V[n_exact:])

    kv = BlendKV(
        model,
        plan.row_class,
        params.schedule(),
        stored=reused_source,
        stored_rows=plan.reused_rows(),
        posted=exact_kv,
        n_posted=n_exact,
        on_layer=emit,
    )
    blend_layers(model, token_ids[:n], plan.row_class, kv, last_layer_attention=False)
    return {
        "num_rows": n,
        "num_exact_rows": n_exact,
        "num_reused_rows": kv.n_reused,
        "num_computed_rows": int((plan.row_class == COMPUTED).sum()),
        "recomputed_per_layer": kv.recomputed,
        "t_blend_s": time.perf_counter() - t0,
        "t_load_wait_s": kv.stats()["t_load_wait_s"],
    }
