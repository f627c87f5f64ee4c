"""Issue 39: ``/v1/chat/completions`` with OpenAI semantics, against a live ``python -m ragkv_server.server``
(uvicorn) on test checkpoints with chat templates (the tiny model with a ChatML or an ``[INST]``
template), driven by the official ``openai`` client and httpx.

* The model sees the messages as sent: the prompt token ids are transformers'
  ``apply_chat_template(..., tokenize=True)`` ids (what vLLM prefills); greedy ``full`` equals
  ``ragkv.LLM``'s full prefill of those ids and transformers' ``generate`` on them.
* Stored chunks inside the messages are reused without changing the prompt, and the answer is the
  Python API's in the RAG's default mode (``RAG.job``'s operating point) on the same ids.
* Retrieval only on request (``ragkv.retrieve``, ``<model>+rag``), the passages where ``/v1/query``
  puts them; limits in tokens (context_length_exceeded), not characters; errors in OpenAI's shape.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from helpers_service import LIMITS
from helpers_service import service_docs as _docs

from ragkv.generate import SamplingParams
from ragkv.testing import CHATML_TEMPLATE, INST_TEMPLATE, musique_samples, template_ids, templated_checkpoint
from ragkv_server.testing import launch_server, stop_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # live server processes

NEW = 12
TEMPLATES = {"chatml": CHATML_TEMPLATE, "inst": INST_TEMPLATE}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, tmp_path_factory):
    """``(base URL, checkpoint, model id, ingested documents)`` of a server on a templated checkpoint."""
    d = tmp_path_factory.mktemp(f"chat-{request.param}")
    ckpt = templated_checkpoint(d / "model", TEMPLATES[request.param])
    env = {**LIMITS, "RAGKV_MODEL": str(ckpt), "RAGKV_DATA_DIR": str(d / "data")}
    try:
        proc, base = launch_server(env, d / "server.log", 180, fork=True)
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        docs = _docs(musique_samples(2))
        for part in (docs[:4], docs[4:]):
            r = httpx.post(base + "/v1/documents", json={"documents": part}, timeout=120)
            assert r.status_code == 200, r.text
        yield base, ckpt, "model", docs
    finally:
        stop_server(proc, 30)
    assert "Traceback" not in (d / "server.log").read_text()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def _context_messages(docs, question: str) -> list[dict]:
    """A client's own RAG prompt: a system turn, two documents in the user turn (LangChain's stuff chain)."""
    ctx = "\n\n".join(d["text"] for d in docs[:2])
    return [
        {"role": "system", "content": "Answer from the context."},
        {"role": "user", "content": f"Context:\n{ctx}\n\nQuestion: {question}"},
    ]


def _chat(client, model, messages, **kw):
    kw.setdefault("max_tokens", NEW)
    kw.setdefault("temperature", 0)
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(
        model=model, messages=messages, extra_body={"return_token_ids": True, **extra}, **kw
    )


def test_prompt_ids_are_transformers_apply_chat_template_ids(served, client):
    _, ckpt, model, docs = served
    q = musique_samples(1)[0]["question"]
    for messages in (
        [{"role": "user", "content": "Once upon a time"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who had a ball?"},
            {"role": "assistant", "content": "Lily."},
            {"role": "user", "content": "And who ran? </s> <s>"},
        ],
        _context_messages(docs, q),
    ):
        out = _chat(client, model, messages)
        want = template_ids(ckpt, messages)
        assert out.model_extra["prompt_token_ids"] == want
        assert out.usage.prompt_tokens == len(want) and out.model_extra["ragkv"]["sources"] == []
    stream = list(_chat(client, model, messages, stream=True))
    final = next(c for c in stream if c.choices and c.choices[0].finish_reason)
    assert final.model_extra["prompt_token_ids"] == want


def test_full_mode_equals_llm_full_prefill_and_transformers_generate(served, client):
    from transformers import AutoModelForCausalLM

    from ragkv import LLM

    _, ckpt, model, docs = served
    messages = _context_messages(docs, musique_samples(1)[0]["question"])
    out = _chat(client, model, messages, extra_body={"ragkv": {"mode": "full"}})
    ids, got = out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"]
    assert out.model_extra["ragkv"]["stats"]["num_reused_rows"] == 0 and len(got) == NEW
    llm = LLM(str(ckpt))
    assert llm.generate(ids, [], [], mode="full", max_new_tokens=NEW, temperature=0).token_ids == got
    hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids) :]
    assert ref.tolist() == got
    assert out.choices[0].message.content == llm.model.tokenizer.decode(got, skip_special_tokens=True)


def test_stored_chunks_are_reused_without_changing_the_prompt(served, client, tmp_path, one_thread, embedder):
    """The client's own context reuses the stored chunks (``cached_tokens``), the prompt ids stay those
    of the full prefill, and the answer is what the Python API gives on those ids in the RAG's
    default mode (the operating point ``RAG.job`` chooses: ``RAG.mode`` / ``RAG.ratio``)."""
    from ragkv_server.config import load_settings
    from ragkv_server.service import build_rag

    _, ckpt, model, docs = served
    messages = _context_messages(docs, musique_samples(1)[0]["question"])
    out = _chat(client, model, messages)
    full = _chat(client, model, messages, extra_body={"ragkv": {"mode": "full"}})
    ids = out.model_extra["prompt_token_ids"]
    assert ids == full.model_extra["prompt_token_ids"]  # reuse never changes the prompt
    stats = out.model_extra["ragkv"]["stats"]
    assert stats["kv_hits"] >= 2 and stats["num_reused_rows"] > 0
    assert out.usage.prompt_tokens_details.cached_tokens == stats["num_reused_rows"] + stats["num_exact_rows"]
    settings = load_settings(
        None,
        model=str(ckpt),
        data_dir=str(tmp_path / "data"),
        chunk_tokens=64,
        top_k=3,
        ratio=float(LIMITS["RAGKV_RATIO"]),
    )
    rag = build_rag(settings)
    try:
        rag.ingest(
            [{"id": d["id"], "text": d["text"], "metadata": d["metadata"]} for d in docs], show_progress=False
        )
        *_, ans = rag.stream_ids(ids, params=SamplingParams(max_new_tokens=NEW), collection="default")
        assert (stats["mode"], stats["ratio"]) == (rag.mode, rag.ratio)
        assert ans.stats["num_reused_rows"] == stats["num_reused_rows"]
        assert ans.token_ids == out.choices[0].model_extra["token_ids"]
        assert ans.text == out.choices[0].message.content
    finally:
        rag.close()


def test_retrieval_only_on_request(served, client):
    base, _, model, _ = served
    q = musique_samples(1)[0]["question"]
    user = [{"role": "user", "content": q}]
    plain = _chat(client, model, user).model_extra["ragkv"]
    assert plain["sources"] == [] and plain["stats"]["kv_hits"] == 0
    two = _chat(client, model, user, extra_body={"ragkv": {"retrieve": True, "top_k": 2}})
    assert len(two.model_extra["ragkv"]["sources"]) == 2
    rag = _chat(client, model + "+rag", user)  # a RAG model id: no extra_body needed
    assert rag.model == model + "+rag"
    sources = rag.model_extra["ragkv"]["sources"]
    assert len(sources) == 3 and rag.model_extra["ragkv"]["stats"]["kv_hits"] == 3
    off = _chat(client, model + "+rag", user, extra_body={"ragkv": {"retrieve": False}})
    assert off.model_extra["ragkv"]["sources"] == []
    # where the passages go is /v1/query's user turn: one user message gives /v1/query's prompt
    query = httpx.post(base + "/v1/query", json={"question": q, "max_tokens": NEW}, timeout=120).json()
    assert rag.usage.prompt_tokens == query["usage"]["prompt_tokens"]
    assert rag.choices[0].message.content == query["answer"]
    ids = [s["chunk_id"] for s in sources]
    given = _chat(client, model, user, extra_body={"ragkv": {"chunk_ids": ids}})
    assert given.model_extra["prompt_token_ids"] == rag.model_extra["prompt_token_ids"]
    # a conversation keeps its turns; the question's turn is the last user message
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        *user,
    ]
    out = _chat(client, model + "+rag", convo)
    kept = [s["chunk_id"] for s in out.model_extra["ragkv"]["sources"]]  # the lowest dropped to fit 512
    assert kept and set(kept) <= set(ids) and out.usage.prompt_tokens + NEW <= 512
    assert "Hello" in decoded(out.model_extra["prompt_token_ids"], served[1])
    for extra, says in (
        ({"top_k": 2}, "retrieve"),
        ({"retrieve": True, "chunk_ids": ids}, "not both"),
    ):
        with pytest.raises(openai.BadRequestError, match=says) as e:
            _chat(client, model, user, extra_body={"ragkv": extra})
        assert e.value.param == "ragkv" and e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError, match="last message must be a user message") as e:
        _chat(client, model + "+rag", [*user, {"role": "assistant", "content": "It"}])


def decoded(ids: list[int], ckpt) -> str:
    """The text of token ids under the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt).decode(ids)


