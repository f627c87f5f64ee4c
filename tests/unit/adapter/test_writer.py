"""The chunk-KV writer (W-full, ragkv/adapter/writer.py): exactness invariants, trust checks, training."""

import pytest
import torch

from ragkv.adapter.kv_adapter import AdapterError, KVAdapter
from ragkv.adapter.train import TrainConfig, kl_loss, student_logp, teacher_example, train
from ragkv.adapter.writer import WriterLoRA
from ragkv.blend import prefill
from ragkv.fidelity.plan import RequestSettings
from ragkv.model import random_model
from ragkv.model.forward import compute_chunk_kv
from ragkv.testing import random_writer as _randomized
from ragkv.testing import writer_file as _story_writer
from tests.helpers import stories_model
from tests.unit.adapter.test_adapter import _items, _prompt


def test_an_untrained_writer_writes_todays_chunk_kv():
    m = random_model("llama", seed=7, init_std=0.1)
    ids = _prompt(m)[1][0]
    base = compute_chunk_kv(m, ids)
    w = WriterLoRA.for_model(m, 4).requires_grad_(False)
    same = compute_chunk_kv(w.model(m), ids)
    assert torch.equal(same.k, base.k) and torch.equal(same.v, base.v)
    moved = compute_chunk_kv(_randomized(m).model(m), ids)
    assert float((moved.k - base.k).abs().max()) > 1e-3 and float((moved.v - base.v).abs().max()) > 1e-3


def test_writer_kv_is_named_as_the_writers_and_ratio_one_still_equals_full():
    """KV a writer wrote carries a fingerprint naming the writer: the base model refuses it. Read
    as the writer's KV (the caller names the fingerprint it is read with), blend at ratio 1.0
    recomputes every row with the unchanged model, so it equals full prefill."""
    from ragkv.kv.chunk import KVMismatchError

    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    w = _randomized(m)
    named = [compute_chunk_kv(w.model(m), c) for c in chunks]
    assert all(kv.fingerprint == f"{m.fingerprint}+writer-{w.identity}" for kv in named)
    with pytest.raises(KVMismatchError):
        prefill(m, pre, named, suf, "reuse")
    kvs = [compute_chunk_kv(w.model(m), c, fingerprint=m.fingerprint) for c in chunks]
    full = prefill(m, pre, chunks, suf, "full")
    b1 = prefill(m, pre, kvs, suf, "blend", ratio=1.0)
    assert float((b1.logits - full.logits).abs().max() / full.logits.abs().max()) < 1e-4
    reuse = prefill(m, pre, kvs, suf, "reuse")
    plain = prefill(m, pre, [compute_chunk_kv(m, c) for c in chunks], suf, "reuse")
    assert float((reuse.logits - plain.logits).abs().max()) > 1e-3  # the writer does act on reuse


def test_each_adapter_kind_names_the_stored_kv_it_reads():
    """The blend asks the adapter which stored KV it reads (``kv_fingerprint``, ``writes_kv``: the
    :class:`~ragkv.blend.source.ChunkKVAdapter` interface): a KV adapter reads the model's own KV and
    refuses a writer's; a writer reads only the KV it wrote."""
    from ragkv.kv.chunk import KVMismatchError

    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    ad, w = KVAdapter.for_model(m, 4), _randomized(m)
    assert (ad.writes_kv, ad.kv_fingerprint(m)) == (False, m.fingerprint)
    assert w.writes_kv and w.kv_fingerprint(m) != m.fingerprint
    own = [compute_chunk_kv(m, c) for c in chunks]
    written = [compute_chunk_kv(w.model(m), c) for c in chunks]
    plain = prefill(m, pre, own, suf, "reuse")
    assert torch.equal(prefill(m, pre, own, suf, "reuse", adapter=ad).logits, plain.logits)
    via_writer = prefill(m, pre, written, suf, "reuse", adapter=w)
    assert via_writer.stats["adapter"] == w.identity
    assert float((via_writer.logits - plain.logits).abs().max()) > 1e-3  # its own KV, not the model's
    with pytest.raises(KVMismatchError):
        prefill(m, pre, written, suf, "reuse", adapter=ad)
    with pytest.raises(KVMismatchError):
        prefill(m, pre, own, suf, "reuse", adapter=w)


