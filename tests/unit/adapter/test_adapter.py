"""KV adapters (ragkv/adapter): the exactness invariants, the file's trust checks, and training."""

import json
import logging
import shutil

import pytest
import torch

from ragkv.adapter.data import Item
from ragkv.adapter.kv_adapter import AdapterError, KVAdapter
from ragkv.adapter.train import TrainConfig, kl_loss, student_logp, teacher_example, train
from ragkv.blend import prefill
from ragkv.fidelity.plan import RequestSettings
from ragkv.model import random_model
from ragkv.model.forward import compute_chunk_kv
from tests.helpers import stories_model


def _prompt(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = model.config.vocab_size

    def r(n):
        return torch.randint(3, v, (n,), generator=g).tolist()

    return [1] + r(5), [r(20) for _ in range(3)], r(6)


def _randomized(model, rank=4, seed=1) -> KVAdapter:
    ad = KVAdapter.for_model(model, rank, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (ad.bias_k, ad.bias_v, ad.up_k, ad.up_v):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return ad


@pytest.mark.parametrize("rank", [0, 4])
def test_a_loaded_adapter_corrects_as_the_trained_one(tmp_path, rank):
    """A frozen (loaded) adapter reads its per-layer tensors joined once; it
    gives what the training path gives, and a retrained one is never read from a stale join."""
    m = random_model("llama", seed=7, init_std=0.1)
    ad = _randomized(m, rank=rank)
    k = torch.randn(37, m.config.num_kv_heads, m.config.head_dim)
    v = torch.randn(37, m.config.num_kv_heads, m.config.head_dim)
    want = [ad.correct(layer, k, v) for layer in range(m.config.num_layers)]  # the training path
    ad.save(tmp_path / "a.safetensors")
    loaded = KVAdapter.load(tmp_path / "a.safetensors", m)
    for layer, (wk, wv) in enumerate(want):
        gk, gv = loaded.correct(layer, k, v)
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want[0][0], k)  # the adapter does change the rows
    before = loaded.correct(0, k, v)[0].clone()
    with torch.no_grad():
        loaded.bias_k.add_(1.0)  # changed in place after a first use: the join is rebuilt
    torch.testing.assert_close(loaded.correct(0, k, v)[0], before + 1.0)


def test_an_untrained_adapter_changes_nothing_and_ratio_one_ignores_any_adapter():
    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    reuse = prefill(m, pre, kvs, suf, "reuse")
    same = prefill(m, pre, kvs, suf, "reuse", adapter=KVAdapter.for_model(m, 4))
    assert torch.equal(same.logits, reuse.logits)
    ad = _randomized(m)
    moved = prefill(m, pre, kvs, suf, "reuse", adapter=ad)
    assert float((moved.logits - reuse.logits).abs().max()) > 1e-3  # the adapter does act on reuse
    assert moved.stats["adapter"] == ad.identity and reuse.stats["adapter"] is None
    full = prefill(m, pre, kvs, suf, "full")
    b1 = prefill(m, pre, kvs, suf, "blend", ratio=1.0, adapter=ad)
    assert float((b1.logits - full.logits).abs().max() / full.logits.abs().max()) < 1e-4
    assert float((b1.kv.k - full.kv.k).abs().max() / full.kv.k.abs().max()) < 1e-4


def test_a_pipelined_source_corrects_on_its_loader_thread_as_the_sequential_one_does():
    """Where the prefill pipelines loading (the resolver's default), the adapter's correction runs on
    the loader thread, overlapping the blender's compute; the logits are the sequential source's, and
    a source without the transform hook is still read through the adapter."""
    import threading

    from ragkv.blend.pipeline import pipelined_factory
    from ragkv.blend.source import LayerSource

    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    ad = _randomized(m)
    threads: list[str] = []
    correct = ad.correct

    def spy(layer, k, v):
        threads.append(threading.current_thread().name)
        return correct(layer, k, v)

    ad.correct = spy
    seq = prefill(m, pre, kvs, suf, "blend", ratio=0.3, adapter=ad)
    assert set(threads) == {threading.current_thread().name}
    threads.clear()
    piped = prefill(m, pre, kvs, suf, "blend", ratio=0.3, adapter=ad, source_factory=pipelined_factory(m))
    assert len(threads) == m.config.num_layers and all(t.startswith("ragkv-kv-load") for t in threads)
    torch.testing.assert_close(piped.logits, seq.logits, rtol=1e-5, atol=1e-5)

    class Bare:  # a source of another kind: pieces and layer() only
        def __init__(self, pieces):
            self.inner = LayerSource(pieces, m.device, m.dtype)
            self.pieces = pieces

        def layer(self, layer):
            return self.inner.layer(layer)

        def close(self):
            pass

    bare = prefill(m, pre, kvs, suf, "blend", ratio=0.3, adapter=ad, source_factory=Bare)
    torch.testing.assert_close(bare.logits, seq.logits, rtol=1e-5, atol=1e-5)
    plain = prefill(m, pre, kvs, suf, "blend", ratio=0.3, source_factory=Bare)
    assert float((plain.logits - seq.logits).abs().max()) > 1e-3  # the adapter acted on the bare source


def test_adapter_file_round_trip_and_trust_checks(tmp_path):
    m = random_model("llama", seed=7, init_std=0.1)
    ad = _randomized(m)
    path = tmp_path / "a.safetensors"
    digest = ad.save(path, meta={"note": "test"})
    back = KVAdapter.load(path, m, digest=digest)
    k, v = (
        torch.randn(5, m.config.num_kv_heads, m.config.head_dim),
        torch.randn(5, m.config.num_kv_heads, m.config.head_dim),
    )
    ad.requires_grad_(False)  # both frozen: the same path, so the file round trip is exact
    assert all(torch.equal(a, b) for a, b in zip(ad.correct(2, k, v), back.correct(2, k, v), strict=True))
    assert back.identity == digest[:16]
    # tampered: one byte of the body changed
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    bad = tmp_path / "tampered.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(AdapterError, match="digest"):
        KVAdapter.load(bad, m, digest=digest)
    # truncated / corrupt
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:100])
    with pytest.raises(AdapterError, match="unreadable"):
        KVAdapter.load(cut, m)
    # another model's adapter
    other = random_model("llama", seed=8, init_std=0.1)
    with pytest.raises(AdapterError, match="trained for model"):
        KVAdapter.load(path, other)
    with pytest.raises(AdapterError, match="no adapter file"):
        KVAdapter.load(tmp_path / "missing.safetensors", m)
    # a file of another format
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign), metadata={"format": "other"})
    with pytest.raises(AdapterError, match="not a"):
        KVAdapter.load(foreign, m)


