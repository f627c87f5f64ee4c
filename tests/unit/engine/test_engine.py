"""Serving engine: paged KV accounting, batched decode, fetching-aware scheduling, BFF/CFF, HACK, front ends."""

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragkv.aio import iterate_in_thread
from ragkv.blend import (
    DEFAULT_RATIO,  # tests of blending mechanics: an explicit ratio (outside the fidelity gate)
    UnknownModeError,
    prefill,
)
from ragkv.engine import (
    BlockAccountingError,
    BlockManager,
    ChunkRef,
    Engine,
    EngineBusyError,
    EngineConfig,
    KVPool,
    PagedSequence,
    RequestFailedError,
    RequestTooLargeError,
    SchedulerConfig,
    batched_decode_step,
)
from ragkv.fidelity.plan import RequestSettings
from ragkv.fusion import FusionConfig
from ragkv.generate import SamplingParams, generate, stream
from ragkv.model import PromptTooLongError, random_model
from ragkv.model.forward import compute_chunk_kv
from ragkv.store import MemoryStore
from ragkv.testing import SlowStore
from tests.helpers import sample_story_chunks, stop_cases, stories_model

FUSE_MIDDLE = dict(skip_first=1, skip_last=1)  # stories260k has 5 layers: fuse 1..3


@pytest.fixture(scope="module")
def model():
    return stories_model()


@pytest.fixture(scope="module")
def chunks(model):
    return sample_story_chunks(model, 6, 40, seed=3)


def _reqs(model, chunks, n, mode="full", max_new=16):
    out = []
    for i in range(n):
        cs = [chunks[(i + j) % len(chunks)] for j in range(3)]
        q = model.encode(["Once upon a time", "Lily saw", "The dog ran to"][i % 3])
        out.append(
            dict(
                prefix=[model.config.bos_token_id],
                chunks=cs,
                question=q,
                mode=mode,
                params=SamplingParams(max_new_tokens=max_new + i),
            )
        )
    return out


def _reference(model, req):
    items = (
        [compute_chunk_kv(model, c) for c in req["chunks"]]
        if req["mode"] in ("blend", "reuse")
        else req["chunks"]
    )
    res = prefill(model, req["prefix"], items, req["question"], req["mode"])
    return generate(model, res, req["params"]).token_ids


# ---- block manager and paged sequences --------------------------------------------------------------
def test_block_manager_refcounts_and_double_free():
    m = BlockManager(4)
    a, b = m.allocate(2)
    m.incref(a)
    assert not m.free(a) and m.free(a) and m.num_free == 3
    with pytest.raises(BlockAccountingError):
        m.free(a)
    with pytest.raises(BlockAccountingError):
        m.incref(a)
    m.register("k", b)
    assert m.lookup("k") == b
    m.free(b)
    assert m.lookup("k") is None and m.num_used == 0
    m.check({})


def test_paged_sequence_is_a_kv_cache(model):
    res = prefill(model, model.encode("Once upon a time, Lily", add_bos=True), [], [], "full")
    p = SamplingParams(max_new_tokens=20)
    pool = KVPool.for_model(model, 64, block_size=4)
    seq = PagedSequence(pool)
    seq.load_prompt(res.kv.k, res.kv.v)
    assert [e.token_id for e in stream(model, res, p, cache=seq)] == generate(model, res, p).token_ids
    seq.release()
    assert pool.manager.num_used == 0


# ---- batched decode = single-request decode ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "blend"])
def test_batched_greedy_decode_matches_single_request(model, chunks, mode):
    reqs = _reqs(model, chunks, 5, mode)
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as eng:
        outs = eng.generate(reqs)
        assert eng.metrics().decode_steps >= 15 and eng.pool.manager.num_used == 0
    for o, r in zip(outs, reqs, strict=True):
        assert o.finish_reason == "length" and o.token_ids == _reference(model, r)


# ---- fetching-aware scheduling -------------------------------------------------------------------------
@pytest.mark.parametrize("fetch_aware", [True, False])
def test_fetching_request_does_not_delay_local_one(model, chunks, fetch_aware):
    per_chunk = 0.6
    delay = 3 * per_chunk  # three chunks read one after the other
    store = SlowStore(MemoryStore(), read_delay_s=per_chunk)
    for c in chunks[:3]:
        store.put(compute_chunk_kv(model, c))
    cfg = EngineConfig(
        num_blocks=600,
        scheduler=SchedulerConfig(fetch_aware=fetch_aware),
        settings=RequestSettings(ratio=DEFAULT_RATIO),
    )
    with Engine(model, cfg, store=store) as eng:
        fetching = eng.submit(
            prefix=[1],
            chunks=chunks[:3],
            question=model.encode("Lily"),
            mode="blend",
            params=SamplingParams(max_new_tokens=4),
        )
        local = eng.submit(
            prefix=[1],
            chunks=chunks[3:5],
            question=model.encode("Tom"),
            mode="full",
            params=SamplingParams(max_new_tokens=4),
        )
        while not local.request.done.is_set():
            eng.step()
        lm = local.request.metrics
        if fetch_aware:
            # the local request was served completely while the other one was still fetching
            assert fetching.request.metrics.fetch_end is None
        out = fetching.result(timeout=30)
        fm = fetching.request.metrics
        if fetch_aware:
            assert lm.last_token < fm.fetch_end  # every local token came out before the fetch ended
        else:
            assert lm.first_token >= fm.fetch_end  # head-of-line blocking: the baseline this scheduler avoids
        # the fetch really read three slow chunks (a lower bound: sleeps never end early)
        assert out.finish_reason == "length" and out.metrics.fetch_s >= delay * 0.9
        assert out.metrics.num_chunks_fetched == 3 and out.prefill_stats["mode"] == "blend"


