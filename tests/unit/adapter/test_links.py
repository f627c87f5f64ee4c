"""Learned link rows (issue 38's candidate L): the student is the served prefill, the file's trust
checks, and training lowers the KL to full prefill."""

import pytest
import torch

from ragkv.adapter.kv_adapter import AdapterError
from ragkv.adapter.links import LinkedModel, LinkRows
from ragkv.adapter.train import Example, TrainConfig, kl_loss, student_logp, teacher_example, train
from ragkv.blend import prefill
from ragkv.blend.core import BlendSchedule
from ragkv.generate import SamplingParams, generate
from ragkv.model import random_model
from ragkv.model.forward import compute_chunk_kv
from tests.helpers import stories_model
from tests.unit.adapter.test_adapter import _items, _prompt


def _links(model, n=3, seed=1) -> LinkRows:
    links = LinkRows.for_model(model, n, seed)
    with torch.no_grad():
        links.emb.add_(0.5 * torch.randn(links.emb.shape, generator=torch.Generator().manual_seed(seed)))
    return links


def test_link_ids_embed_as_learned_rows_and_token_ids_as_the_model_does():
    m = random_model("llama", seed=7, init_std=0.1)
    links = _links(m)
    lm = LinkedModel(m, links)
    ids = torch.tensor([5, 9, *links.ids, 11])
    h = lm.embed(ids)
    assert torch.equal(h[[0, 1, 5]], m.embed(torch.tensor([5, 9, 11])))
    assert torch.equal(h[2:5], links.emb.detach())
    assert lm.fingerprint == m.fingerprint and lm.config is m.config
    assert links.interleave(["a", "b"]) == ["a", links.ids, "b", links.ids]


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_the_students_link_rows_are_the_served_prompts(ratio):
    """``student_logp(links=...)`` gives the first-token log-probs of serving's prefill of the prompt
    with the link rows after each chunk (reuse, and the blend in the loop); the gradient reaches the
    link embeddings and nothing else changes the model."""
    m = random_model("llama", seed=7, init_std=0.1)
    pre, chunks, suf = _prompt(m)
    kvs = [compute_chunk_kv(m, c) for c in chunks]
    links = _links(m)
    lm = LinkedModel(m, links)
    mode, kw = ("reuse", {}) if ratio == 0 else ("blend", {"schedule": BlendSchedule(ratios=(ratio,))})
    assert m.blend_ok is None
    served = prefill(lm, pre, links.interleave(kvs), suf, mode, **kw)
    assert m.blend_ok and LinkedModel(m, links).blend_ok  # the gate ran once, for the model itself
    assert served.stats["num_reused_rows"] == sum(map(len, chunks))
    answer = [int(served.logits.argmax()), 5, 9]
    ex = Example(pre, chunks, suf, answer, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))
    head = tuple(t.clone() for t in m.forward(torch.tensor(pre), capture_kv=True)[1:])
    pairs = [(c.k.clone(), c.v.clone()) for c in kvs]
    sched = BlendSchedule(ratios=(ratio,)) if ratio else None
    lp = student_logp(m, None, ex, head, pairs, sched, links)
    torch.testing.assert_close(lp[0], torch.log_softmax(served.logits.float(), -1), rtol=1e-4, atol=1e-4)
    plain = student_logp(m, None, ex, head, pairs, sched)
    assert float((plain[0] - lp[0]).detach().abs().max()) > 1e-3  # the link rows are read
    lp[1:].sum().backward()
    assert links.emb.grad is not None and float(links.emb.grad.abs().sum()) > 0
    # decoding after the prompt needs nothing new: the link rows are ordinary cache rows
    out = generate(lm, served, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3


def test_link_file_round_trip_and_trust_checks(tmp_path):
    m = random_model("llama", seed=7, init_std=0.1)
    links = _links(m)
    digest = links.save(tmp_path / "l.safetensors", meta={"note": "x"})
    back = LinkRows.load(tmp_path / "l.safetensors", m, digest=digest)
    assert torch.equal(back.emb, links.emb.detach()) and back.ids == links.ids
    assert back.identity == digest[:16] and not back.emb.requires_grad
    with pytest.raises(AdapterError, match="digest mismatch"):
        LinkRows.load(tmp_path / "l.safetensors", m, digest="0" * 64)
    with pytest.raises(AdapterError, match="trained for model"):
        LinkRows.load(tmp_path / "l.safetensors", random_model("llama", seed=8, init_std=0.1))
    from ragkv.adapter.shipped import resolve_adapter

    with pytest.raises(AdapterError, match="holds link rows: a candidate measured"):
        resolve_adapter(m, str(tmp_path / "l.safetensors"))  # not served by LLM / RAG / the service
    with pytest.raises(AdapterError, match="not a ragkv-link-rows"):
        from ragkv.adapter.kv_adapter import KVAdapter

        KVAdapter.for_model(m, 2).save(tmp_path / "kv.safetensors")
        LinkRows.load(tmp_path / "kv.safetensors", m)


@pytest.mark.slow
def test_training_link_rows_lowers_the_kl_to_full_prefill(tmp_path):
    m = stories_model()
    items = _items()
    exs = [teacher_example(m, it, max_new=6) for it in items]
    head = tuple(t.clone() for t in m.forward(torch.tensor(exs[0].prefix), capture_kv=True)[1:])
    kvs = [compute_chunk_kv(m, c) for c in exs[0].chunks]
    kvs = [(c.k.clone(), c.v.clone()) for c in kvs]

    def kl_of(links):
        with torch.no_grad():
            return float(kl_loss(student_logp(m, None, exs[0], head, kvs, None, links), exs[0]))

    cfg = TrainConfig(kind="link", num_links=2, epochs=6, batch=2, lr=5e-2, save_every=3)
    s = train(m, tmp_path / "l.safetensors", cfg, items=items, progress=False)
    trained = LinkRows.load(tmp_path / "l.safetensors", m, digest=s["sha256"])
    assert s["kind"] == "link" and s["links"] == 2 and s["rank"] is None and trained.spec.num_links == 2
    assert kl_of(trained) < kl_of(LinkRows.for_model(m, 2))


def test_the_train_command_writes_link_rows(tmp_path, capsys):
    """``ragkv adapter train --kind link --links N``: a link-rows file of N rows, one JSON line."""
    import json
    import shutil

    from ragkv.cli import main
    from tests.helpers import stories_path

    model_dir = tmp_path / "long"  # the tiny model with a context that holds the training prompts
    shutil.copytree(stories_path(), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (model_dir / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "links.safetensors"
    args = ["adapter", "train", "--model", str(model_dir), "--kind", "link", "--links", "2", "--epochs", "1"]
    args += ["--batch", "2", "--facts", "4", "--real", "0", "--continuations", "0", "--threads", "1", "-q"]
    assert main([*args, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "set of 2 link rows" in lines[0]
    summary = json.loads(lines[-1])
    assert summary["kind"] == "link"
    from ragkv.model import load_model

    rows = LinkRows.load(out, load_model(str(model_dir)), digest=summary["sha256"])
    assert rows.spec.num_links == 2