def test_the_gradient_reaches_the_writer_through_the_whole_chunk_pass():
    m = random_model("llama", seed=7, init_std=0.1)
    ids = _prompt(m)[1][0]
    w = WriterLoRA.for_model(m, 4)
    with torch.no_grad():
        w.b_qkv.normal_(0, 0.05)
        w.b_o.normal_(0, 0.05)
    ((k, v),) = w.chunk_kvs(m, [ids])
    (k[-1].square().sum() + v[-1].square().sum()).backward()
    # the last layer's K/V depend on every earlier layer's q/k/v and o LoRA
    assert all(float(p.grad[: m.config.num_layers - 1].abs().sum()) > 0 for p in w.parameters())


def test_writer_file_round_trip_and_trust_checks(tmp_path):
    m = random_model("llama", seed=7, init_std=0.1)
    w = _randomized(m)
    path = tmp_path / "w.safetensors"
    digest = w.save(path, meta={"note": "test"})
    back = WriterLoRA.load(path, m, digest=digest)
    ids = _prompt(m)[1][0]
    assert torch.equal(compute_chunk_kv(back.model(m), ids).k, compute_chunk_kv(w.model(m), ids).k)
    assert back.identity == digest[:16]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    (tmp_path / "t.safetensors").write_bytes(bytes(raw))
    with pytest.raises(AdapterError, match="digest"):
        WriterLoRA.load(tmp_path / "t.safetensors", m, digest=digest)
    with pytest.raises(AdapterError, match="trained for model"):
        WriterLoRA.load(path, random_model("llama", seed=8, init_std=0.1))
    # a KV adapter is not a writer, nor the other way round
    KVAdapter.for_model(m, 2).save(tmp_path / "kv.safetensors")
    with pytest.raises(AdapterError, match="not a ragkv-writer-adapter"):
        WriterLoRA.load(tmp_path / "kv.safetensors", m)
    with pytest.raises(AdapterError, match="not a ragkv-kv-adapter"):
        KVAdapter.load(path, m)
    # a spec the writer cannot be built from is a clear AdapterError, never a bare TypeError/ValueError
    from ragkv.adapter.kv_adapter import write_adapter_file
    from ragkv.adapter.writer import FORMAT

    for bad, why in (({**w.spec.__dict__, "rank": 0}, "rank >= 1"), ({"rank": 2}, "unreadable spec")):
        write_adapter_file(tmp_path / "bad.safetensors", FORMAT, bad, w.state(), None)
        with pytest.raises(AdapterError, match=why):
            WriterLoRA.load(tmp_path / "bad.safetensors", m)


@pytest.mark.slow
def test_writer_training_lowers_the_kl_to_full_prefill_and_is_deterministic(tmp_path):
    m = stories_model()
    items = _items()
    ex = teacher_example(m, items[0], max_new=6)

    def kl_of(w):
        head = tuple(t.clone() for t in m.forward(torch.tensor(ex.prefix), capture_kv=True)[1:])
        with torch.no_grad():
            kvs = w.chunk_kvs(m, ex.chunks)
            return float(kl_loss(student_logp(m, None, ex, head, kvs), ex))

    cfg = TrainConfig(kind="writer", rank=2, epochs=4, batch=2, lr=1e-2, save_every=2)
    s1 = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False)
    assert s1["kind"] == "writer"
    trained = WriterLoRA.load(tmp_path / "a.safetensors", m, digest=s1["sha256"])
    assert kl_of(trained) < kl_of(WriterLoRA.for_model(m, 2))
    s2 = train(m, tmp_path / "b.safetensors", cfg, items=items, progress=False)
    assert s2["sha256"] == s1["sha256"]