def test_missing_chunks_are_computed_and_stored_and_refs_resolve(model, chunks):
    store = MemoryStore()
    with Engine(
        model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO)), store=store
    ) as eng:
        a = eng.submit(prefix=[1], chunks=chunks[:2], question=[5], mode="blend", max_new_tokens=3).result()
        keys = [compute_chunk_kv(model, c).key for c in chunks[:2]]
        assert all(store.contains(k) for k in keys)
        b = eng.submit(
            prefix=[1], chunks=[ChunkRef(k) for k in keys], question=[5], mode="blend", max_new_tokens=3
        )
        assert b.result().token_ids == a.token_ids
        bad = eng.submit(
            prefix=[1], chunks=[ChunkRef("0" * 64)], question=[5], mode="blend", max_new_tokens=3
        )
        with pytest.raises(RequestFailedError, match="ChunkNotFoundError"):
            bad.result()
        assert eng.metrics().requests_failed == 1 and eng.pool.manager.num_used == 0


# ---- front ends: backpressure, cancellation, streaming, metrics, async -------------------------------------
def test_backpressure_cancellation_streaming_and_metrics(model, chunks):
    cfg = EngineConfig(
        num_blocks=600, scheduler=SchedulerConfig(max_queue=2), settings=RequestSettings(ratio=DEFAULT_RATIO)
    )
    with Engine(model, cfg) as eng:
        reqs = _reqs(model, chunks, 3, max_new=20)
        h1, h2 = eng.submit(**reqs[0]), eng.submit(**reqs[1])
        with pytest.raises(EngineBusyError):
            eng.submit(**reqs[2])
        events = []
        for ev in h1.stream():
            events.append(ev)
            if len(events) == 3:
                h2.cancel()
        out1, out2 = h1.request.output(), h2.result()
        assert [e.token_id for e in events] == out1.token_ids == _reference(model, reqs[0])
        assert "".join(e.text for e in events) == out1.text
        assert out2.finish_reason == "cancelled" and len(out2.token_ids) < 21
        m = out1.metrics
        assert m.queue_s >= 0 and m.ttft_s > 0 and m.tpot_s > 0 and m.num_output_tokens == 20
        h3 = eng.submit(**reqs[2])  # room again once the queue drained
        assert h3.result().finish_reason == "length"
        em = eng.metrics()
        assert em.requests_finished == 2 and em.requests_cancelled == 1 and em.output_tokens_per_s > 0
        assert em.kv_blocks_used == 0 and em.kv_blocks_peak > 0
        assert not eng.cancel(h1.request_id)


def test_bad_requests_raise_clear_errors_and_queue_nothing(model):
    with Engine(model, EngineConfig(num_blocks=20, settings=RequestSettings(ratio=DEFAULT_RATIO))) as eng:
        with pytest.raises(PromptTooLongError):
            eng.submit(prefix=list(range(3, 500)), max_new_tokens=100)
        with pytest.raises(RequestTooLargeError):
            eng.submit(prefix=list(range(3, 200)), max_new_tokens=10)
        with pytest.raises(UnknownModeError):
            eng.submit(prefix=[1, 5], mode="magic")
        with pytest.raises(ValueError, match="empty prompt"):
            eng.submit()
        with pytest.raises(TypeError):
            eng.submit(prefix=[1], chunks=[3.5])
        assert not eng.has_unfinished()


def test_async_callers_stream_through_the_one_bridge(model, chunks):
    """asyncio callers read a background engine's handles through ``ragkv.aio.iterate_in_thread``
    (the core's one thread-to-async bridge): streams run concurrently, an early stop cancels its request."""
    reqs = _reqs(model, chunks, 3, max_new=8)

    async def main():
        with Engine(
            model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))
        ) as eng:
            eng.start()
            handles = [eng.submit(**r) for r in reqs]

            async def collect(h):
                return [ev.token_id async for ev in iterate_in_thread(h.stream)]

            toks = await asyncio.gather(*(collect(h) for h in handles))
            h = eng.submit(**reqs[0])
            early = []
            async for ev in iterate_in_thread(h.stream):
                early.append(ev)
                if len(early) == 2:
                    break
            h.cancel()
            assert await asyncio.to_thread(h.request.done.wait, 30)
            return toks, early, h.request.output(), eng.metrics()

    toks, early, out, m = asyncio.run(main())
    assert toks == [_reference(model, r) for r in reqs] and len(early) == 2
    assert out.finish_reason in ("cancelled", "length")
    assert m.requests_finished + m.requests_cancelled == 4 and m.kv_blocks_used == 0


# ---- BFF / CFF in the engine ---------------------------------------------------------------------------------
def test_bff_threshold_above_one_is_identical_to_unfused(model, chunks):
    reqs = _reqs(model, chunks, 4)
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as plain:
        base = plain.generate(reqs)
    cfg = EngineConfig(
        num_blocks=600,
        bff=FusionConfig(threshold=1.01, every=4, **FUSE_MIDDLE),
        settings=RequestSettings(ratio=DEFAULT_RATIO),
    )
    with Engine(model, cfg) as eng:
        outs = eng.generate(reqs)
        assert eng.bff_stats.runs == 1 and eng.bff_stats.cr == 1.0 and eng.bff_stats.blocks_freed == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def test_identical_blocks_across_requests_always_fuse_and_memory_is_freed(model, chunks):
    req = _reqs(model, chunks, 1, max_new=6)[0]
    cfg = EngineConfig(
        num_blocks=600,
        share_prefix_blocks=False,
        bff=FusionConfig(threshold=0.999, every=3, **FUSE_MIDDLE),
        settings=RequestSettings(ratio=DEFAULT_RATIO),
    )
    with Engine(model, cfg) as eng:
        hs = [eng.submit(**req) for _ in range(3)]
        while eng.bff_stats.runs == 0:
            eng.step()
        full_blocks = (1 + 3 * 40 + 4) // 16  # 125 prompt tokens -> 7 full blocks per layer
        assert eng.bff_stats.blocks_freed == 3 * 2 * full_blocks  # 3 layers, 2 of 3 copies freed
        used_after = eng.pool.manager.num_used
        assert used_after == 3 * 5 * 8 - 3 * 2 * full_blocks
        assert eng.metrics().compression_ratio == pytest.approx(3 * 5 * 8 / used_after)
        eng.pool.manager.check(eng.references())
        outs = [h.result() for h in hs]
    ref = _reference(model, req)
    assert all(o.token_ids == ref for o in outs)