def _items():
    text = [
        "Tom had a red ball. He liked to play with it in the park.",
        "Lily saw a big dog. The dog was happy and ran to her.",
        "The sun was hot. Sam went to the pond to swim.",
    ]
    return [
        Item("continue", text, None, suffix_text="One day, Tom", id="c0"),
        Item("continue", text[::-1], None, suffix_text="Lily said", id="c1"),
    ]


@pytest.mark.slow
def test_training_lowers_the_kl_to_full_prefill_resumes_and_is_deterministic(tmp_path):
    m = stories_model()
    items = _items()
    exs = [teacher_example(m, it, max_new=6) for it in items]
    assert all(0 < len(e.answer) <= 6 and e.top_ids.shape[0] == len(e.answer) for e in exs)

    def kl_of(ad):
        head = m.forward(torch.tensor(exs[0].prefix), capture_kv=True)[1:]
        kvs = [compute_chunk_kv(m, c) for c in exs[0].chunks]
        head = tuple(t.clone() for t in head)
        kvs = [(c.k.clone(), c.v.clone()) for c in kvs]
        with torch.no_grad():
            return float(kl_loss(student_logp(m, ad, exs[0], head, kvs), exs[0]))

    cfg = TrainConfig(rank=2, epochs=4, batch=2, lr=2e-2, save_every=2)
    s1 = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False)
    trained = KVAdapter.load(tmp_path / "a.safetensors", m, digest=s1["sha256"])
    assert kl_of(trained) < kl_of(KVAdapter.for_model(m, 2))
    # the same seed and data give the same file; a run resumed from its checkpoint finishes the same
    s2 = train(m, tmp_path / "b.safetensors", cfg, items=items, progress=False)
    assert s2["sha256"] == s1["sha256"]
    assert json.loads(json.dumps({k: v for k, v in s1.items() if k != "curve"}))["steps"] == 4


