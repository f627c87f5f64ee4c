"""The options of the one blend loop beyond CacheBlend: exactness invariants and what each computes.

Probe-offset correction (AgentKVShift), question-attention selection (A3), the question pass
(ProphetKV), seam rows and the diagnostics' preselection and oracle offsets.
"""

import pytest
import torch

from ragkv.blend import BlendSchedule, KVTree, prefill
from ragkv.blend.core import COMPUTED, EXACT, REUSED, _segments
from ragkv.generate import continuation_nll, decode_step, load_prompt, make_cache
from ragkv.kv import ChunkKV
from ragkv.model import random_model
from ragkv.model.forward import compute_chunk_kv
from tests.unit.blend.test_blend import _close, _prompt  # the same random prompts and relative tolerance

OPTIONS = [
    {"offset": "k"},
    {"offset": "kv", "offset_weight": "cap"},
    {"offset": "v", "offset_weight": "one"},
    {"selector": "qattn"},
    {"selector": "mix", "offset": "k"},
    {"selector": "qpass"},
    {"selector": "qpass", "offset": "kv", "score_layers": (1, 3)},
    {"seam": 2, "offset": "k"},
]
IDS = ["off-k", "off-kv-cap", "off-v-one", "qattn", "mix-off", "qpass", "qpass-off-band", "seam-off"]


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_every_option_at_ratio_one_equals_full_and_at_zero_equals_reuse(options):
    m = random_model(seed=11, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    full = prefill(m, pre, kvs, suf, "full")
    b1 = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(1.0, **options))
    _close(b1.logits, full.logits)
    _close(b1.kv.k, full.kv.k)
    _close(b1.kv.v, full.kv.v)
    reuse = prefill(m, pre, kvs, suf, "reuse")
    b0 = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.0, **options))
    # no row recomputed: no offset can be estimated, nothing is corrected: full KV reuse (to rounding:
    # layer 0 is computed for every row before the check layer, and its K/V do not depend on context)
    _close(b0.logits, reuse.logits)
    _close(b0.kv.k, reuse.kv.k)
    _close(b0.kv.v, reuse.kv.v)


def _in_context_chunk_kvs(m, pre, chunks, suf, shift: float):
    """Each chunk's KV as full prefill computes it in this prompt, plus a constant per-chunk offset."""
    full = prefill(m, pre, chunks, suf, "full")
    out, start = [], len(pre)
    for i, c in enumerate(chunks):
        rows = torch.arange(start, start + len(c))
        k_pre = torch.stack([m.rope(full.kv.k[layer, rows], -rows) for layer in range(m.config.num_layers)])
        v = full.kv.v[:, rows]
        off = shift * (i + 1) * torch.linspace(-1, 1, m.config.head_dim)
        out.append(ChunkKV(torch.tensor(c), k_pre + off, v - off, 1, m.fingerprint))
        start += len(c)
    return full, out


def test_offset_correction_recovers_a_constant_per_chunk_shift_exactly():
    # AgentKVShift's model: stored = exact + a per-chunk offset. The recomputed rows see exactly
    # -offset, so every other row of the chunk is corrected to the exact KV and the blend equals full.
    m = random_model(seed=3, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m, seed=1)
    full, kvs = _in_context_chunk_kvs(m, pre, chunks, suf, shift=0.5)
    plain = prefill(
        m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.2, selector="kdev", offset="none")
    )
    fixed = prefill(
        m,
        pre,
        kvs,
        suf,
        "blend",
        schedule=BlendSchedule.single(0.2, selector="kdev", offset="kv", offset_weight="one"),
    )
    err_plain = float((plain.kv.k - full.kv.k).abs().max())
    _close(fixed.kv.k, full.kv.k)
    _close(fixed.kv.v, full.kv.v)
    _close(fixed.logits, full.logits)
    assert err_plain > 0.1  # the shift is large enough that plain CacheBlend does not hide it