def test_bff_fuses_similar_blocks_norm_equals_replicate(model, chunks):
    reqs = _reqs(model, chunks, 4, max_new=10)
    results = {}
    for attn in ("norm", "replicate"):
        cfg = EngineConfig(
            num_blocks=600,
            bff=FusionConfig(threshold=0.95, every=4, attention=attn, **FUSE_MIDDLE),
            settings=RequestSettings(ratio=DEFAULT_RATIO),
        )
        with Engine(model, cfg) as eng:
            hs = [eng.submit(**r) for r in reqs]
            while eng.bff_stats.runs == 0:
                eng.step()
            used = eng.pool.manager.num_used
            logits = torch.stack(_next_logits(eng))
            results[attn] = (used, logits, eng.bff_stats.cr)
            for h in hs:
                h.result()
    (un, ln, crn), (ur, lr, crr) = results["norm"], results["replicate"]
    assert crn == crr > 1.0 and un < ur  # same fusion; only norm mode frees memory
    assert torch.allclose(ln, lr, atol=1e-4)  # and attends exactly like the rescaled replicas


def _next_logits(eng):
    """Logits of the next decode step for every running request, without advancing the engine."""
    run = eng.scheduler.running
    saved = [(r.seq.table.clone(), r.seq.norms.clone(), list(r.seq._len)) for r in run]
    free_before = eng.pool.manager.num_free
    logits = batched_decode_step(eng.model, [r.seq for r in run], [r.next_token for r in run])
    for r, (table, norms, lens) in zip(run, saved, strict=True):  # roll the appended row back
        for b in r.seq.table[:, table.shape[1] :].flatten().tolist():
            eng.pool.manager.free(b)
        r.seq.table, r.seq.norms, r.seq._len = table, norms, lens
    assert eng.pool.manager.num_free == free_before
    return list(logits)


def test_cff_fuses_chunks_of_one_prompt(model, chunks):
    req = dict(
        prefix=[],
        chunks=[c[:32] for c in chunks[:4]],
        question=model.encode("Lily"),
        mode="full",
        params=SamplingParams(max_new_tokens=6),
    )
    ref = _reference(model, req)
    for thr in (1.01, 0.9):
        cff = FusionConfig(threshold=thr, every=4, chunk_tokens=32, **FUSE_MIDDLE)
        with Engine(
            model, EngineConfig(num_blocks=600, cff=cff, settings=RequestSettings(ratio=DEFAULT_RATIO))
        ) as eng:
            h = eng.submit(**req)
            eng.step()  # prefill + CFF
            used = eng.pool.manager.num_used
            eng.pool.manager.check(eng.references())
            out = h.result()
            st_ = eng.cff_stats
        if thr > 1:
            assert out.token_ids == ref and st_.blocks_freed == 0 and used == 5 * 9  # 133 tokens: 9 blocks
        else:
            # chunks at different positions: post-RoPE K is never identical, but similar enough to fuse
            assert st_.blocks_freed > 0 and used == 5 * 9 - st_.blocks_freed and len(out.token_ids) == 6