@pytest.mark.slow
def test_training_continues_from_an_init_file_of_the_same_kind_and_shape_only(tmp_path):
    """``train(init=...)`` starts from a file (a GPU run continued on the CPU): with a zero learning
    rate the result is that file's tensors; a file of another kind or shape is refused."""
    m = stories_model()
    items = _items()
    first = TrainConfig(kind="writer", rank=2, epochs=1, batch=2, lr=1e-2, save_every=1)
    train(m, tmp_path / "a.safetensors", first, items=items, progress=False)
    start = WriterLoRA.load(tmp_path / "a.safetensors", m)
    frozen = TrainConfig(kind="writer", rank=2, epochs=1, batch=2, lr=0.0, save_every=1)
    s = train(
        m, tmp_path / "b.safetensors", frozen, items=items, progress=False, init=tmp_path / "a.safetensors"
    )
    back = WriterLoRA.load(tmp_path / "b.safetensors", m, digest=s["sha256"])
    assert all(torch.equal(t, start.state()[k]) for k, t in back.state().items())
    assert any(
        float(t.abs().sum()) > 0 for k, t in back.state().items() if k.startswith("b_")
    )  # not zero-init
    with pytest.raises(ValueError, match="not a"):
        other = TrainConfig(kind="writer", rank=4, epochs=1, batch=2, lr=0.0, save_every=1)
        train(
            m, tmp_path / "c.safetensors", other, items=items, progress=False, init=tmp_path / "a.safetensors"
        )
    KVAdapter.for_model(m, 2).save(tmp_path / "kv.safetensors")
    with pytest.raises(AdapterError, match="not a ragkv-writer-adapter"):
        train(
            m,
            tmp_path / "d.safetensors",
            first,
            items=items,
            progress=False,
            init=tmp_path / "kv.safetensors",
        )


def test_either_kind_of_adapter_file_resolves_by_its_format(tmp_path):
    """``load_adapter`` and an owner's ``resolve_adapter`` read either kind by its format."""
    from ragkv.adapter.shipped import load_adapter, resolve_adapter

    m = random_model("llama", seed=7, init_std=0.1)
    _randomized(m).save(tmp_path / "w.safetensors")
    KVAdapter.for_model(m, 2).save(tmp_path / "kv.safetensors")
    assert isinstance(load_adapter(tmp_path / "w.safetensors", m), WriterLoRA)
    assert isinstance(load_adapter(tmp_path / "kv.safetensors", m), KVAdapter)
    assert isinstance(resolve_adapter(m, str(tmp_path / "kv.safetensors"))[0], KVAdapter)
    assert resolve_adapter(m, str(tmp_path / "w.safetensors"))[1]  # explicit: used wherever KV is reused
    assert isinstance(resolve_adapter(m, str(tmp_path / "w.safetensors"))[0], WriterLoRA)


@pytest.mark.parametrize("context", [0, 7])
def test_one_packed_pass_writes_what_one_pass_per_chunk_writes(context):
    """``packed_chunk_kv_rows``: the head (BOS + context) once, every chunk after it in one pass, each
    seeing the head and itself only: the KV of one pass per chunk, with or without a writer."""
    from ragkv.model.forward import chunk_kv_rows, packed_chunk_kv_rows

    m = random_model("llama", seed=7, init_std=0.1)
    _, chunks, _ = _prompt(m, seed=3)
    chunks = [chunks[0][:5], chunks[1], chunks[2][:13]]
    ctx = _prompt(m, seed=4)[1][0][:context]
    for model in (m, _randomized(m).model(m)):
        packed = packed_chunk_kv_rows(model, chunks, ctx)
        for c, (k, v) in zip(chunks, packed, strict=True):
            _, k1, v1, _ = chunk_kv_rows(model, c, ctx)
            torch.testing.assert_close(k, k1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v1, rtol=1e-5, atol=1e-5)


def test_the_writers_student_with_the_blend_in_the_loop_is_the_served_blend():
    """``kind="writer"`` with ``blend_ratios``: on KV the writer writes with gradients, the student's
    first-token log-probs equal serving's blend on that KV read as the writer's, and the gradient
    reaches the writer through the stored rows the blend keeps."""
    from ragkv.adapter.train import Example
    from ragkv.blend.core import BlendSchedule

    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    w = _randomized(m)
    kvs = [compute_chunk_kv(w.model(m), c, fingerprint=m.fingerprint) for c in chunks]
    served = prefill(m, pre, kvs, suf, "blend", ratio=0.3)
    answer = [int(served.logits.argmax()), 5, 9]
    ex = Example(pre, chunks, suf, answer, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))
    head = tuple(t.clone() for t in m.forward(torch.tensor(pre), capture_kv=True)[1:])
    w.requires_grad_(True)
    pairs = w.chunk_kvs(m, chunks)
    lp = student_logp(m, None, ex, head, pairs, BlendSchedule(ratios=(0.3,)))
    torch.testing.assert_close(lp[0], torch.log_softmax(served.logits.float(), -1), rtol=1e-4, atol=1e-4)
    reuse = student_logp(m, None, ex, head, [(k.detach(), v.detach()) for k, v in pairs])
    assert float((reuse[0] - lp[0]).detach().abs().max()) > 1e-3  # the blend did recompute rows
    lp[1:].sum().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in w.parameters())


