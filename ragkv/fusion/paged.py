"""The engine's block-sharing policy (:class:`BlockFusion`): BFF/CFF applied to paged sequences.

Gather full blocks, fuse (:func:`~ragkv.fusion.bff.fast_fusion`), rewrite the sequences' tables.

Norm mode (default): a fused representative overwrites its home member's block; the other members'
entries point there (their own blocks freed) and keep their original norms for norm-aware attention.
Replicate mode (the paper's accuracy mode): each member's own block gets ``norm * u``, nothing freed.
Only full blocks held by one sequence and never fused before are eligible (docs/ENGINE.md, "BFF / CFF").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ragkv.fusion.bff import FusionConfig, FusionResult, fast_fusion
from ragkv.fusion.cff import cff_plan

#: ``pool`` / ``seq`` below: the engine's ``KVPool`` and ``PagedSequence`` (``ragkv.engine.paged_cache``,
#: a layer above: duck-typed here): a pool's ``manager``, ``read_blocks`` / ``write_blocks`` and
#: ``backend``; a sequence's ``table [L, nb]``, ``fused``, ``set_norms`` and ``fusable_blocks``


@dataclass
class FusionStats:
    """What BFF/CFF did so far, per layer: blocks considered and representatives kept."""

    kind: str
    runs: int = 0
    time_s: float = 0.0
    blocks_before: dict[int, int] = field(default_factory=dict)
    blocks_after: dict[int, int] = field(default_factory=dict)
    blocks_freed: int = 0
    thresholds: list[float] = field(default_factory=list)

    def add_layer(self, layer: int, before: int, after: int) -> None:
        self.blocks_before[layer] = self.blocks_before.get(layer, 0) + before
        self.blocks_after[layer] = self.blocks_after.get(layer, 0) + after

    def cr_per_layer(self) -> dict[int, float]:
        return {
            layer: self.blocks_before[layer] / max(1, self.blocks_after[layer])
            for layer in sorted(self.blocks_before)
        }

    @property
    def cr(self) -> float:
        """Blocks considered / representatives, over all fused layers."""
        before = sum(self.blocks_before.values())
        return before / max(1, sum(self.blocks_after.values())) if before else 1.0

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "runs": self.runs,
            "time_s": self.time_s,
            "cr": self.cr,
            "cr_per_layer": self.cr_per_layer(),
            "blocks_freed": self.blocks_freed,
            "thresholds": self.thresholds[-8:],
        }


class BlockFusion:
    """The engine's block-sharing policy: CFF inside each prompt once prefilled, BFF across the group
    of sequences prefilled since the last run (every ``bff.every`` of them, or ``bff.min_group`` when
    the engine turns to decoding with nothing queued). Neither configured: it does nothing."""

    def __init__(self, bff: FusionConfig | None = None, cff: FusionConfig | None = None):
        self.bff_config, self.cff_config = bff, cff
        self.bff_stats, self.cff_stats = FusionStats("bff"), FusionStats("cff")
        self.group: list = []  # sequences prefilled since the last BFF

    def prefilled(self, pool, seq) -> None:
        """A prompt is in ``seq``: CFF across its chunks."""
        if self.cff_config is not None:
            cff(pool, seq, self.cff_config, self.cff_stats)

    def decoding(self, seq) -> None:
        """``seq`` decodes on (its first token was not its last): a member of the next BFF group."""
        if self.bff_config is not None:
            self.group.append(seq)

    def step(self, pool, transition: bool, idle: bool) -> None:
        """After a prefill step (``transition`` False) or before a decode step (True; ``idle``: nothing
        queued): run BFF on the group when it is due. Released (finished, preempted) members leave it."""
        cfg = self.bff_config
        if cfg is None or not self.group:
            return
        self.group = [s for s in self.group if not s.released]
        if len(self.group) >= cfg.every or (transition and idle and len(self.group) >= cfg.min_group):
            bff(pool, self.group, cfg, self.bff_stats)
            self.group = []


def eligible_blocks(seq, layer: int, lo: int = 0, hi: int | None = None) -> list[int]:
    """Table indices in ``[lo, hi)`` of ``layer`` that may be fused (full, unshared, not fused yet)."""
    ref, full = seq.pool.manager.ref_count, seq.fusable_blocks(layer)
    t = seq.table[layer].tolist()
    hi = full if hi is None else min(hi, full)
    return [j for j in range(lo, hi) if ref(t[j]) == 1 and j not in seq.fused[layer]]


def fuse_items(
    pool, layer: int, items: list[tuple[object, int, int | None]], cfg: FusionConfig, stats: FusionStats
) -> FusionResult | None:
    """Fuse the eligible blocks of ``items`` (tree leaves: a sequence's table range ``[lo, hi)``) of one
    layer and apply the result; None when fewer than two items have any."""
    refs, sizes = [], []
    for s, lo, hi in items:
        js = eligible_blocks(s, layer, lo, hi)
        refs += [(s, j) for j in js]
        sizes.append(len(js))
    if sum(1 for n in sizes if n) < 2:
        return None
    phys = torch.stack([s.table[layer, j] for s, j in refs])
    k, v = pool.read_blocks(phys, layer)
    k, v = k.reshape(len(refs), -1), v.reshape(len(refs), -1)
    thr = cfg.threshold_for(k, v, sizes)
    res = fast_fusion(k, v, sizes, thr, cfg.multi_match)
    stats.add_layer(layer, res.num_blocks, res.num_reps)
    stats.thresholds.append(thr)
    stats.blocks_freed += apply_fusion(pool, layer, refs, res, cfg.attention)
    return res


def apply_fusion(pool, layer: int, refs: list[tuple[object, int]], res: FusionResult, attention: str) -> int:
    """Rewrite blocks and tables per ``res``; returns how many blocks went back to the free list."""
    shape = (1, pool.block_size, pool.num_kv_heads, pool.head_dim)
    mgr = pool.manager
    fused = res.members > 1
    kn, vn, homes = res.k_norm.tolist(), res.v_norm.tolist(), res.home.tolist()
    # representatives: written over the home member's block (replicate: over every member's, rescaled).
    # HACK stores a representative as its home member's reconstruction n_home * u (in K's range, which
    # K smoothing and fp16 metadata need); members' norms are then relative to the home's
    replicate, scaled = attention == "replicate", pool.backend.scaled_representatives
    home, freed = {}, 0
    for i in fused[res.rep_of].nonzero().flatten().tolist():  # original blocks of a fused representative
        s, j = refs[i]
        r, b = int(res.rep_of[i]), int(s.table[layer, j])
        h = i if replicate else homes[r]
        if h not in home:
            hs, hj = refs[h]
            hb = int(hs.table[layer, hj])
            mgr.unregister(hb)  # its content changes: it no longer matches its prefix key
            ks = kn[h] if (scaled or replicate) and kn[h] > 0 else 1.0
            vs = vn[h] if (scaled or replicate) and vn[h] > 0 else 1.0
            pb = torch.tensor([hb], device=pool.device)
            pool.write_blocks(pb, layer, (res.k_rep[r] * ks).view(shape), (res.v_rep[r] * vs).view(shape))
            home[h] = (hb, ks, vs)
        hb, ks, vs = home[h]
        s.set_norms(layer, j, kn[i] / ks, vn[i] / vs)
        if hb != b:  # a member away from its home: share the home's block, free its own
            mgr.incref(hb)
            s.table[layer, j] = hb
            freed += mgr.free(b)
    return freed


def bff(pool, seqs: list, cfg: FusionConfig, stats: FusionStats) -> None:
    """Batch fast fusion across ``seqs`` (tree leaves = sequences, in the given order) on the configured layers."""
    t0 = time.perf_counter()
    for layer in cfg.fused_layers(pool.num_layers):
        fuse_items(pool, layer, [(s, 0, None) for s in seqs], cfg, stats)
    stats.runs += 1
    stats.time_s += time.perf_counter() - t0


def cff(pool, seq, cfg: FusionConfig, stats: FusionStats) -> int:
    """Chunk fast fusion inside one sequence; returns the number of chunk groups fused."""
    t0, groups = time.perf_counter(), 0
    for layer in cfg.fused_layers(pool.num_layers):
        for g in cff_plan(seq.length // pool.block_size, pool.block_size, cfg):
            starts = [g.start + sum(g.chunk_sizes[:i]) for i in range(len(g.chunk_sizes))]
            items = [(seq, lo, lo + n) for lo, n in zip(starts, g.chunk_sizes, strict=True)]
            groups += fuse_items(pool, layer, items, cfg, stats) is not None
    stats.runs += 1
    stats.time_s += time.perf_counter() - t0
    return groups