def test_prefix_blocks_are_shared_between_requests(model, chunks):
    prefix = [1] + chunks[0][:40]
    reqs = [
        dict(prefix=prefix, question=model.encode(q), mode="full", params=SamplingParams(max_new_tokens=5))
        for q in ("Lily", "Tom ran")
    ]
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as eng:
        hs = [eng.submit(**r) for r in reqs]
        eng.step()  # both prefilled in one step
        assert hs[1].request.metrics.blocks_shared_at_load == 5 * (41 // 16)
        eng.pool.manager.check(eng.references())
        outs = [h.result() for h in hs]
    assert [o.token_ids for o in outs] == [_reference(model, dict(r, chunks=[])) for r in reqs]


def test_blended_blocks_are_never_shared(model, chunks):
    """Only the exact head of a blended prompt is shared: never its blended rows, with anyone."""
    prefix = [1] + chunks[2][:20]  # 21 exact rows: one full block of 16
    kvs = [compute_chunk_kv(model, c) for c in chunks[:2]]
    base = dict(prefix=prefix, question=model.encode("Lily"), params=SamplingParams(max_new_tokens=8))
    blend = dict(base, chunks=kvs, mode="blend")
    exact = dict(base, chunks=chunks[:2], mode="full")
    head_blocks = 5 * (len(prefix) // 16)
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as eng:
        first = eng.submit(**blend)
        eng.step()  # the blended prompt's blocks are live (and its head registered) from here on
        assert first.request.seq is not None and first.request.finish_reason is None
        again = eng.submit(**blend)  # same tokens, same chunks
        full = eng.submit(**exact)  # same tokens, computed exactly
        eng.step()
        assert again.request.metrics.blocks_shared_at_load == head_blocks
        assert full.request.metrics.blocks_shared_at_load == head_blocks
        eng.pool.manager.check(eng.references())
        outs = [h.result() for h in (first, again, full)]
    assert outs[2].token_ids == _reference(model, exact)
    assert outs[0].token_ids == outs[1].token_ids == _reference(model, dict(blend, chunks=chunks[:2]))


# ---- HACK ------------------------------------------------------------------------------------------------------
def test_hack_engine_matches_hack_cache_and_fuses_quantized_blocks(model, chunks):
    reqs = _reqs(model, chunks, 3, max_new=12)
    refs = []
    for r in reqs:
        res = prefill(model, r["prefix"], r["chunks"], r["question"], "full")
        refs.append(
            generate(model, res, r["params"], attention="hack", preset="paper", partition=16).token_ids
        )
    paper = {"preset": "paper"}  # HACK's own scheme (HackConfig()'s)
    with Engine(
        model,
        EngineConfig(
            num_blocks=600, attention="hack", hack=paper, settings=RequestSettings(ratio=DEFAULT_RATIO)
        ),
    ) as eng:
        assert [o.token_ids for o in eng.generate(reqs)] == refs
        hack_peak = eng.metrics().kv_bytes_peak
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as dense:
        dense.generate(reqs)
        assert hack_peak < dense.metrics().kv_bytes_peak / 4
    cfg = EngineConfig(
        num_blocks=600,
        attention="hack",
        bff=FusionConfig(threshold=0.95, every=3, **FUSE_MIDDLE),
        settings=RequestSettings(ratio=DEFAULT_RATIO),
    )
    with Engine(model, cfg) as eng:
        hs = [eng.submit(**r) for r in reqs]
        while eng.bff_stats.runs == 0:
            eng.step()
        assert not hasattr(eng.pool.backend, "k")  # no fp16 blocks: fusion read and wrote quantized pages
        for r in eng.scheduler.running:  # fused entries are sealed blocks
            s = r.seq
            assert all(j < s.state.sealed for layer in range(s.num_layers) for j in s.fused[layer])
        assert eng.bff_stats.blocks_freed > 0
        assert all(h.result().finish_reason == "length" for h in hs)


def _hack_pool(layers=1, hkv=3, d=64, blocks=400, rope=False, **hack):
    """A HACK pool; ``rope``: RoPE-aware keys (4 + 2 bits over two K partitions, random channel orders)."""
    from ragkv.attention.hack_cache import HackConfig
    from ragkv.attention.hack_quant import KeyPlan

    plans = None
    if rope:
        hack = {"k_bits": 3, "k_plan": "rope", "k_partition": 32, **hack}
        g = torch.Generator().manual_seed(7)
        orders = [torch.stack([torch.randperm(d, generator=g) for _ in range(hkv)]) for _ in range(layers)]
        plans = [KeyPlan(o, (4, 2)) for o in orders]
    cfg = HackConfig.preset("accurate", **{"partition": 16, "k_partition": 64, **hack})
    return KVPool(blocks, 16, layers, hkv, d, d**-0.5, hack_config=cfg, key_plans=plans)


def _kv(layers, n, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, n, hkv, d, generator=g) * 1.5 + torch.randn(layers, 1, hkv, d, generator=g) * 3
    return k, torch.randn(layers, n, hkv, d, generator=g)


def test_hack_pages_hold_no_fp16_shadow_and_staging_stays_bounded():
    """Byte accounting: the pool's physical KV is the quantized pages plus bounded fp16 staging."""
    pool = _hack_pool(layers=2, recent_window=32)
    hp = pool.hack
    assert not hasattr(pool.backend, "k") and pool.backend is hp  # no fp16 copy of any block
    assert pool.block_bytes == hp.layout.page_bytes < 0.23 * (2 * 16 * 3 * 64 * 2)
    seqs = []
    for i, n in enumerate((700, 650, 801)):
        s = PagedSequence(pool)
        s.load_prompt(*_kv(2, n, 3, 64, i))
        seqs.append(s)
        # open blocks: rows [sealed * bs, n) with sealed = (n - W) // bs: at most 47 rows, 3 blocks
        st = s.state
        assert st.kq == n - 32 and st.sealed == (n - 32) // 16 and len(st.open) == -(-n // 16) - st.sealed
    fp16 = sum(s.table.numel() for s in seqs) * 2 * 16 * 3 * 64 * 2
    physical = pool.manager.num_used * pool.block_bytes + hp.staging_nbytes()
    assert pool.nbytes() == hp.pages.nbytes + hp.staging_nbytes() + 2 * 2 * 2 * 3 * 64  # + smoothing stats
    # ~700-token sequences: pages 0.227x fp16 + 3 staging slots and 4 sink rows per sequence (0.31x measured)
    assert physical / fp16 < 0.33
    for s in seqs:
        s.release()
    assert hp.stage.in_use == 0 and hp.sinks.in_use == 0 and pool.manager.num_used == 0


@pytest.mark.parametrize("rope", [False, True], ids=["uniform", "rope-keys"])
def test_hack_batched_decode_equals_the_per_sequence_reference(rope):
    """One batched call (sinks, window, K smoothing, clip search, RoPE-aware key bits) = hack_attention
    on each sequence's view."""
    from ragkv.attention.hack_ref import HackLayerView, hack_attention
    from ragkv.attention.hack_seq import HackAttendPlan

    pool = _hack_pool(layers=1, recent_window=8, rope=rope)
    hp, lay, bs = pool.hack, pool.hack.layout, 16
    seqs = []
    for i, n in enumerate((5, 40, 71, 130)):  # sinks only; open + sealed blocks; misaligned lengths
        s = PagedSequence(pool)
        s.load_prompt(*_kv(1, n, 3, 64, 10 + i))
        seqs.append(s)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(seqs), 9, 64, generator=g)
    sts = [s.state for s in seqs]
    lens = torch.tensor([s.length for s in seqs])
    plan = HackAttendPlan(
        pool,
        seqs,
        lens - 1,
        torch.tensor([st.kq for st in sts]),
        torch.tensor([st.sealed for st in sts]),
        lens,
        [st.open for st in sts],
    )
    out = plan.attend(0, q)
    v = hp.views
    for b, (s, hs) in enumerate(zip(seqs, sts, strict=True)):
        n, tab = s.length, s.table[0]
        r = torch.arange(hs.kq)
        rb, ro = tab[r // bs], r % bs
        kpos = torch.where(r < hp.sink_tokens, torch.full_like(r, 10**9), r)  # sink rows: read in fp16
        sealed = tab[: hs.sealed]
        orows = torch.arange(hs.sealed * bs, n)
        slot = torch.tensor(hs.open)[(orows - hs.sealed * bs) // bs]
        ok, ov = hp.stage.k[slot, 0, orows % bs], hp.stage.v[slot, 0, orows % bs]
        tail = orows < hs.kq
        ns = min(hp.sink_tokens, n)
        view = HackLayerView(
            bits=lay.bits,
            k_part=lay.k_partition,
            v_part=bs,
            head_dim=64,
            k_packed=v.k_packed[rb, ro],
            k_scale=v.k_scale[rb, ro],
            k_min=v.k_min[rb, ro],
            k_sum=v.k_sum[rb, ro],
            k_pos=kpos,
            v_packed=v.v_packed[sealed].reshape(-1, 3, lay.packed_width),
            v_scale=v.v_scale[sealed],
            v_min=v.v_min[sealed],
            v_sum=v.v_sum[sealed],
            v_tail=ov[tail],
            dense_k=torch.cat([hp.sinks.k[hs.sink, 0, :ns], ok[~tail & (orows >= ns)]]),
            dense_v=torch.cat([hp.sinks.v[hs.sink, 0, :ns], ov[~tail & (orows >= ns)]]),
            dense_pos=torch.cat([torch.arange(ns), orows[~tail & (orows >= ns)]]),
            k_shift=hp.k_shift[0],
            q_mul=hp.k_div[0],
            k_bits=lay.k_bits,
            k_order=hp.k_order[0] if rope else None,
        )
        assert view.key_bits == ((4, 2) if rope else (2,))
        ref = hack_attention(view, q[b : b + 1], torch.tensor([n - 1]), pool.scale)[0]
        assert torch.allclose(out[b].float(), ref, atol=2e-4, rtol=2e-4), (n, (out[b] - ref).abs().max())


def test_rope_key_pages_read_back_in_the_model_order():
    """BFF reads sealed blocks back: K in the model's channel order and basis, within the code error."""
    errs = {}
    for rope in (False, True):
        pool = _hack_pool(layers=2, recent_window=16, rope=rope)
        k, v = _kv(2, 160, 3, 64, 3)
        s = PagedSequence(pool)
        s.load_prompt(k, v)
        sealed = s.state.sealed
        kr, vr = pool.read_blocks(s.table[1, :sealed], 1)
        kr, vr = kr.flatten(0, 1)[4:], vr.flatten(0, 1)[4:]  # the 4 sink rows live in fp16 slots
        want = k[1, 4 : sealed * 16]
        errs[rope] = float((kr - want).square().mean() / want.square().mean())
        assert float((vr - v[1, 4 : sealed * 16]).abs().max()) < 1.5
    # 4 + 2 bits (random channel orders here) sit between the 2-bit and 4-bit errors; a wrong
    # inverse order would be an error of order 1
    assert errs[True] < errs[False] < 0.2, errs


def test_hack_engine_with_the_rope_preset_resolves_key_plans(model, chunks, tmp_path, monkeypatch):
    """``hack={"preset": "rope"}`` gets the model's calibrated key plans (channel orders) in the pages.

    The tiny model's head_dim 8 is one K partition, so its keys are 4-bit here (3 needs two)."""
    import ragkv.model.rope_energy as cal
    from ragkv.attention.hack_cache import HackConfig
    from ragkv.attention.hack_quant import HackError

    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "_ENERGY", {})
    reqs = _reqs(model, chunks, 3, max_new=3)
    assert _first_step_kl_cfg(model, reqs, HackConfig.preset("rope", partition=16, k_bits=4)) < 0.02
    with Engine(
        model,
        EngineConfig(
            attention="hack",
            hack={"preset": "rope", "k_bits": 4},
            settings=RequestSettings(ratio=DEFAULT_RATIO),
        ),
    ) as eng:
        hp = eng.pool.hack
        assert hp.k_order.shape == (model.config.num_layers, model.config.num_kv_heads, 8)
        assert hp.layout.key_bits == (4,) and cal.energy_path(model.fingerprint).is_file()
        assert len(eng.submit(**reqs[0]).result().token_ids) == 3
    with pytest.raises(HackError, match="cannot average 3 bits"):  # head_dim 8: one partition
        Engine(
            model,
            EngineConfig(
                attention="hack", hack={"preset": "rope"}, settings=RequestSettings(ratio=DEFAULT_RATIO)
            ),
        )


def test_engine_hack_defaults_to_rope_keys_where_the_head_allows(model, tmp_path, monkeypatch):
    """The engine's HACK default: RoPE-aware 3-bit keys (head_dim >= 64), else keys as wide as values."""
    import ragkv.model.rope_energy as cal

    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "_ENERGY", {})
    wide = random_model(
        "llama", seed=2, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=64, max_position_embeddings=256,
    )  # fmt: skip
    with Engine(
        wide, EngineConfig(attention="hack", num_blocks=32, settings=RequestSettings(ratio=DEFAULT_RATIO))
    ) as eng:
        hp = eng.pool.hack
        assert hp.cfg.k_plan == "rope" and hp.layout.key_bits == (4, 2) and hp.k_order.shape == (2, 1, 64)
        assert hp.cfg.recent_window == 32 and hp.cfg.k_smooth == "mean_scale"
        out = eng.submit(prefix=[1, 5, 7, 9] * 10, max_new_tokens=2).result()
        assert len(out.token_ids) == 2
    for m, hack in ((wide, {"bits": 4}), (model, {})):  # code widths asked for; a head of 8 channels
        with Engine(
            m,
            EngineConfig(
                attention="hack", hack=hack, num_blocks=32, settings=RequestSettings(ratio=DEFAULT_RATIO)
            ),
        ) as eng:
            hp = eng.pool.hack
            assert hp.cfg.k_plan == "uniform" and hp.k_order is None and hp.cfg.recent_window == 32
    # keys wider than values in model order (no plan): 4-bit key pages over 2-bit values
    with Engine(
        wide,
        EngineConfig(
            attention="hack", hack={"k_bits": 4}, num_blocks=32, settings=RequestSettings(ratio=DEFAULT_RATIO)
        ),
    ) as eng:
        assert eng.pool.hack.layout.key_bits == (4,) and eng.pool.hack.k_order is None
        assert len(eng.submit(prefix=[1, 5, 7, 9] * 10, max_new_tokens=2).result().token_ids) == 2


def test_hack_error_controls_lower_the_kl_against_fp16(model, chunks):
    """On the trained tiny model: the accurate preset's controls on pages cut the first-step KL vs fp16."""
    from ragkv.attention.hack_cache import HackConfig

    reqs = _reqs(model, chunks, 3)
    kl = {
        name: _first_step_kl_cfg(model, reqs, cfg)
        for name, cfg in (
            ("paper", HackConfig(partition=16)),
            ("accurate", HackConfig.preset("accurate", partition=16, recent_window=32)),
        )
    }
    assert kl["accurate"] < kl["paper"] / 5, kl


def _first_step_kl_cfg(model, reqs, cfg) -> float:
    """Mean KL of the first decode step's next-token distribution: HACK pages (``cfg``) vs dense blocks."""
    from ragkv.metrics import first_token_kl

    kls = []
    for r in reqs:
        res = prefill(model, r["prefix"], r["chunks"], r["question"], "full")
        tok = int(res.logits.argmax())
        out = []
        for c in (None, cfg):
            s = PagedSequence(KVPool.for_model(model, 200, 16, hack_config=c))
            s.load_prompt(res.kv.k, res.kv.v)
            out.append(batched_decode_step(model, [s], [tok])[0])
        kls.append(first_token_kl(out[0], out[1]))
    return sum(kls) / len(kls)


# ---- block accounting under random admit / cancel / finish ------------------------------------------------------
_tiny = {}


def _tiny_model():
    if "m" not in _tiny:
        _tiny["m"] = random_model(
            "llama",
            seed=1,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=256,
        )
        g = torch.Generator().manual_seed(0)
        toks = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 14, 20)]
        _tiny["chunks"] = [compute_chunk_kv(_tiny["m"], t) for t in toks]
    return _tiny["m"], _tiny["chunks"]


