"""Applying BFF/CFF to paged sequences: gather full blocks, fuse (``ragkv.fusion``), rewrite tables.

Norm mode (default): a fused representative overwrites its home member's block; the other members'
entries point there (their own blocks freed) and keep their original norms for norm-aware attention.
Replicate mode (the paper's accuracy mode): each member's own block gets ``norm * u``, nothing freed.
Only full blocks held by one sequence and never fused before are eligible (docs/ENGINE.md, "BFF / CFF").
"""

from __future__ import annotations

import time

import torch

from ragkv.engine.metrics import FusionStats
from ragkv.engine.paged_cache import KVPool, PagedSequence
from ragkv.fusion.bff import FusionConfig, FusionResult, fast_fusion
from ragkv.fusion.cff import cff_plan


def eligible_blocks(seq: PagedSequence, layer: int, lo: int = 0, hi: int | None = None) -> list[int]:
    """Table indices in ``[lo, hi)`` of ``layer`` that may be fused (full, unshared, not fused yet)."""
    ref, full = seq.pool.manager.ref_count, seq.fusable_blocks(layer)
    t = seq.table[layer].tolist()
    hi = full if hi is None else min(hi, full)
    return [j for j in range(lo, hi) if ref(t[j]) == 1 and j not in seq.fused[layer]]


def fuse_items(
    pool: KVPool, layer: int, items: list[tuple[PagedSequence, int, int | None]], cfg: FusionConfig, stats
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


def apply_fusion(
    pool: KVPool, layer: int, refs: list[tuple[PagedSequence, int]], res: FusionResult, attention: str
) -> int:
    """Rewrite blocks and tables per ``res``; returns how many blocks went back to the free list."""
    shape = (1, pool.block_size, pool.num_kv_heads, pool.head_dim)
    mgr = pool.manager
    fused = res.members > 1
    kn, vn, homes = res.k_norm.tolist(), res.v_norm.tolist(), res.home.tolist()
    # representatives: written over the home member's block (replicate: over every member's, rescaled).
    # HACK stores a representative as its home member's reconstruction n_home * u (in K's range, which
    # K smoothing and fp16 metadata need); members' norms are then relative to the home's
    replicate, scaled = attention == "replicate", pool.hack is not None
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


def bff(pool: KVPool, seqs: list[PagedSequence], cfg: FusionConfig, stats: FusionStats) -> None:
    """Batch fast fusion across ``seqs`` (tree leaves = sequences, in the given order) on the configured layers."""
    t0 = time.perf_counter()
    for layer in cfg.fused_layers(pool.num_layers):
        fuse_items(pool, layer, [(s, 0, None) for s in seqs], cfg, stats)
    stats.runs += 1
    stats.time_s += time.perf_counter() - t0


def cff(pool: KVPool, seq: PagedSequence, cfg: FusionConfig, stats: FusionStats) -> int:
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
