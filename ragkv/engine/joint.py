"""Applying BFF/CFF to paged sequences: gather full blocks, fuse (``ragkv.fusion``), rewrite tables.

Norm mode (default): each fused representative's unit K/V directions overwrite the physical block
of its home member (its left-most member in tree order); every other member's table entry is
pointed at that block (reference +1) and its own block is freed (reference -1), and each member
keeps its original block norms in ``k_norm``/``v_norm`` for norm-aware attention. Replicate mode
(the paper's accuracy mode): every member's own block is overwritten with ``norm * u``; nothing is
shared or freed. Only full blocks held by one sequence and never fused before are eligible: shared
prefix blocks are already deduplicated, and fused blocks are immutable.
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
    mgr = seq.pool.manager
    full = seq.fusable_blocks(layer)
    hi = full if hi is None else min(hi, full)
    t = seq.tables[layer]
    return [j for j in range(lo, hi) if mgr.ref_count(t[j]) == 1 and j not in seq.fused[layer]]


def fuse_refs(
    pool: KVPool,
    layer: int,
    refs: list[tuple[PagedSequence, int]],
    item_sizes: list[int],
    cfg: FusionConfig,
    stats: FusionStats,
) -> FusionResult | None:
    """Fuse the blocks ``refs`` (grouped into items of ``item_sizes``) of one layer and apply the result."""
    if sum(1 for s in item_sizes if s) < 2:
        return None
    phys = torch.tensor([s.tables[layer][j] for s, j in refs], dtype=torch.long, device=pool.device)
    k, v = pool.read_blocks(phys, layer)
    k, v = k.reshape(len(refs), -1), v.reshape(len(refs), -1)
    thr = cfg.threshold_for(k, v, item_sizes)
    res = fast_fusion(k, v, item_sizes, thr, cfg.multi_match)
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
    if not bool(fused.any()):
        return 0
    member = fused[res.rep_of]  # original blocks that belong to a fused representative
    idx = member.nonzero().flatten().tolist()
    kn, vn = res.k_norm.tolist(), res.v_norm.tolist()
    if attention == "replicate":
        for i in idx:
            s, j = refs[i]
            b = s.tables[layer][j]
            r = int(res.rep_of[i])
            mgr.unregister(b)
            pb = torch.tensor([b], device=pool.device)
            pool.write_blocks(
                pb, layer, (res.k_rep[r] * kn[i]).view(shape), (res.v_rep[r] * vn[i]).view(shape)
            )
            s.fused[layer].add(j)
        return 0
    homes = res.home.tolist()
    home_phys = {}
    # HACK stores a representative as its home member's reconstruction n_home * u (in K's range, which
    # K smoothing and fp16 metadata need); members' norms are then relative to the home's
    scaled = pool.hack is not None
    for r in fused.nonzero().flatten().tolist():
        s, j = refs[homes[r]]
        b = s.tables[layer][j]
        mgr.unregister(b)  # its content changes: it no longer matches its prefix key
        h = homes[r]
        ks = kn[h] if scaled and kn[h] > 0 else 1.0
        vs = vn[h] if scaled and vn[h] > 0 else 1.0
        pb = torch.tensor([b], device=pool.device)
        pool.write_blocks(pb, layer, (res.k_rep[r] * ks).view(shape), (res.v_rep[r] * vs).view(shape))
        home_phys[r] = (b, ks, vs)
    freed = 0
    for i in idx:
        s, j = refs[i]
        r = int(res.rep_of[i])
        hb, ks, vs = home_phys[r]
        s.k_norm[layer][j] = kn[i] / ks
        s.v_norm[layer][j] = vn[i] / vs
        s.fused[layer].add(j)
        if i != homes[r]:
            old = s.tables[layer][j]
            mgr.incref(hb)
            s.tables[layer][j] = hb
            before = mgr.num_free
            pool.free(old)
            freed += mgr.num_free - before
    return freed


def bff(
    pool: KVPool, seqs: list[PagedSequence], cfg: FusionConfig, stats: FusionStats
) -> dict[int, FusionResult]:
    """Batch fast fusion across ``seqs`` (tree leaves = sequences, in the given order) on the configured layers."""
    t0 = time.perf_counter()
    out = {}
    for layer in cfg.fused_layers(pool.num_layers):
        refs, sizes = [], []
        for s in seqs:
            js = eligible_blocks(s, layer)
            refs += [(s, j) for j in js]
            sizes.append(len(js))
        res = fuse_refs(pool, layer, refs, sizes, cfg, stats)
        if res is not None:
            out[layer] = res
    stats.runs += 1
    stats.time_s += time.perf_counter() - t0
    return out


def cff(pool: KVPool, seq: PagedSequence, cfg: FusionConfig, stats: FusionStats) -> int:
    """Chunk fast fusion inside one sequence; returns the number of chunk groups fused."""
    t0 = time.perf_counter()
    groups = 0
    for layer in cfg.fused_layers(pool.num_layers):
        for g in cff_plan(seq.full_blocks(layer), pool.block_size, cfg):
            refs, sizes = [], []
            lo = g.start
            for n in g.chunk_sizes:
                js = eligible_blocks(seq, layer, lo, lo + n)
                refs += [(seq, j) for j in js]
                sizes.append(len(js))
                lo += n
            if fuse_refs(pool, layer, refs, sizes, cfg, stats) is not None:
                groups += 1
    stats.runs += 1
    stats.time_s += time.perf_counter() - t0
    return groups