op = st.one_of(
    st.tuples(
        st.just("submit"),
        st.integers(0, 2),
        st.integers(1, 40),
        st.integers(0, 9),
        st.sampled_from(["full", "blend", "prefix"]),
        st.lists(st.integers(0, 2), max_size=3),
    ),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=25),
    thr=st.sampled_from([0.2, 0.8, 1.1]),
    attn=st.sampled_from(["norm", "replicate"]),
)
def test_block_accounting_never_leaks_or_double_frees(ops, thr, attn):
    m, kvs = _tiny_model()
    prefixes = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 5, 6, 7, 8, 9, 10, 11, 13], [1]]
    cfg = EngineConfig(
        block_size=4,
        num_blocks=160,
        share_prefix_blocks=True,
        scheduler=SchedulerConfig(max_queue=6, max_num_seqs=4, max_prefill_tokens=64),
        bff=FusionConfig(threshold=thr, every=2, attention=attn, skip_first=1, skip_last=1),
        cff=FusionConfig(threshold=thr, every=2, chunk_tokens=8, attention=attn, skip_first=1, skip_last=1),
        settings=RequestSettings(ratio=DEFAULT_RATIO),
    )
    eng = Engine(m, cfg)
    handles = []
    try:
        for o in ops:
            if o[0] == "submit":
                _, p, qlen, new, mode, cs = o
                try:
                    handles.append(
                        eng.submit(
                            prefix=prefixes[p],
                            chunks=[kvs[i] for i in cs],
                            question=list(range(3, 3 + qlen)),
                            mode=mode,
                            max_new_tokens=new,
                        )
                    )
                except (EngineBusyError, RequestTooLargeError):
                    pass
            elif o[0] == "cancel" and handles:
                handles[o[1] % len(handles)].cancel()
            else:
                for _ in range(o[1]):
                    eng.step()
            eng.pool.manager.check(eng.references())
        eng.run_until_idle(timeout=60)
        eng.pool.manager.check({})
        assert eng.pool.manager.num_used == 0
        assert all(h.request.finish_reason in ("length", "stop", "cancelled") for h in handles)
    finally:
        eng.shutdown()