@pytest.mark.slow
def test_a_primed_student_is_trained_on_kv_written_after_its_context_and_resumes_only_its_own_run(tmp_path):
    """``student_context`` (issue 38's context-primed candidate): the student's chunk KV is written
    after those tokens; a finished checkpoint of another student is not taken for this one's."""
    m = stories_model()
    items = _items()
    cfg = TrainConfig(rank=2, epochs=1, batch=2, lr=2e-2, save_every=1)
    ctx = m.encode("Once upon a time there was a little dog who liked to run in the park.")
    plain = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False)
    primed = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False, student_context=ctx)
    assert primed["sha256"] != plain["sha256"]  # the same checkpoint path: not resumed as finished
    again = train(m, tmp_path / "b.safetensors", cfg, items=items, progress=False, student_context=ctx)
    assert again["sha256"] == primed["sha256"]


@pytest.mark.slow
def test_a_checkpoint_written_before_a_config_field_existed_resumes_and_another_runs_does_not(
    tmp_path, caplog
):
    """A field added to ``TrainConfig`` later (``num_links``) is missing from older checkpoints: they
    resume as their defaults' run; a checkpoint of another config starts over, with a warning."""
    m = stories_model()
    items = _items()
    cfg = TrainConfig(rank=2, epochs=1, batch=2, lr=2e-2, save_every=1)
    first = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False)
    assert first["resumed_from"] == 0
    ckpt = tmp_path / "a.ckpt.pt"
    st = torch.load(ckpt, weights_only=False)
    del st["config"]["num_links"]  # as written before the field existed
    torch.save(st, ckpt)
    again = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False)
    assert again["resumed_from"] == again["steps"] and again["sha256"] == first["sha256"]
    st["config"]["lr"] = 1e-3  # another run's checkpoint at this path
    torch.save(st, ckpt)
    with caplog.at_level(logging.WARNING, logger="ragkv.adapter.train"):
        other = train(m, tmp_path / "a.safetensors", cfg, items=items, progress=False)
    assert other["resumed_from"] == 0 and other["sha256"] == first["sha256"]
    assert "another run's checkpoint" in caplog.text


# ---- the gate decides where an adapter is used --------------------------------------------------------
def _pair_reports(model, adapter):
    """The model's own report (floor -> exact) and the (model, adapter) pair's (blend@0.5 meets it)."""
    import dataclasses

    from ragkv.fidelity.report import cache_path, save_report
    from tests.unit.fidelity.test_fidelity import _point, _report

    def ladder(reuse_same: float, blend_same: float) -> list:
        return [
            _point("exact", 1.0, 0.82, 1.1),
            _point("reuse", reuse_same, 0.1, 5.0),
            _point("blend@0.5", blend_same, 0.55, 1.8),
            _point("blend@0.9", 0.9, 0.85, 1.05),
        ]

    plain = _report(model, ladder(0.1, 0.5))
    pair = dataclasses.replace(_report(model, ladder(0.3, 0.85)), adapter=adapter.identity).seal()
    save_report(plain, cache_path(model.fingerprint))
    save_report(pair, cache_path(model.fingerprint, adapter=adapter.identity))