PROMPT = (
    "",
    ["Lily had a red ball. She played in the park.", "Tom ran to the shop with his dog."],
    "What did Lily have?",
)


def test_an_llm_with_a_writer_writes_reads_and_keys_only_the_writers_kv(tmp_path):
    """``LLM(adapter=WRITER_FILE)``: chunk KV is written through the writer and keyed by its
    fingerprint, so one store holds both kinds and neither reads the other's; the blend at ratio 1.0
    still equals full prefill of the unchanged model; the writer is named in the stats; a resolver of
    another KV writer is refused, by an LLM and by the engine."""
    from ragkv import LLM
    from ragkv.engine import Engine, EngineConfig
    from ragkv.store import LocalDirStore

    m, path = _story_writer(tmp_path)
    store = LocalDirStore(tmp_path / "kv")
    with_w = LLM(m, store=store, adapter=str(path))
    base = LLM(m, store=store, adapter=None)
    assert with_w.kv_model.fingerprint == f"{m.fingerprint}+writer-{with_w.adapter.identity}"
    full = base.prefill(*PROMPT, mode="full")
    b1 = with_w.prefill(*PROMPT, mode="blend", ratio=1.0)
    assert float((b1.logits - full.logits).abs().max() / full.logits.abs().max()) < 1e-4
    reuse_w = with_w.prefill(*PROMPT, mode="reuse")
    assert reuse_w.stats["adapter"] == with_w.adapter.identity
    keys_w = set(store.keys())
    assert keys_w and all(store.header(k).fingerprint == with_w.kv_model.fingerprint for k in keys_w)
    reuse_b = base.prefill(*PROMPT, mode="reuse")  # the same chunks: the base model's own KV, computed
    assert float((reuse_b.logits - reuse_w.logits).abs().max()) > 1e-3
    keys_b = set(store.keys()) - keys_w
    assert len(keys_b) == len(keys_w) and all(store.header(k).fingerprint == m.fingerprint for k in keys_b)
    # written once, read back from the store by a fresh LLM with the same writer: the same answer
    again = LLM(m, store=LocalDirStore(tmp_path / "kv"), adapter=str(path)).prefill(*PROMPT, mode="reuse")
    torch.testing.assert_close(again.logits, reuse_w.logits)
    with pytest.raises(ValueError, match="another model's"):
        base.with_resolver(with_w.resolver)
    with pytest.raises(ValueError, match="another model's"):
        Engine(m, EngineConfig(settings=RequestSettings(adapter=str(path))), resolver=base.resolver)
    for mode in ("full", "prefix"):  # modes that read no stored KV run with the writer's KV stored
        assert with_w.prefill(*PROMPT, mode=mode).stats["adapter"] is None
    with pytest.raises(AdapterError, match="being trained"):  # its KV could not be named
        LLM(m, adapter=WriterLoRA.load(path, m).requires_grad_(True))


def test_the_engine_serves_a_writer_as_the_blend_reads_its_kv(tmp_path):
    """``Engine`` with a writer (``EngineConfig(settings=RequestSettings(adapter=WRITER_FILE))``): the chunk KV it computes is the
    writer's, and its greedy tokens are those of the blend over that KV on the unchanged model."""
    from ragkv.engine import Engine, EngineConfig
    from ragkv.generate import SamplingParams, generate

    m, path = _story_writer(tmp_path)
    w = WriterLoRA.load(path, m)
    bos, chunks, q = [m.config.bos_token_id], [m.encode(t) for t in PROMPT[1]], m.encode(PROMPT[2])
    params = SamplingParams(max_new_tokens=6)
    with Engine(m, EngineConfig(num_blocks=200, settings=RequestSettings(adapter=str(path)))) as eng:
        (out,) = eng.generate([dict(prefix=bos, chunks=chunks, question=q, mode="reuse", params=params)])
        assert {kv.fingerprint for kv in map(eng.resolver.kv, chunks)} == {w.kv_fingerprint(m)}
    res = prefill(m, bos, [compute_chunk_kv(w.model(m), c) for c in chunks], q, "reuse", adapter=w)
    assert out.token_ids == generate(m, res, params).token_ids
    plain = prefill(m, bos, [compute_chunk_kv(m, c) for c in chunks], q, "reuse")
    assert float((plain.logits - res.logits).abs().max()) > 1e-3  # the writer's KV is not the model's