# ---- preemption when blocks run out ------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["fp16", "hack"])
def test_blocks_running_out_preempt_the_newest_request_which_is_recomputed(model, chunks, attention):
    """Admission takes only the prompt's blocks, so decoding outgrows the pool: the newest running request
    gives its blocks back and is recomputed (prompt + its tokens so far) later; greedy tokens unchanged."""
    reqs = [
        dict(
            prefix=[1],
            chunks=[c[:12]],
            question=model.encode(q),
            mode="full",
            params=SamplingParams(max_new_tokens=40),
        )
        for c, q in zip(chunks, ("Lily saw", "Tom ran", "The dog"), strict=False)
    ]
    # 5 layers x 2 prompt blocks each: all three are admitted, then they grow past the 40 blocks
    cfg = EngineConfig(
        num_blocks=40,
        attention=attention,
        hack={"preset": "paper"},
        settings=RequestSettings(ratio=DEFAULT_RATIO),
    )
    with Engine(model, cfg) as eng:
        hs = [eng.submit(**r) for r in reqs]
        while eng.has_unfinished():
            eng.step()
            eng.pool.manager.check(eng.references())
        m = eng.metrics()
        streams = [[e.token_id for e in h.stream()] for h in hs]  # each token streamed once
        assert m.preemptions >= 1 and m.requests_finished == 3 and m.kv_blocks_used == 0
        outs = [h.request.output() for h in hs]
        if attention == "hack":
            assert eng.pool.hack.stage.in_use == 0
    for o, r, got in zip(outs, reqs, streams, strict=True):
        assert o.finish_reason == "length" and got == o.token_ids
        if attention == "fp16":
            assert o.token_ids == _reference(model, r)


