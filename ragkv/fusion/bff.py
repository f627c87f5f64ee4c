"""Joint encoding of KV blocks (Kampeas & Haleva): the tree-structured Fast Fusion of Algorithm 1.

Blocks are flattened to vectors of ``r = block_size * Hkv * D`` per layer, K and V apart. Items
(requests for BFF, chunks of one prompt for CFF) are the leaves of a binary tree split at
``len // 2``; a leaf returns its blocks L2-normalised (no fusion inside one item). At each internal
node ``sim = K_l K_r^T`` (cosine, both sides unit vectors) and every left row with right matches
``sim > threshold`` (strict) becomes ``normalize(K_l[row] + sum K_r[matches])``; V is fused with
the *same* index sets (similarity is on keys only), and matched right blocks are evicted. The node
returns ``[all left representatives | unmatched right ones]`` so a representative may be fused again
higher up. Per-block norms of the original K and V are kept so every member can be rescaled.

Multi-match ambiguity (digest A.2.3 step 7): a right block can exceed the threshold for several
left rows. ``multi_match="paper"`` reproduces Algorithm 1 and the public patch: the block is summed
into every matching row and its block-table entry ends on the *last* matching row.
``multi_match="argmax"`` assigns it only to its most similar row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MULTI_MATCH = ("paper", "argmax")


class FusionConfigError(ValueError):
    """A fusion setting is invalid (threshold, layers, multi-match mode, auto-threshold budget)."""


@dataclass
class FusionResult:
    """Outcome of fusing ``n`` original blocks of one layer into ``R`` representatives.

    ``rep_of[i]`` is the representative index of original block ``i``; ``home[j]`` the original
    block whose physical slot hosts representative ``j`` (its left-most member in tree order).
    ``k_rep`` / ``v_rep`` are unit vectors; ``k_norm`` / ``v_norm`` the original blocks' L2 norms.
    """

    rep_of: torch.Tensor  # long [n]
    home: torch.Tensor  # long [R]
    k_rep: torch.Tensor  # [R, r] fp32, unit norm
    v_rep: torch.Tensor  # [R, r] fp32, unit norm
    k_norm: torch.Tensor  # [n] fp32
    v_norm: torch.Tensor  # [n] fp32
    members: torch.Tensor  # long [R]: how many original blocks each representative stands for
    threshold: float = 0.0

    @property
    def num_blocks(self) -> int:
        return int(self.rep_of.numel())

    @property
    def num_reps(self) -> int:
        return int(self.home.numel())

    @property
    def cr(self) -> float:
        """Compression ratio: original blocks / representatives (1.0 when nothing fused)."""
        return self.num_blocks / self.num_reps if self.num_reps else 1.0

    def reconstruct_k(self) -> torch.Tensor:
        """``k_norm[i] * k_rep[rep_of[i]]``: the rescaled replicated blocks (the paper's accuracy mode)."""
        return self.k_rep[self.rep_of] * self.k_norm[:, None]

    def reconstruct_v(self) -> torch.Tensor:
        return self.v_rep[self.rep_of] * self.v_norm[:, None]


def relative_errors(k: torch.Tensor, result: FusionResult) -> torch.Tensor:
    """Per original block ``||k_norm * u_rep - k|| / ||k||`` (0 for unfused blocks, up to rounding)."""
    kf = k.float()
    err = (result.reconstruct_k() - kf).norm(dim=1)
    return err / kf.norm(dim=1).clamp_min(1e-12)


def _check(threshold: float, multi_match: str) -> None:
    if not isinstance(threshold, (int, float)) or threshold != threshold:
        raise FusionConfigError(f"threshold must be a number, got {threshold!r}")
    if multi_match not in MULTI_MATCH:
        raise FusionConfigError(f"multi_match must be one of {MULTI_MATCH}, got {multi_match!r}")


def fast_fusion(
    k: torch.Tensor,
    v: torch.Tensor,
    item_sizes: list[int],
    threshold: float,
    multi_match: str = "paper",
) -> FusionResult:
    """Algorithm 1 over flattened blocks ``k, v [n, r]`` grouped into consecutive items of ``item_sizes``.

    Items with no blocks are allowed (they are empty leaves). ``threshold > 1`` never fuses.
    """
    _check(threshold, multi_match)
    if k.dim() != 2 or k.shape != v.shape:
        raise FusionConfigError(f"k and v must both be [n, r], got {tuple(k.shape)} and {tuple(v.shape)}")
    if any(s < 0 for s in item_sizes) or sum(item_sizes) != k.shape[0]:
        raise FusionConfigError(f"item sizes {item_sizes} do not add up to {k.shape[0]} blocks")
    n = k.shape[0]
    kf, vf = k.float(), v.float()
    k_norm, v_norm = kf.norm(dim=1), vf.norm(dim=1)
    ku, vu = F.normalize(kf, dim=1), F.normalize(vf, dim=1)
    starts = [0, *itertools.accumulate(item_sizes)]
    parent = torch.arange(n)  # union-find over original blocks; roots are representatives' homes

    def rec(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(homes [m], K units [m, r], V units [m, r]) of the representatives of items [lo, hi)."""
        if hi - lo == 1:
            idx = torch.arange(starts[lo], starts[hi])
            return idx, ku[idx], vu[idx]
        mid = lo + (hi - lo) // 2
        hl, kl, vl = rec(lo, mid)
        hr, kr, vr = rec(mid, hi)
        if not hl.numel() or not hr.numel():
            return torch.cat([hl, hr]), torch.cat([kl, kr]), torch.cat([vl, vr])
        sim = kl @ kr.T  # [m_l, m_r] cosine similarities
        match = sim > threshold
        if multi_match == "argmax":
            best = sim.masked_fill(~match, float("-inf")).argmax(dim=0)
            keep = torch.zeros_like(match)
            cols = match.any(dim=0).nonzero().flatten()
            keep[best[cols], cols] = True
            match = keep
        matched_cols = match.any(dim=0)
        if not bool(matched_cols.any()):
            return torch.cat([hl, hr]), torch.cat([kl, kr]), torch.cat([vl, vr])
        mf = match.to(kl.dtype)
        rows = match.any(dim=1)
        kl = torch.where(rows[:, None], F.normalize(kl + mf @ kr, dim=1), kl)
        vl = torch.where(rows[:, None], F.normalize(vl + mf @ vr, dim=1), vl)
        # block-table owner of each evicted right block: the last matching row (paper) / the only one
        cols = matched_cols.nonzero().flatten()
        last_row = match.shape[0] - 1 - match.flip(0).to(torch.int8).argmax(dim=0)
        parent[hr[cols]] = hl[last_row[cols]]
        keep_r = ~matched_cols
        return torch.cat([hl, hr[keep_r]]), torch.cat([kl, kr[keep_r]]), torch.cat([vl, vr[keep_r]])

    if len(item_sizes) == 0 or n == 0:
        none, empty = torch.empty(0, dtype=torch.long), torch.empty(0, k.shape[1])
        return FusionResult(none, none, empty, empty, k_norm, v_norm, none, float(threshold))
    homes, k_rep, v_rep = rec(0, len(item_sizes))
    # resolve chains (a home merged higher up points at another home)
    root = parent.clone()
    while True:
        nxt = root[root]
        if torch.equal(nxt, root):
            break
        root = nxt
    order = torch.argsort(homes)
    homes, k_rep, v_rep = homes[order], k_rep[order], v_rep[order]
    rep_of = torch.searchsorted(homes, root)
    members = torch.bincount(rep_of, minlength=homes.numel())
    return FusionResult(rep_of, homes, k_rep, v_rep, k_norm, v_norm, members, float(threshold))


@dataclass
class AutoThreshold:
    """Remark 2's automatic threshold: bisect ``thr`` to reach ``target_cr`` within ``max_error``.

    ``max_error`` bounds the mean relative K reconstruction error ``||n_K u - K|| / ||K||`` over the
    blocks (a fidelity budget; Lemma 1 ties the attention drift to ``sqrt(2(1 - thr))``). The chosen
    threshold is the highest one reaching ``target_cr``, raised if needed to respect ``max_error``.
    """

    target_cr: float | None = None
    max_error: float | None = None
    lo: float = 0.0
    hi: float = 1.0
    iters: int = 12

    def __post_init__(self):
        if self.target_cr is None and self.max_error is None:
            raise FusionConfigError("auto threshold needs target_cr and/or max_error")
        if self.target_cr is not None and self.target_cr < 1.0:
            raise FusionConfigError(f"target_cr must be >= 1, got {self.target_cr}")
        if self.max_error is not None and self.max_error < 0:
            raise FusionConfigError(f"max_error must be >= 0, got {self.max_error}")
        if not self.lo < self.hi:
            raise FusionConfigError("auto threshold needs lo < hi")

    def choose(self, k: torch.Tensor, v: torch.Tensor, item_sizes: list[int], multi_match: str) -> float:
        """The threshold for this set of blocks (one fusion per bisection step)."""
        thr_cr = thr_err = self.lo
        if self.target_cr is not None:
            lo, hi = self.lo, self.hi  # invariant: cr(lo) >= target (or lo is the floor)
            for _ in range(self.iters):
                mid = (lo + hi) / 2
                reached = fast_fusion(k, v, item_sizes, mid, multi_match).cr >= self.target_cr
                lo, hi = (mid, hi) if reached else (lo, mid)
            thr_cr = lo
        if self.max_error is not None:
            lo, hi = self.lo, 1.0 + 1e-6  # invariant: err(hi) <= budget (no fusion above 1)
            for _ in range(self.iters):
                mid = (lo + hi) / 2
                res = fast_fusion(k, v, item_sizes, mid, multi_match)
                within = float(relative_errors(k, res).mean()) <= self.max_error
                lo, hi = (lo, mid) if within else (mid, hi)
            thr_err = hi
        return max(thr_cr, thr_err)


@dataclass
class FusionConfig:
    """Settings shared by BFF and CFF.

    ``threshold``: cosine threshold (strict ``>``), or an :class:`AutoThreshold`. ``every``: BFF fuses
    a group once it has this many requests (or at the prefill->decode transition when no more
    requests are waiting); CFF fuses groups of this many chunks. ``layers``: explicit layer indices,
    else all but the first ``skip_first`` and last ``skip_last``. ``attention``: ``"norm"`` shares
    representatives and attends norm-aware (memory saved); ``"replicate"`` writes ``norm * u`` back into
    every member's own block (the paper's accuracy mode: nothing freed).
    """

    threshold: float | AutoThreshold = 0.7
    every: int = 8
    min_group: int = 2
    layers: tuple[int, ...] | None = None
    skip_first: int = 2
    skip_last: int = 2
    multi_match: str = "paper"
    attention: str = "norm"
    chunk_tokens: int = 512  # CFF only: tokens per chunk (a multiple of the block size)

    def __post_init__(self):
        if not isinstance(self.threshold, AutoThreshold):
            _check(self.threshold, self.multi_match)
        if self.multi_match not in MULTI_MATCH:
            raise FusionConfigError(f"multi_match must be one of {MULTI_MATCH}, got {self.multi_match!r}")
        if self.attention not in ("norm", "replicate"):
            raise FusionConfigError(f"fusion attention must be 'norm' or 'replicate', got {self.attention!r}")
        if self.every < 1 or self.min_group < 1:
            raise FusionConfigError("every and min_group must be >= 1")
        if self.skip_first < 0 or self.skip_last < 0:
            raise FusionConfigError("skip_first and skip_last must be >= 0")
        if self.chunk_tokens < 1:
            raise FusionConfigError("chunk_tokens must be >= 1")

    def fused_layers(self, num_layers: int) -> list[int]:
        """The layers to fuse for a model of ``num_layers`` layers."""
        if self.layers is not None:
            bad = [i for i in self.layers if not 0 <= i < num_layers]
            if bad:
                raise FusionConfigError(f"fusion layers {bad} outside [0, {num_layers})")
            return sorted(set(self.layers))
        return list(range(self.skip_first, max(self.skip_first, num_layers - self.skip_last)))

    def threshold_for(self, k: torch.Tensor, v: torch.Tensor, item_sizes: list[int]) -> float:
        if isinstance(self.threshold, AutoThreshold):
            return self.threshold.choose(k, v, item_sizes, self.multi_match)
        return float(self.threshold)