def test_oracle_offsets_are_used_in_place_of_the_estimated_ones():
    m = random_model(seed=3, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m, seed=1)
    full, kvs = _in_context_chunk_kvs(m, pre, chunks, suf, shift=0.5)
    n_pre, n_ch = len(pre), sum(map(len, chunks))
    rows = torch.arange(n_pre, n_pre + n_ch)

    def oracle(layer):
        k_st = torch.cat([kv.k[layer] for kv in kvs])
        v_st = torch.cat([kv.v[layer] for kv in kvs])
        return m.rope(full.kv.k[layer, rows], -rows) - k_st, full.kv.v[layer, rows] - v_st

    # ratio 0.05 of 60 rows: 3 recomputed rows; the oracle's true mean fixes all the others exactly
    res = prefill(
        m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.05, selector="kdev"), offset_oracle=oracle
    )
    _close(res.kv.k, full.kv.k)
    _close(res.logits, full.logits)


def test_question_pass_recomputes_the_rows_the_question_attends_to_most_and_charges_the_pass():
    m = random_model(seed=5, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m, seed=2)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    # the reference: the question's attention in plain reuse, averaged over layers
    reuse = prefill(m, pre, kvs, suf, "reuse", probe_suffix=True)
    mass = torch.stack([p.sum(dim=(0, 1)) for p in reuse.attn_probs]).mean(0)
    chunk_rows = torch.arange(len(pre), len(pre) + 60)
    want = set(chunk_rows[mass[chunk_rows].topk(12).indices].tolist())
    res = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.2, selector="qpass"))
    last = set(res.stats["recomputed_rows_last_layer"].tolist())
    assert set(last) & set(chunk_rows.tolist()) == want
    n, L = res.stats["num_tokens"], m.config.num_layers
    n_computed = len(pre) + len(suf)  # no prefix cache here: the prefix is computed too
    assert res.stats["question_pass_rows"] == n_computed * L
    assert res.stats["recompute_fraction"] == pytest.approx((2 * n_computed + 12) * L / (L * n))


def test_a_question_pass_dearer_than_recomputing_the_chunks_gives_way_to_an_exact_prefill():
    """Short chunks beside a long question: the pass (every computed row on every layer) plus its recompute
    cost more than recomputing every reused row, which is exact. Seen as ``ragkv-server ask`` charging 181% of a
    full prefill on a one-sentence document."""
    m = random_model(seed=5, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m, seed=3, n_chunks=1, chunk_len=12)
    suf = suf * 2  # 12 question rows >= (1 - 0.2) * 12 reused rows (the 6 head rows do not count)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    full = prefill(m, pre, kvs, suf, "full")
    res = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.2, selector="qpass", offset="k"))
    _close(res.logits, full.logits)
    assert res.stats["question_pass_rows"] == 0 and res.stats["recompute_fraction"] == pytest.approx(1.0)
    ape = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.2, ape_temperature=0.8))
    assert ape.temper is None  # every reused row recomputed: nothing stale to temper
    # an uncached head does not count: the same choice whether the prefix cache is warm or cold
    long_head = prefill(
        m, pre * 4, kvs, suf[:8], "blend", schedule=BlendSchedule.single(0.2, selector="qpass")
    )
    assert long_head.stats["question_pass_rows"] > 0
    # ratio 0 is still plain reuse, and a longer chunk still gets the question pass
    b0 = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.0, selector="qpass"))
    _close(b0.logits, prefill(m, pre, kvs, suf, "reuse").logits)
    pre, chunks, suf = _prompt(m, seed=3, n_chunks=3, chunk_len=20)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    res = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.2, selector="qpass"))
    assert res.stats["question_pass_rows"] > 0