# ---- stop strings ---------------------------------------------------------------------------------------
def test_engine_stop_strings_never_leak_and_finish_reason_is_the_detokenizers(model, chunks):
    req = dict(prefix=[model.config.bos_token_id], chunks=chunks[:2], question=model.encode("Lily saw"))
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as eng:

        def run(**params) -> tuple[list, object]:
            h = eng.submit(**req, mode="blend", params=SamplingParams(**params))
            events = list(h.stream())
            return events, h.request.output()

        events, out = run(max_new_tokens=30)
        pieces = [e.text for e in events]
        whole = "".join(pieces)
        assert out.finish_reason == "length" == events[-1].finish_reason and out.text == whole
        for stop, n in stop_cases(pieces).values():
            want = whole[: whole.index(stop)]
            for max_new, reason, text in ((30, "stop", want), (n, "stop", want), (n - 1, "length", None)):
                text = "".join(pieces[:max_new]) if text is None else text
                events, out = run(max_new_tokens=max_new, stop=(stop,))
                assert "".join(e.text for e in events) == text == out.text
                assert events[-1].finish_reason == reason == out.finish_reason
                assert all(e.finish_reason is None for e in events[:-1])
                assert out.metrics.num_output_tokens == len(out.token_ids) == len(events)
        assert eng.pool.manager.num_used == 0


def test_cache_aware_admission_and_twins_run_one_after_the_other(model, chunks):
    """Issue 52: waiting exact-prefix requests are admitted longest cached share first; two that share an
    uncached prefix run one after the other, so the second hits the KV tree; answers stay exact."""
    head = [1] + chunks[0][:40]
    cold = dict(prefix=[1] + chunks[1][:40], question=model.encode("Tom"), mode="prefix")
    warm = dict(prefix=head, question=model.encode("Lily"), mode="prefix")
    one = SamplingParams(max_new_tokens=1)
    with Engine(model, EngineConfig(num_blocks=600, scheduler=SchedulerConfig(max_num_seqs=1))) as eng:
        eng.submit(prefix=head, question=model.encode("Sue"), mode="prefix", params=one)
        while eng.step():  # stepped by hand: no background thread reorders anything
            pass
        hs = [eng.submit(**r, params=SamplingParams(max_new_tokens=3)) for r in (cold, warm)]
        eng.step()  # one slot: the warm request (its head cached) goes first
        assert hs[1].request.metrics.prefill_start is not None and hs[0].request.metrics.prefill_start is None
        while eng.step():
            pass
        twin = dict(prefix=[1] + chunks[2][:40], mode="prefix", params=one)
        twins = [eng.submit(**twin, question=model.encode(q)) for q in "AB"]
        eng.step()  # the twins share 41 uncached tokens: one now, the other next step, from the tree
        started = [t.request.metrics.prefill_start is not None for t in twins]
        assert sorted(started) == [False, True]
        while eng.step():
            pass
        outs = [h.result() for h in hs]
        got = [t.result() for t in twins]
    assert outs[1].prefill_stats["cached_tokens"] >= len(head)
    first, second = (got[0], got[1]) if started[0] else (got[1], got[0])
    assert second.prefill_stats["cached_tokens"] >= 41 and first.prefill_stats["cached_tokens"] < 41
    for r, o in ((cold, outs[0]), (warm, outs[1])):
        ref = dict(r, chunks=[], mode="full", params=SamplingParams(max_new_tokens=3))
        assert o.token_ids == _reference(model, ref)


def test_a_finished_answer_is_committed_so_the_next_turn_reuses_it(model, chunks):
    """The engine route of a chat: the answer's KV reaches the KV tree when the request ends (as in
    ``generate.stream``), so a follow-up whose prompt repeats prompt + answer computes only what it adds."""
    prompt = [1] + chunks[0][:40] + model.encode("Lily saw")
    with Engine(model, EngineConfig(num_blocks=600, settings=RequestSettings(ratio=DEFAULT_RATIO))) as eng:
        first = eng.submit(prefix=prompt, mode="prefix", params=SamplingParams(max_new_tokens=6)).result()
        answer = first.token_ids
        assert answer
        turn = prompt + answer + model.encode("The dog ran to")
        assert eng.kv_tree.peek(model, turn) == len(prompt) + len(answer)
        second = eng.submit(prefix=turn, mode="prefix", params=SamplingParams(max_new_tokens=5)).result()
    assert second.prefill_stats["cached_tokens"] == len(prompt) + len(answer)
    assert second.token_ids == _reference(
        model, dict(prefix=turn, chunks=[], question=[], mode="full", params=SamplingParams(max_new_tokens=5))
    )