def test_the_gate_uses_an_adapter_only_where_its_own_report_wins(fidelity_cache, tmp_path, caplog):
    from ragkv import LLM

    m = stories_model()
    ad = _randomized(m)
    path = tmp_path / "a.safetensors"
    ad.save(path)
    llm = LLM(m, adapter=None)
    assert llm.adapter is None and llm.plan().adapter is None
    auto = LLM(m)  # "auto": no adapter ships for the test model
    assert auto.adapter is None
    with_file = LLM(m, adapter=path)
    # no report of the pair: off, said once
    with caplog.at_level(logging.WARNING, logger="ragkv.fidelity.choose"):
        assert with_file.plan().adapter is None
        assert with_file.plan().adapter is None
    assert sum("KV adapter" in r.message and "is off" in r.message for r in caplog.records) == 1
    # explicit ratios use the adapter the caller gave, outside the gate
    p = with_file.plan(RequestSettings("blend", 0.3))
    assert (
        p.adapter is with_file.adapter and p.outside_gate and p.prefill_args()["adapter"] is with_file.adapter
    )
    assert with_file.plan(RequestSettings("full")).adapter is None  # nothing stored is read in full prefill
    _pair_reports(m, with_file.adapter)
    from ragkv.fidelity import GATE

    GATE.forget()
    floor = with_file.plan()  # the model alone: exact; with the adapter blend@0.5 meets the floor
    assert (floor.mode, floor.ratio) == ("blend", 0.5) and floor.adapter is with_file.adapter
    assert floor.stats()["adapter"] == with_file.adapter.identity and not floor.outside_gate
    assert llm.plan().mode == "prefix"  # without the adapter the gate keeps exact prefill
    fast = with_file.plan(
        RequestSettings(fidelity="fast")
    )  # same speed, more answers kept: the adapter's reuse
    assert fast.mode == "reuse" and fast.adapter is with_file.adapter
    # an answer through the LLM says which adapter its prefill read through
    res = with_file.prefill("", ["Lily had a red ball.", "Tom ran to the park."], "What did Lily have?")
    assert res.stats["adapter"] == with_file.adapter.identity


def test_a_shipped_adapter_is_verified_by_its_digest(tmp_path, caplog):
    from ragkv.adapter.shipped import shipped_adapter

    m = random_model("llama", seed=7, init_std=0.1)
    ad = _randomized(m)
    digest = ad.save(tmp_path / "a.safetensors")
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({m.fingerprint: {"file": "a.safetensors", "sha256": digest, "rank": 4}}))
    assert shipped_adapter(m, manifest).identity == digest[:16]
    manifest.write_text(json.dumps({m.fingerprint: {"file": "a.safetensors", "sha256": "0" * 64, "rank": 4}}))
    with caplog.at_level(logging.WARNING):
        assert shipped_adapter(m, manifest) is None
    assert any("not using the shipped KV adapter" in r.message for r in caplog.records)
    assert (
        shipped_adapter(random_model("llama", seed=9, init_std=0.1), manifest) is None
    )  # none for that model


