"""Issue 52 on the real default model: every reuse of the exact KV tree gives full prefill's logits bit
for bit (library, RAG, chat turns), survives a restart through the store, and the default setting runs it."""

from __future__ import annotations

import pytest
import torch

import ragkv
from ragkv.model import DEFAULT_MODEL
from ragkv.model.registry import ModelFetchError, pull
from tests.helpers import musique_samples

pytestmark = pytest.mark.slow  # the real model, prompts of hundreds of tokens


@pytest.fixture(scope="module")
def llm():
    try:
        pull(DEFAULT_MODEL, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    return ragkv.LLM(DEFAULT_MODEL)


def _passages(n_samples=2, per=3, chars=500):
    return [c["text"][:chars] for s in musique_samples(n_samples) for c in s["ctxs"][:per]]


def test_default_runs_the_exact_tree_and_equals_full_bit_for_bit(llm):
    chunks = _passages()
    q1, q2 = (s["question"] for s in musique_samples(2))
    llm.kv_tree.clear()
    for q in (q1, q2, q1):  # cold, then the passages cached under another question, then all cached
        full = llm.prefill("Answer using the passages.", chunks, q, mode="full")
        got = llm.prefill("Answer using the passages.", chunks, q)  # the default setting
        assert got.stats["mode"] == "prefix" and got.stats["fidelity"]["point"] == "exact"
        assert torch.equal(got.logits, full.logits), q
        assert torch.equal(got.kv.k, full.kv.k) and torch.equal(got.kv.v, full.kv.v)
    n = full.stats["num_tokens"]
    assert got.stats["cached_tokens"] == n - 1  # a repeated request: all but the last row
    a = llm.generate("Answer using the passages.", chunks, q2, max_new_tokens=12)
    b = llm.generate("Answer using the passages.", chunks, q2, mode="full", max_new_tokens=12)
    assert a.token_ids == b.token_ids and a.stats["cached_tokens"] > 0.8 * a.stats["num_tokens"]


def test_chat_turns_reuse_the_previous_prompt_and_answer_as_full(llm):
    tok = llm.model.tokenizer
    ctx = "\n\n".join(_passages(1))
    msgs = [
        {"role": "system", "content": "Answer from the passages."},
        {"role": "user", "content": f"{ctx}\n\nQuestion: {musique_samples(1)[0]['question']}"},
    ]
    prev = None
    for follow in ("Why?", "Say it in one sentence.", None):
        ids = list(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        got = llm.generate(ids, [], [], max_new_tokens=16)
        full = llm.generate(ids, [], [], mode="full", max_new_tokens=16)
        assert got.token_ids == full.token_ids
        if prev is not None:
            assert got.stats["cached_tokens"] >= 0.9 * prev
        prev = len(ids)
        if follow is None:
            break
        msgs += [{"role": "assistant", "content": got.text}, {"role": "user", "content": follow}]


def test_a_restart_finds_the_prompt_in_the_store(tmp_path, embedder):
    """A RAG on a data folder, closed and opened again (a restart): the repeated request's prompt is
    >= 0.9 cached from the tree's pages in the store, and the answer is full prefill's."""
    from ragkv.rag import RAG

    docs = [{"id": f"d{i}", "text": t} for i, t in enumerate(_passages(2, 3, 800))]
    q = musique_samples(1)[0]["question"]
    rag = RAG(ragkv.LLM(DEFAULT_MODEL), tmp_path / "data", embedder=embedder, top_k=3)
    rag.ingest(docs, show_progress=False)
    first = rag.answer(q, max_new_tokens=8)
    rag.close()
    rag = RAG(ragkv.LLM(DEFAULT_MODEL), tmp_path / "data", embedder=embedder, top_k=3)
    again = rag.answer(q, max_new_tokens=8)
    full = rag.answer(q, mode="full", max_new_tokens=8)
    n = again.stats["num_tokens"]
    assert again.stats["cached_tokens"] >= 0.9 * n and again.stats["store_tokens"] > 0
    assert again.text == first.text == full.text
    rag.close()