def test_the_engine_serves_an_llm_with_no_copies_of_its_parts():
    """Issue 55: the engine plans, resolves chunk KV and reuses exact prefixes with its LLM's planner,
    resolver and KV tree (the objects themselves); the config's settings are request defaults over the
    LLM's, and its KV adapter stays the LLM's."""
    from ragkv import LLM

    model = stories_model()
    llm = LLM(model, store=MemoryStore(), self_check_on_load=False)
    with Engine(llm, EngineConfig(num_blocks=64, settings=RequestSettings("full"))) as eng:
        assert eng.resolver is llm.resolver and eng.kv_tree is llm.kv_tree and eng.model is model
        assert eng.make_request([1, 5], [[6, 7, 8]], [9]).plan.mode == "full"  # the config's default
        assert eng.make_request([1, 5], [[6, 7, 8]], [9], mode="reuse").plan.mode == "reuse"
    assert llm.plan().mode != "full"  # the LLM itself is unchanged
    with pytest.raises(ValueError, match="adapter"):
        Engine(llm, EngineConfig(settings=RequestSettings(adapter="off")))
    alone = Engine(model, EngineConfig(num_blocks=64), store=MemoryStore())  # an LLM of its own
    assert (
        isinstance(alone.llm, LLM)
        and alone.resolver is alone.llm.resolver
        and alone.resolver.store is not None
    )
    alone.shutdown()


# ---- the decode kernel's paged attention ------------------------------------------------------------
def _needs_kernel():
    from ragkv.model import lowbit_kernel

    if lowbit_kernel.kernel() is None:
        pytest.skip(f"the decode kernel is unavailable: {lowbit_kernel.kernel_error()}")
    return lowbit_kernel.kernel()


@pytest.mark.parametrize("lengths", [[1], [17, 40, 3], [64, 33]])
def test_paged_attention_kernel_reads_the_blocks_in_place(lengths):
    """The kernel over block tables (blocks scattered in the pool, tables padded) equals gather + SDPA."""
    from ragkv.attention.paged import paged_attention

    kern = _needs_kernel()
    g = torch.Generator().manual_seed(len(lengths))
    bs, hkv, hq, d = 16, 3, 9, 64
    kp, vp = torch.randn(40, bs, hkv, d, generator=g), torch.randn(40, bs, hkv, d, generator=g)
    nb = max((n + bs - 1) // bs for n in lengths)
    tables = torch.randperm(40, generator=g)[: len(lengths) * nb].view(len(lengths), nb)
    q = torch.randn(len(lengths), hq, d, generator=g)
    lens = torch.tensor(lengths)
    got = kern.paged_decode_attention(q, kp, vp, tables, lens, 0.125)
    torch.testing.assert_close(got, paged_attention(q, kp, vp, tables, lens, 0.125), atol=2e-6, rtol=2e-5)


def test_batched_decode_on_the_kernel_matches_each_sequence_alone():
    """Head dim 64 (the kernel's paged attention runs): a batch of three prompts decodes each one's own
    tokens, logits as :func:`ragkv.generate.decode_step` alone within float rounding."""
    from ragkv.generate import decode_step, load_prompt, make_cache

    _needs_kernel()
    m = random_model("llama", seed=4, head_dim=64, hidden_size=256, num_attention_heads=4, init_std=0.1)
    prompts = [
        [1, 5, 9, 13, 17],
        [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56],
        [1, 2],
    ]
    pool = KVPool.for_model(m, num_blocks=3 * m.config.num_layers * 4, block_size=16)
    seqs, alone, toks = [], [], []
    for p in prompts:
        res = prefill(m, p, [], [], "full")
        s = PagedSequence(pool)
        s.load_prompt(res.kv.k, res.kv.v)
        c = make_cache(m, capacity=len(p) + 8)
        load_prompt(c, res)
        seqs.append(s)
        alone.append(c)
        toks.append(int(res.logits.argmax()))
    steps = []
    for i in range(6):
        batch = batched_decode_step(m, seqs, toks)
        single = torch.stack(
            [decode_step(m, c, t, len(p) + i) for c, t, p in zip(alone, toks, prompts, strict=True)]
        )
        torch.testing.assert_close(batch, single, atol=1e-4, rtol=1e-4)
        steps.append(batch.argmax(-1).tolist() == single.argmax(-1).tolist())
        toks = single.argmax(-1).tolist()
    assert all(steps)
    for s in seqs:
        s.release()


def test_paged_attention_kernel_refuses_tables_that_point_outside_the_pool():
    """A length beyond its table or a block id outside the pool is an error, never a read out of bounds."""
    kern = _needs_kernel()
    kp = vp = torch.zeros(4, 16, 3, 64)
    q = torch.zeros(1, 9, 64)
    with pytest.raises(RuntimeError, match="beyond its table"):
        kern.paged_decode_attention(q, kp, vp, torch.tensor([[0]]), torch.tensor([17]), 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        kern.paged_decode_attention(q, kp, vp, torch.tensor([[7]]), torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="beyond its table"):
        kern.paged_decode_attention(q, kp, vp, torch.tensor([[0]]), torch.tensor([0]), 0.125)