def test_the_question_pass_cost_rule_counts_the_question_rows_after_the_chunks_only():
    """``BlendSchedule.question_pass_costs_more``: ``n_question >= (1 - ratio) * n_reused``, an
    uncached head not counted, never at ratio 0."""

    def rows(head: int, reused: int, question: int, head_class: int = EXACT) -> torch.Tensor:
        return torch.tensor([head_class] * head + [REUSED] * reused + [COMPUTED] * question)

    at = BlendSchedule.single
    assert at(0.2).question_pass_costs_more(rows(6, 12, 10))  # 10 >= 0.8 * 12
    assert not at(0.2).question_pass_costs_more(rows(6, 12, 9))
    assert not at(0.2).question_pass_costs_more(rows(30, 12, 9, COMPUTED))  # a cold head: the same
    assert not at(0.0).question_pass_costs_more(rows(6, 12, 40)) and not at(0.5).question_pass_costs_more(
        rows(6, 0, 40)
    )


def test_question_attention_selector_ranks_by_the_question_rows_attention():
    m = random_model(seed=6, init_std=0.1, num_hidden_layers=3)
    pre, chunks, suf = _prompt(m, seed=3)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    q = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.1, selector="qattn"))
    d = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.1, selector="kdev"))
    q_rows = set(q.stats["recomputed_rows_last_layer"].tolist())
    d_rows = set(d.stats["recomputed_rows_last_layer"].tolist())
    assert len(q_rows) == len(d_rows) == len(pre) + len(suf) + 6
    assert q_rows != d_rows  # a different ranking (attention mass, not KV deviation)


def test_seam_rows_are_always_recomputed_within_the_budget():
    m = random_model(seed=8, init_std=0.1, num_hidden_layers=3)
    pre, chunks, suf = _prompt(m, seed=4)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    res = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.2, selector="kdev", seam=3))
    rows = set(res.stats["recomputed_rows_last_layer"].tolist())
    starts = [len(pre) + 20 * i for i in range(3)]
    assert all(s + j in rows for s in starts for j in range(3))
    assert len(rows) == len(pre) + len(suf) + 12  # the seam rows are part of the 20% budget


def test_segments_follow_the_source_pieces_and_skip_exact_rows():
    m = random_model(seed=1, num_hidden_layers=2)
    pre, chunks, suf = _prompt(m, n_chunks=2, chunk_len=4)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    rc = torch.tensor([EXACT] * 6 + [REUSED] * 8 + [COMPUTED] * 6)

    class Src:
        pieces = [type("P", (), {"num_tokens": 6})(), *kvs]

    seg, pos, count = _segments(20, torch.arange(14), Src(), rc, torch.device("cpu"))
    assert seg.tolist() == [-1] * 6 + [1] * 4 + [2] * 4 + [-1] * 6
    assert pos[6:14].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert count == 3
    # without pieces, each run of consecutive stored rows is one segment
    seg2, _, _ = _segments(20, torch.tensor([6, 7, 8, 12, 13]), None, rc, torch.device("cpu"))
    assert seg2[[6, 7, 8, 12, 13]].tolist() == [0, 0, 0, 1, 1]


def test_options_work_with_a_cached_exact_head():
    m = random_model(seed=9, init_std=0.1, num_hidden_layers=3)
    pre, chunks, suf = _prompt(m, seed=5)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    pc = KVTree()
    prefill(m, pre, [], [1, 2], "prefix", prefix_cache=pc)  # caches the instruction head
    full = prefill(m, pre, kvs, suf, "full")
    for opts in ({"selector": "qpass", "offset": "k"}, {"offset": "kv"}, {"selector": "qattn"}):
        res = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(1.0, **opts), prefix_cache=pc)
        assert res.stats["num_exact_rows"] == len(pre)
        _close(res.logits, full.logits)


def _decode_nll(m, res, answer: list[int]):
    """The NLL of each ``answer`` token from a decode loop over ``res`` (teacher-forced), and its cache."""
    cache = make_cache(m, capacity=res.kv.num_tokens + 8)
    load_prompt(cache, res)
    logits, ref, pos = res.logits, [], res.kv.num_tokens
    for t in answer:
        ref.append(float(-torch.log_softmax(logits, -1)[t]))
        logits = decode_step(m, cache, t, pos)
        pos += 1
    return ref, cache