def test_limits_are_in_tokens_and_bytes_not_characters(served, client):
    base, _, model, docs = served
    assert int(LIMITS["RAGKV_MAX_QUESTION_CHARS"]) < 700
    long_msg = "\n\n".join(d["text"] for d in docs[:2]) + "\n\nWho?"  # ~600 characters: over the question cap
    assert len(long_msg) > int(LIMITS["RAGKV_MAX_QUESTION_CHARS"])
    assert _chat(client, model, [{"role": "user", "content": long_msg}]).choices[0].message.content
    r = httpx.post(
        base + "/v1/query", json={"question": long_msg}, timeout=60
    )  # the cap is /v1/query's alone
    assert r.status_code == 422 and "question" in r.json()["error"]["message"]
    too_long = " ".join(d["text"] for d in docs) * 3  # ~1,800 tokens: past the 512-position context
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, model, [{"role": "user", "content": too_long}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert "512" in e.value.message and "tokens" in e.value.message
    huge = "x " * (40 << 10)  # 80 KiB: past the 64 KiB body cap
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 413
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_models_list_the_rag_variant_and_other_ids_are_refused(served, client):
    base, _, model, _ = served
    assert [m.id for m in client.models.list().data] == [model, model + "+rag"]
    assert client.models.retrieve(model + "+rag").id == model + "+rag"
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, "gpt-nope", [{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="chat/completions") as e:
        client.completions.create(model=model + "+rag", prompt="Once", max_tokens=2)
    assert e.value.param == "model"


def test_a_templates_refusal_is_a_400(served, client):
    _, ckpt, model, _ = served
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    if "[INST]" not in ckpt.joinpath("tokenizer_config.json").read_text():
        assert _chat(client, model, two_users).choices[0].finish_reason  # ChatML takes any order
        return
    with pytest.raises(openai.BadRequestError, match="alternate") as e:
        _chat(client, model, two_users)
    assert e.value.param == "messages" and e.value.code == "invalid_value"


def test_multi_turn_chat_reuses_the_whole_previous_prompt_exactly(served, client):
    """Issue 52: in the exact mode each turn reuses the previous turn's whole prompt from the KV tree
    (``cached_tokens`` >= 0.9 of it) and answers exactly as full prefill of the same ids does."""
    _, _, model, docs = served
    ctx = docs[0]["text"][:200]  # the tiny model has 512 positions: four turns must fit
    question = musique_samples(1)[0]["question"]
    messages = [
        {"role": "system", "content": "Answer from the context."},
        {"role": "user", "content": f"Context:\n{ctx}\n\nQuestion: {question}"},
    ]
    follow = ["Why?", "Say it in one sentence."]  # the test limits allow 6 messages
    prev = None
    for turn, ask in enumerate([None, *follow]):
        if ask is not None:
            messages = [*messages, {"role": "user", "content": ask}]
        out = _chat(client, model, messages, extra_body={"ragkv": {"mode": "prefix"}})
        full = _chat(client, model, messages, extra_body={"ragkv": {"mode": "full"}})
        assert out.model_extra["prompt_token_ids"] == full.model_extra["prompt_token_ids"]
        assert out.choices[0].model_extra["token_ids"] == full.choices[0].model_extra["token_ids"], turn
        cached = out.usage.prompt_tokens_details.cached_tokens
        assert cached == out.model_extra["ragkv"]["stats"]["cached_tokens"]
        if prev is not None:
            assert cached >= 0.9 * prev, (turn, cached, prev)
        prev = out.usage.prompt_tokens
        messages = [*messages, {"role": "assistant", "content": out.choices[0].message.content}]
