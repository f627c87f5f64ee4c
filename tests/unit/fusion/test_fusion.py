"""BFF/CFF fusion (Algorithm 1) and norm-aware attention over fused blocks."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.attention.dense import attention
from ragkv.fusion import (
    AutoThreshold,
    FusionConfig,
    FusionConfigError,
    cff_fuse,
    cff_plan,
    fast_fusion,
    norm_aware_attention,
    paged_norm_attention,
    relative_errors,
    replicate_rescaled,
)


def _blocks(n: int, r: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g), torch.randn(n, r, generator=g)


def test_threshold_above_one_never_fuses():
    k, v = _blocks(12)
    k[6:9] = k[0:3]  # even identical blocks (cosine 1) do not pass a threshold > 1
    res = fast_fusion(k, v, [3, 3, 3, 3], 1.01)
    assert res.cr == 1.0 and torch.equal(res.rep_of, torch.arange(12)) and bool((res.members == 1).all())
    assert torch.allclose(res.reconstruct_k(), k, atol=1e-6) and torch.allclose(
        res.reconstruct_v(), v, atol=1e-6
    )


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=7),
    thr=st.floats(0.6, 0.999),
    dup=st.data(),
    mm=st.sampled_from(["paper", "argmax"]),
)
def test_identical_blocks_across_items_always_fuse(sizes, thr, dup, mm):
    # otherwise unrelated blocks (random in high dimension: |cos| << thr), one item repeating another
    n = sum(sizes)
    k, v = _blocks(n, r=512, seed=len(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    a, b = sorted(dup.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=2, max_size=2, unique=True)))
    m = min(sizes[a], sizes[b])
    k[starts[b] : starts[b] + m] = k[starts[a] : starts[a] + m]
    v[starts[b] : starts[b] + m] = v[starts[a] : starts[a] + m]
    res = fast_fusion(k, v, sizes, thr, mm)
    for j in range(m):
        assert res.rep_of[starts[a] + j] == res.rep_of[starts[b] + j]
    assert res.num_reps == n - m
    # norms are the originals' and every block maps to exactly one representative
    assert torch.allclose(res.k_norm, k.norm(dim=1)) and int(res.members.sum()) == n


def test_blocks_of_one_item_never_fuse_together():
    k = torch.ones(4, 8) + 0.01 * torch.randn(4, 8)  # all nearly parallel
    res = fast_fusion(k, k.clone(), [4], -1.0)
    assert res.cr == 1.0


def test_tree_merge_rule_and_multi_match_modes():
    e = torch.eye(4)
    a1 = F.normalize(e[0] + 0.3 * e[1], dim=0)
    a2 = F.normalize(e[0] + 0.2 * e[2], dim=0)
    b = e[0]  # close to both left rows; closer to a2
    k = torch.stack([a1, a2, b])
    v = torch.stack([e[1], e[2], e[3]])
    paper = fast_fusion(k, v, [2, 1], 0.9, "paper")
    # Algorithm 1: b is summed into both left rows and its table entry ends on the last one (a2)
    assert paper.rep_of.tolist() == [0, 1, 1] and paper.num_reps == 2
    assert torch.allclose(paper.k_rep[0], F.normalize(a1 + b, dim=0), atol=1e-6)
    assert torch.allclose(paper.k_rep[1], F.normalize(a2 + b, dim=0), atol=1e-6)
    assert torch.allclose(paper.v_rep[1], F.normalize(e[2] + e[3], dim=0), atol=1e-6)  # V follows K's matches
    argmax = fast_fusion(k, v, [2, 1], 0.9, "argmax")
    assert argmax.rep_of.tolist() == [0, 1, 1]
    assert torch.allclose(argmax.k_rep[0], a1, atol=1e-6)  # a1 untouched: b went to its argmax only
    # a representative fused at a low level is fused again higher up (4 leaves)
    k4 = torch.stack([e[0], e[0] + 0.05 * e[1], e[0] + 0.05 * e[2], e[0] + 0.05 * e[3]])
    res = fast_fusion(k4, k4.clone(), [1, 1, 1, 1], 0.99)
    assert res.num_reps == 1 and res.members.tolist() == [4]
    left = F.normalize(F.normalize(k4[0], dim=0) + F.normalize(k4[1], dim=0), dim=0)
    right = F.normalize(F.normalize(k4[2], dim=0) + F.normalize(k4[3], dim=0), dim=0)
    assert torch.allclose(res.k_rep[0], F.normalize(left + right, dim=0), atol=1e-6)


def test_lower_threshold_fuses_more_with_larger_error():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1, 64, generator=g)
    k = base + 0.6 * torch.randn(40, 64, generator=g)
    v = torch.randn(40, 64, generator=g)
    sizes = [5] * 8
    crs, errs = [], []
    for thr in (0.95, 0.8, 0.6, 0.3):
        res = fast_fusion(k, v, sizes, thr)
        crs.append(res.cr)
        errs.append(float(relative_errors(k, res).mean()))
    assert crs == sorted(crs) and crs[-1] > crs[0] and errs[-1] > errs[0]


def test_auto_threshold_targets():
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 64, generator=g) + 0.7 * torch.randn(64, 64, generator=g)
    v = torch.randn(64, 64, generator=g)
    sizes = [4] * 16
    thr = AutoThreshold(target_cr=2.0).choose(k, v, sizes, "paper")
    assert fast_fusion(k, v, sizes, thr).cr >= 2.0
    # the highest threshold reaching it, to the bisection's resolution (12 halvings of [0, 1])
    assert fast_fusion(k, v, sizes, thr + 2.0**-12).cr < 2.0
    budget = 0.2
    thr_e = AutoThreshold(max_error=budget).choose(k, v, sizes, "paper")
    assert float(relative_errors(k, fast_fusion(k, v, sizes, thr_e)).mean()) <= budget
    both = AutoThreshold(target_cr=50.0, max_error=budget).choose(k, v, sizes, "paper")
    assert both >= thr_e  # fidelity wins over an unreachable compression target
    with pytest.raises(FusionConfigError):
        AutoThreshold()


def test_norm_aware_attention_equals_rescaled_replicated_blocks():
    g = torch.Generator().manual_seed(5)
    nb, bs, hkv, d, hq = 5, 4, 2, 8, 4
    u_k = F.normalize(torch.randn(nb, bs * hkv * d, generator=g), dim=1).view(nb, bs, hkv, d)
    u_v = F.normalize(torch.randn(nb, bs * hkv * d, generator=g), dim=1).view(nb, bs, hkv, d)
    # two members share blocks 1 and 3 (one physical unit block, different norms per member)
    kn = torch.rand(nb, generator=g) * 20 + 1
    vn = torch.rand(nb, generator=g) * 20 + 1
    q = torch.randn(3, hq, d, generator=g)
    q_pos = torch.tensor([7, 13, 19])
    k_pos = torch.arange(nb * bs)
    out = norm_aware_attention(q, u_k, u_v, kn, vn, q_pos, k_pos, 0.35)
    k_rep = replicate_rescaled(u_k, kn).reshape(nb * bs, hkv, d)
    v_rep = replicate_rescaled(u_v, vn).reshape(nb * bs, hkv, d)
    ref = attention(q, k_rep, v_rep, q_pos, k_pos, 0.35)
    assert torch.allclose(out, ref, atol=1e-5)
    # the batched paged form over a pool with shared physical blocks gives the same rows
    pool_k, pool_v = u_k.clone(), u_v.clone()
    tables = torch.tensor([[0, 1, 2, 3, 4], [3, 1, 4, 0, 2]])
    kn2 = torch.stack([kn, kn[tables[1]]])
    vn2 = torch.stack([vn, vn[tables[1]]])
    lengths = torch.tensor([nb * bs, 11])
    qb = torch.randn(2, hq, d, generator=g)
    got = paged_norm_attention(qb, pool_k, pool_v, tables, kn2, vn2, lengths, 0.35)
    for i in range(2):
        kk = replicate_rescaled(u_k[tables[i]], kn2[i]).reshape(-1, hkv, d)
        vv = replicate_rescaled(u_v[tables[i]], vn2[i]).reshape(-1, hkv, d)
        pos = torch.arange(kk.shape[0])
        want = attention(qb[i : i + 1], kk, vv, lengths[i : i + 1] - 1, pos, 0.35)
        assert torch.allclose(got[i : i + 1], want, atol=1e-5)


def test_fused_blocks_reconstruct_with_their_own_norms():
    k, v = _blocks(8, seed=7)
    k[4:8] = 3.0 * k[0:4]  # same direction, three times the norm
    v[4:8] = 0.5 * v[0:4]
    res = fast_fusion(k, v, [4, 4], 0.999)
    assert res.cr == 2.0
    assert torch.allclose(res.reconstruct_k(), k, atol=1e-5) and torch.allclose(
        res.reconstruct_v(), v, atol=1e-5
    )


def test_cff_plan_and_fuse():
    cfg = FusionConfig(threshold=0.99, every=4, chunk_tokens=32)
    plan = cff_plan(num_full_blocks=21, block_size=16, cfg=cfg)  # chunks of 2 blocks: 10 full + 1 single
    assert [g.chunk_sizes for g in plan] == [(2, 2, 2, 2), (2, 2, 2, 2), (2, 2, 1)]
    assert [g.start for g in plan] == [0, 8, 16]
    k, v = _blocks(21, seed=8)
    k[2:4], v[2:4] = k[0:2], v[0:2]  # chunk 1 repeats chunk 0
    res = cff_fuse(k, v, plan[0], cfg)
    assert res.rep_of[2] == res.rep_of[0] and res.rep_of[3] == res.rep_of[1] and res.cr == 8 / 6
    with pytest.raises(FusionConfigError):
        cff_plan(10, 16, FusionConfig(chunk_tokens=40))


def test_config_validation_and_layers():
    assert FusionConfig().fused_layers(8) == [2, 3, 4, 5]
    assert FusionConfig(skip_first=1, skip_last=1).fused_layers(5) == [1, 2, 3]
    assert FusionConfig(layers=(0, 3)).fused_layers(4) == [0, 3]
    for bad in ({"multi_match": "first"}, {"attention": "dense"}, {"every": 0}, {"threshold": float("nan")}):
        with pytest.raises(FusionConfigError):
            FusionConfig(**bad)
    with pytest.raises(FusionConfigError):
        FusionConfig(layers=(9,)).fused_layers(4)
    with pytest.raises(FusionConfigError):
        fast_fusion(torch.zeros(3, 4), torch.zeros(3, 4), [1, 1], 0.5)