def test_the_gate_runs_a_writer_at_its_own_reports_point_and_reads_through_it(tmp_path):
    """A writer is never off: without a (model, writer) report the gate's point is exact prefill (no
    stored KV read); every plan that reuses stored KV reads it as the writer's."""
    from ragkv import LLM

    m, path = _story_writer(tmp_path)
    llm = LLM(m, adapter=str(path))
    floor = llm.plan()  # the tiny model and its writer have no report: exact prefill
    assert floor.mode == "prefix" and floor.adapter is None
    for mode, ratio in (("reuse", None), ("blend", 0.3)):
        p = llm.plan(RequestSettings(mode, ratio))
        assert p.adapter is llm.adapter and p.prefill_args()["adapter"] is llm.adapter
    from ragkv.kv.chunk import KVMismatchError

    kvs = [compute_chunk_kv(llm.kv_model, c) for c in (m.encode(t) for t in PROMPT[1])]
    ids = m.encode("Q?")
    with pytest.raises(KVMismatchError):  # a writer's KV read as the base model's: refused
        prefill(m, [], kvs, ids, "reuse")
    prefill(m, [], kvs, ids, "reuse", adapter=llm.adapter)


def test_with_the_pairs_report_the_gate_runs_a_writer_at_its_point(fidelity_cache, tmp_path):
    """``ragkv calibrate --adapter WRITER``'s report (the pair's) is the one the gate reads for a
    writer: ``floor`` runs at the pair's faithful point, through the writer, and says so."""
    from ragkv import LLM
    from ragkv.fidelity import GATE
    from tests.unit.adapter.test_adapter import _pair_reports

    m, path = _story_writer(tmp_path)
    llm = LLM(m, adapter=str(path))
    _pair_reports(m, llm.adapter)  # the model alone: exact; the pair: blend@0.5 meets the floor
    GATE.forget()
    floor = llm.plan()
    assert (floor.mode, floor.ratio) == ("blend", 0.5) and floor.adapter is llm.adapter
    res = llm.prefill(*PROMPT)
    assert res.stats["adapter"] == llm.adapter.identity and res.stats["fidelity"]["point"] == "blend@0.5"


@pytest.mark.slow  # the RAG end to end (the embedder's load): the whole suite's tier
def test_a_rag_over_a_writer_llm_ingests_and_answers_through_the_writer(tmp_path, embedder):
    """``RAG(LLM(adapter=WRITER_FILE))``: ingest stores every chunk's KV as the writer's (keyed by its
    fingerprint) and an answer reuses exactly those chunks, its stats naming the writer."""
    from ragkv import LLM
    from ragkv.blend import DEFAULT_RATIO
    from ragkv.rag import RAG, Document

    m, path = _story_writer(tmp_path)
    llm = LLM(m, adapter=str(path))
    rag = RAG(llm, tmp_path / "data", embedder=embedder, chunk_tokens=32, ratio=DEFAULT_RATIO)
    try:
        rag.ingest([Document(PROMPT[1][0] + " " + PROMPT[1][1], "d")])
        keys = rag.store.keys()
        assert keys and {rag.store.header(k).fingerprint for k in keys} == {llm.kv_model.fingerprint}
        ans = rag.answer("What did Lily have?")
        assert ans.stats["adapter"] == llm.adapter.identity and ans.stats["num_reused_rows"] > 0
        assert ans.stats["kv_hits"] > 0 and ans.stats["kv_misses"] == 0  # the writer's stored KV, read
    finally:
        rag.close()