@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_the_students_blend_in_the_loop_is_the_served_blend(ratio):
    """``student_logp(schedule=...)`` (blend in the loop) gives the first-token log-probs that serving's
    blend gives on the same stored KV and adapter (the qpass choice made on the prompt alone, before
    the answer rows); at ratio 1.0 both are full prefill."""
    from ragkv.adapter.train import Example
    from ragkv.blend.core import BlendSchedule

    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    ad = _randomized(m)
    served = prefill(m, pre, kvs, suf, "blend", ratio=ratio, adapter=ad)
    answer = [int(served.logits.argmax()), 5, 9]
    ex = Example(pre, chunks, suf, answer, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))
    head = tuple(t.clone() for t in m.forward(torch.tensor(pre), capture_kv=True)[1:])
    pairs = [(c.k.clone(), c.v.clone()) for c in kvs]
    lp = student_logp(m, ad, ex, head, pairs, BlendSchedule(ratios=(ratio,)))
    assert lp.shape[0] == len(answer)  # the last prompt row, then each teacher-forced answer row
    torch.testing.assert_close(lp[0], torch.log_softmax(served.logits.float(), -1), rtol=1e-4, atol=1e-4)
    if ratio == 1.0:
        full = prefill(m, pre, kvs, suf, "full")
        torch.testing.assert_close(lp[0], torch.log_softmax(full.logits.float(), -1), rtol=1e-4, atol=1e-4)
    reuse = student_logp(m, ad, ex, head, pairs)
    assert float((reuse[0] - lp[0]).detach().abs().max()) > 1e-3  # the blend did recompute rows
    # the gradient reaches the adapter through the recomputed rows too
    loss = lp[0].logsumexp(-1) - lp[0].max()
    lp[1:].sum().add(loss).backward()
    assert all(p.grad is not None for p in (ad.bias_k, ad.up_k))


def test_blend_ratios_are_taken_in_turn_and_zero_is_reuse():
    cfg = TrainConfig(blend_ratios=(0.0, 0.3))
    assert cfg.schedule(0) is None and cfg.schedule(1).target_ratio == 0.3 and cfg.schedule(2) is None
    assert TrainConfig().schedule(5) is None


@pytest.mark.slow
def test_the_train_command_continues_from_init_with_blend_in_the_loop(tmp_path, capsys):
    """``ragkv adapter train``: one JSON line; ``--init`` continues from that file (its digest kept in the
    new file's metadata) with ``--blend-ratios``; malformed ratios are refused before any work."""
    from safetensors import safe_open

    from ragkv.cli import main
    from tests.helpers import stories_path

    small = ["--facts", "4", "--real", "0", "--continuations", "0"]
    # the tiny model's 512 positions hold none of the training prompts: refused clearly, before any work
    assert main(
        ["adapter", "train", "--model", str(stories_path()), "--out", str(tmp_path / "x"), "-q", *small]
    )
    assert "no training prompt fits the model's context of 512" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    model_dir = tmp_path / "long"  # the same weights with a longer context, for the plumbing
    shutil.copytree(stories_path(), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (model_dir / "config.json").write_text(json.dumps(cfg))
    base = ["adapter", "train", "--model", str(model_dir), "--rank", "2", "--epochs", "1", "--batch", "2"]
    base += [*small, "--threads", "1", "-q"]
    first = tmp_path / "a.safetensors"
    assert main([*base, "--out", str(first)]) == 0
    s1 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    second = tmp_path / "b.safetensors"
    args = [*base, "--out", str(second), "--init", str(first), "--blend-ratios", "0,0.3"]
    assert main(args) == 0
    s2 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s2["sha256"] != s1["sha256"]
    with safe_open(str(second), "pt") as f:
        meta = json.loads(f.metadata()["meta"])
    assert meta["init"] == s1["sha256"] and meta["config"]["blend_ratios"] == [0.0, 0.3]
    for bad in ("0.3,x", "1.5"):
        with pytest.raises(SystemExit, match="--blend-ratios"):
            main([*base, "--out", str(tmp_path / "c.safetensors"), "--blend-ratios", bad])


def test_blend_in_the_loop_refuses_a_selector_it_does_not_train():
    from ragkv.adapter.train import Example
    from ragkv.blend.core import BlendSchedule

    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    ex = Example(pre, chunks, suf, [5], torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2))
    head = tuple(t.clone() for t in m.forward(torch.tensor(pre), capture_kv=True)[1:])
    pairs = [(c.k.clone(), c.v.clone()) for c in (compute_chunk_kv(m, c) for c in chunks)]
    with pytest.raises(ValueError, match="qpass"):
        student_logp(m, None, ex, head, pairs, BlendSchedule.single(0.3, selector="kdev"))