def test_continuation_nll_is_the_decode_loop_log_likelihood():
    m = random_model(seed=2, num_hidden_layers=3)
    pre, chunks, suf = _prompt(m)
    res = prefill(m, pre, chunks, suf, "full")
    answer = [5, 9, 13, 21]
    nll = continuation_nll(m, res, answer)
    assert nll == pytest.approx(_decode_nll(m, res, answer)[0], rel=1e-4, abs=1e-5)
    assert continuation_nll(m, res, []) == []


def test_bad_options_are_refused_by_name():
    for bad in ({"selector": "magic"}, {"offset": "q"}, {"offset_weight": "x"}, {"seam": -1}, {"mix": 2.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BlendSchedule.single(0.15, **bad)
    with pytest.raises(ValueError, match="qpass"):  # explicit check layers are never silently dropped
        BlendSchedule((1, 2), (0.3, 0.15))
    assert BlendSchedule((1, 2), (0.3, 0.15), selector="kdev").check_layers == (1, 2)
    with pytest.raises(ValueError, match="score_layers"):
        BlendSchedule.single(0.15, score_layers=(3, 3))


def test_chunks_with_too_few_probes_get_no_offset():
    # the synthetic per-chunk shift again (4 probes a chunk): a minimum of 100 probes leaves every
    # chunk uncorrected, so the shift stays in the KV; a minimum of 1 corrects every chunk exactly
    m = random_model(seed=3, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m, seed=1)
    full, kvs = _in_context_chunk_kvs(m, pre, chunks, suf, shift=0.5)

    def run(**kw):
        sched = BlendSchedule.single(0.2, selector="kdev", offset="kv", offset_weight="one", **kw)
        return prefill(m, pre, kvs, suf, "blend", schedule=sched)

    assert float((run(offset_min_probes=100).kv.k - full.kv.k).abs().max()) > 0.1
    _close(run(offset_min_probes=1).kv.k, full.kv.k)
    _close(run(offset_min_probes=4).kv.k, full.kv.k)


def test_a_load_failure_during_the_question_pass_closes_the_source():
    # the question pass holds the source open between its two passes; a chunk whose layer 2 cannot be
    # loaded must still close it (a pipelined source owns a loader thread)
    from ragkv.blend.pipeline import ChunkLoadError, PipelinedSource

    m = random_model(seed=4, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m, seed=6)
    kvs = [compute_chunk_kv(m, c) for c in chunks]

    class BrokenAtLayer2:
        def __init__(self, kv):
            self.kv, self.token_ids, self.num_tokens = kv, kv.token_ids, kv.num_tokens

        def layer_kv(self, layer):
            if layer == 2:
                raise ChunkLoadError(self.kv.key, layer)
            return self.kv.layer_kv(layer)

    sources = []

    def factory(pieces):
        sources.append(PipelinedSource(pieces, m.device, m.dtype, depth=1, num_layers=4))
        return sources[-1]

    items = [kvs[0], BrokenAtLayer2(kvs[1]), kvs[2]]
    with pytest.raises(ChunkLoadError):
        prefill(m, pre, items, suf, "blend", schedule=BlendSchedule.single(0.2), source_factory=factory)
    assert sources and sources[0]._pool._shutdown  # the loader thread pool was shut down


def _ape_reference(q, k, v, ctx, scale, T, S):
    """APE's merge written as its paper does: a softmax per block, blocks weighted by their LSE."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(q.shape[0]):
        n = i + k.shape[0] - q.shape[0] + 1  # causal: query i sees keys [0, n)
        for h in range(q.shape[1]):
            z = (k[:n, h] @ q[i, h]) * scale
            c, o = ctx[:n], ~ctx[:n]
            lse_c = torch.logsumexp(z[c] / T, 0)
            w = torch.softmax(
                torch.stack([T * lse_c + torch.log(torch.tensor(S)), torch.logsumexp(z[o], 0)]), 0
            )
            out[i, h] = (
                w[0] * torch.softmax(z[c] / T, 0) @ v[:n][c, h] + w[1] * torch.softmax(z[o], 0) @ v[:n][o, h]
            )
    return out


def test_explicit_attention_tempered_is_apes_block_merge_and_plain_attention_at_one():
    from ragkv.attention.dense import ContextTemper, attention, explicit_attention

    g = torch.Generator().manual_seed(0)
    n_k, n_q = 12, 3
    k, v = torch.randn(n_k, 2, 8, generator=g), torch.randn(n_k, 2, 8, generator=g)
    q = torch.randn(n_q, 2, 8, generator=g)
    k_pos, q_pos = torch.arange(n_k), torch.arange(n_k - n_q, n_k)
    ctx = torch.zeros(n_k, dtype=torch.bool)
    ctx[2:8] = True
    plain = attention(q, k, v, q_pos, k_pos, 0.35)
    same = explicit_attention(q, k, v, q_pos, k_pos, 0.35, temper=ContextTemper(1.0, 1.0, ctx))[0]
    torch.testing.assert_close(same, plain, rtol=1e-5, atol=1e-6)
    got = explicit_attention(q, k, v, q_pos, k_pos, 0.35, temper=ContextTemper(0.6, 0.7, ctx))[0]
    torch.testing.assert_close(got, _ape_reference(q, k, v, ctx, 0.35, 0.6, 0.7), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, plain, atol=1e-3)
    # a query that sees no context key (the context lies after it) is plain attention
    early = explicit_attention(
        q[:1], k, v, torch.tensor([1]), k_pos, 0.35, temper=ContextTemper(0.6, 0.7, ctx)
    )[0]
    torch.testing.assert_close(early, attention(q[:1], k, v, torch.tensor([1]), k_pos, 0.35))


def test_ape_tempers_the_question_and_the_decode_and_is_off_at_ratio_one():
    m = random_model(seed=11, init_std=0.1, num_hidden_layers=4)
    pre, chunks, suf = _prompt(m)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    full = prefill(m, pre, kvs, suf, "full")
    ape = {"ape_temperature": 0.6, "ape_scale": 0.8}
    b1 = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(1.0, **ape))
    assert b1.temper is None  # nothing reused stays stale: nothing to temper, blend@1 == full
    _close(b1.logits, full.logits)
    plain = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.3))
    tempered = prefill(m, pre, kvs, suf, "blend", schedule=BlendSchedule.single(0.3, **ape))
    assert tempered.temper is not None and plain.temper is None
    n_pre = len(pre)
    n_ctx = sum(len(c) for c in chunks)
    assert tempered.temper.context.nonzero().flatten().tolist() == list(range(n_pre, n_pre + n_ctx))
    # chunk rows are not tempered: only the question's rows (and what follows them) change
    _close(tempered.kv.k[:, : n_pre + n_ctx], plain.kv.k[:, : n_pre + n_ctx])
    assert not torch.allclose(tempered.logits, plain.logits, atol=1e-4)
    # the decode keeps tempering: teacher-forced NLL equals the decode loop's, and differs from plain
    answer = [5, 9, 13]
    nll = continuation_nll(m, tempered, answer)
    ref, cache = _decode_nll(m, tempered, answer)
    assert cache.temper is tempered.temper
    assert nll == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert nll != pytest.approx(continuation_nll(m, plain, answer), rel=1e-3)
    with pytest.raises(ValueError, match="dense"):
        load_prompt(make_cache(m, "hack"), tempered)
    for bad in ({"ape_temperature": 0.0}, {"ape_temperature": 2.5}, {"ape_scale": 0.0}):
        with pytest.raises(ValueError, match="ape_"):
            BlendSchedule.single(0.15, **bad)
