"""LangChain and LlamaIndex wrappers with the real libraries: retrieved documents reach the model as
chunks whose stored KV is reused; foreign documents are ingested on first use; streaming and async."""

import asyncio
import functools
import operator

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402

from integrations.common import CHUNK_SEPARATOR, format_docs, split_prompt  # noqa: E402
from integrations.langchain import ChatRagkv, RagkvEmbeddings, RagkvLLM, RagkvRetriever, rag_chain  # noqa: E402
from integrations.llama_index import RagkvLlamaLLM, RagkvLlamaRetriever, RagkvQueryEngine  # noqa: E402
from ragkv import LLM  # noqa: E402
from ragkv.rag import RAG  # noqa: E402
from tests.helpers import check_stop_strings, musique_samples, stories_model  # noqa: E402

NEW = 8  # tokens per answer: enough to see streaming, cheap on 2 cores


@pytest.fixture(scope="module")
def samples():
    return musique_samples(2)


@pytest.fixture(scope="module")
def rag(tmp_path_factory, one_thread, embedder, samples):
    r = RAG(
        LLM(stories_model()),
        tmp_path_factory.mktemp("lc") / "data",
        embedder=embedder,
        chunk_tokens=64,
        top_k=3,
    )
    docs = [
        {"id": f"s{i}-p{j}", "text": c["text"][:300]}
        for i, s in enumerate(samples)
        for j, c in enumerate(s["ctxs"][:3])
    ]
    rep = r.ingest(docs, show_progress=False)
    assert rep.kv_computed > 0
    yield r
    r.close()


def _reused(info: dict, n_chunks: int) -> None:
    """The answer's prefill reused every chunk's stored KV (blend)."""
    assert info["mode"] == "blend"
    assert info["kv_hits"] == n_chunks == info["num_chunks"]
    assert info["num_reused_rows"] > 0
    assert info["recomputed_per_layer"][-1] < info["num_tokens"]


# ---- shared pieces -------------------------------------------------------------------------------------
def test_split_prompt_and_format_docs():
    assert split_prompt("plain prompt") == ("", [], "plain prompt")
    text = "Read:" + format_docs(["A a.", "B b."]) + "Q?"
    assert split_prompt(text) == ("Read:", ["A a.", "B b."], "Q?")
    assert format_docs([]) == ""
    assert CHUNK_SEPARATOR in format_docs(["x"])


# ---- LangChain ----------------------------------------------------------------------------------------
def test_langchain_retriever_documents_carry_chunk_keys(rag, samples):
    docs = RagkvRetriever(rag=rag, k=3).invoke(samples[0]["question"])
    assert len(docs) == 3
    for d in docs:
        cid = d.metadata["ragkv_chunk_id"]
        assert d.id == f"ragkv:{cid}"
        rec = rag.index.chunk(cid)
        assert d.page_content == rec.text and d.metadata["ragkv_kv_key"] == rec.kv_key
        assert rag.store.contains(rec.kv_key)


def test_langchain_retrieval_chain_reuses_chunk_kv(rag, samples):
    q = samples[0]["question"]
    llm = RagkvLLM(rag=rag, max_new_tokens=NEW)
    out = rag_chain(RagkvRetriever(rag=rag, k=3), llm).invoke(q)
    assert set(out) == {"question", "docs", "answer"} and isinstance(out["answer"], str) and out["answer"]
    gen = llm.generate([q], chunks=out["docs"]).generations[0][0]
    assert gen.text == out["answer"]
    _reused(gen.generation_info["ragkv"], 3)
    assert gen.generation_info["ragkv"]["chunk_ids"] == [d.metadata["ragkv_chunk_id"] for d in out["docs"]]
    # chunk ids work as well as documents; blend at ratio 1 is exactly full prefill through the wrapper
    ids = [d.id for d in out["docs"]]
    assert llm.invoke(q, chunk_ids=ids) == out["answer"]
    full = llm.generate([q], chunk_ids=ids, mode="full").generations[0][0]
    assert (
        full.generation_info["ragkv"]["kv_hits"] == 0
        and full.generation_info["ragkv"]["num_reused_rows"] == 0
    )
    assert llm.invoke(q, chunk_ids=ids, ratio=1.0) == full.text


def test_langchain_chat_model_stream_and_async(rag, samples):
    q = samples[1]["question"]
    docs = RagkvRetriever(rag=rag).invoke(q)
    chat = ChatRagkv(rag=rag, max_new_tokens=NEW)
    msg = chat.invoke(q, chunks=docs)
    _reused(msg.response_metadata["ragkv"], len(docs))
    assert msg.usage_metadata["output_tokens"] == msg.response_metadata["ragkv"]["completion_tokens"]
    parts = list(chat.stream(q, chunks=docs))
    texts = [p.content for p in parts if p.content]
    assert len(texts) > 1 and "".join(texts) == msg.content  # token by token, same greedy answer

    async def run():
        aparts = [p.content async for p in chat.astream(q, chunks=docs)]
        amsg = await chat.ainvoke(q, chunks=docs)
        return aparts, amsg

    aparts, amsg = asyncio.run(run())
    assert "".join(aparts) == msg.content and amsg.content == msg.content
    _reused(amsg.response_metadata["ragkv"], len(docs))
    # no chunks: the conversation is completed as a plain prompt (full prefill)
    plain = chat.invoke("Once upon a time")
    assert plain.response_metadata["ragkv"]["num_chunks"] == 0 and plain.content


def test_langchain_llm_async_matches_sync(rag, samples):
    q = samples[0]["question"]
    llm = RagkvLLM(rag=rag, max_new_tokens=NEW, retrieve=True)
    sync = llm.invoke(q)
    assert asyncio.run(llm.ainvoke(q)) == sync

    async def chunks():
        return [c async for c in llm.astream(q)]

    assert "".join(asyncio.run(chunks())) == sync


def test_langchain_flattened_prompt_splits_on_separator(rag, samples):
    q = samples[0]["question"]
    llm = RagkvLLM(rag=rag, max_new_tokens=NEW)
    retriever = RagkvRetriever(rag=rag, k=2)
    template = PromptTemplate.from_template("Passages:{context}Question: {question}\nAnswer:")
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | template | llm
    answer = chain.invoke(q)
    prompt = template.format(context=format_docs(retriever.invoke(q)), question=q)
    info = llm.generate([prompt]).generations[0][0].generation_info["ragkv"]
    assert llm.invoke(prompt) == answer
    assert info["num_chunks"] == 2 and info["kv_hits"] == 2  # pieces' KV was stored by the first use
    assert info["num_reused_rows"] > 0
    flat = llm.generate([prompt.replace(CHUNK_SEPARATOR, "\n")]).generations[0][0].generation_info["ragkv"]
    # no separator: the stored chunks are still found inside the flat prompt and reused (issue 26)
    assert flat["mode"] == "blend" and flat["num_reused_rows"] > 0


def test_langchain_foreign_vector_store_documents_ingested_on_first_use(rag, embedder):
    store = InMemoryVectorStore(RagkvEmbeddings(embedder))
    store.add_texts(
        [
            "Lily had a red ball. She played with it in the park every day.",
            "Tom was a big brown dog. He liked to run after the ball.",
        ]
    )
    docs = store.as_retriever(search_kwargs={"k": 2}).invoke("What did the dog like?")
    assert all("ragkv_chunk_id" not in d.metadata for d in docs)
    n_docs = len(rag.index.document_ids())
    chat = ChatRagkv(rag=rag, max_new_tokens=NEW)
    first = chat.invoke("What did the dog like?", chunks=docs).response_metadata["ragkv"]
    assert len(first["ingested_documents"]) == 2 and len(rag.index.document_ids()) == n_docs + 2
    again = chat.invoke("What did the dog like?", chunks=docs).response_metadata["ragkv"]
    assert again["ingested_documents"] == [] and len(rag.index.document_ids()) == n_docs + 2
    _reused(again, len(again["chunk_ids"]))
    assert again["chunk_ids"] == first["chunk_ids"]
    out = rag_chain(store.as_retriever(search_kwargs={"k": 2}), chat).invoke("Who had a red ball?")
    _reused(out["answer"].response_metadata["ragkv"], 2)


def test_langchain_bad_input_is_a_typed_error(rag):
    llm = RagkvLLM(rag=rag, max_new_tokens=NEW)
    with pytest.raises(KeyError):
        llm.invoke("q", chunk_ids=["ragkv:987654"])
    with pytest.raises(TypeError):
        llm.invoke("q", chunkz=[])
    with pytest.raises(ValueError):
        llm.invoke("q", chunk_ids=[1], mode="nope")


# ---- LlamaIndex -----------------------------------------------------------------------------------------
def test_llama_index_llm_retriever_and_chat(rag, samples):
    q = samples[0]["question"]
    nodes = RagkvLlamaRetriever(rag, k=3).retrieve(q)
    assert len(nodes) == 3
    for n in nodes:
        rec = rag.index.chunk(n.node.metadata["ragkv_chunk_id"])
        assert n.node.node_id == f"ragkv:{rec.chunk_id}" and n.node.metadata["ragkv_kv_key"] == rec.kv_key
        assert isinstance(n.score, float)
    assert [n.score for n in nodes] == sorted((n.score for n in nodes), reverse=True)
    llm = RagkvLlamaLLM(rag=rag, max_new_tokens=NEW)
    done = llm.complete(q, chunks=nodes)
    _reused(done.raw["ragkv"], 3)
    deltas = [r.delta for r in llm.stream_complete(q, chunk_ids=[n.node.node_id for n in nodes])]
    assert len([d for d in deltas if d]) > 1 and "".join(deltas) == done.text
    # chat() keeps the chunk options (CustomLLM's derived chat would render them away)
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=q)]
    chat = llm.chat(msgs, chunk_ids=[n.node.node_id for n in nodes])
    _reused(chat.raw["ragkv"], 3)
    streamed = list(llm.stream_chat(msgs, chunks=nodes))
    assert streamed[-1].message.content == chat.message.content
    _reused(streamed[-1].raw["ragkv"], 3)
    assert llm.complete("Once upon a time").raw["ragkv"]["num_chunks"] == 0


def test_llama_index_query_engine_answers_with_reused_kv(rag, samples):
    q = samples[1]["question"]
    engine = RagkvQueryEngine(
        retriever=RagkvLlamaRetriever(rag, k=3), llm=RagkvLlamaLLM(rag=rag, max_new_tokens=NEW)
    )
    resp = engine.query(q)
    assert resp.response and len(resp.source_nodes) == 3
    _reused(resp.metadata["ragkv"], 3)
    assert resp.metadata["ragkv"]["chunk_ids"] == [
        n.node.metadata["ragkv_chunk_id"] for n in resp.source_nodes
    ]
    aresp = asyncio.run(engine.aquery(q))
    assert aresp.response == resp.response
    _reused(aresp.metadata["ragkv"], 3)


# ---- LangChain conventions: constructor parameters, tracing parameters, per-call k ---------------------
def test_langchain_max_tokens_and_stop_from_the_constructor_are_honoured(rag, samples):
    q = samples[0]["question"]
    free = ChatRagkv(rag=rag, max_tokens=24).invoke(q, retrieve=True)
    assert free.usage_metadata["output_tokens"] == 24  # the tiny model never stops by itself this early
    short = ChatRagkv(rag=rag, max_tokens=8).invoke(q, retrieve=True)  # was ignored: 64 tokens came back
    assert short.usage_metadata["output_tokens"] == 8 and free.content.startswith(short.content)
    assert short.response_metadata["finish_reason"] == "length"
    # a stop string that is one whole streamed token (a stop string spanning tokens can leave the
    # text streamed before it was complete: the generator does not hold text back)
    deltas = [c.content for c in ChatRagkv(rag=rag, max_tokens=24).stream(q, retrieve=True) if c.content]
    i = next(i for i in range(4, len(deltas)) if deltas[i].strip() and deltas[i] not in "".join(deltas[:i]))
    stopped = ChatRagkv(rag=rag, max_tokens=24, stop=[deltas[i]]).invoke(q, retrieve=True)
    assert stopped.content == "".join(deltas[:i]) and stopped.response_metadata["finish_reason"] == "stop"
    llm = RagkvLLM(rag=rag, max_tokens=8, stop=[deltas[i]])
    assert llm.max_tokens == llm.max_new_tokens == 8
    assert llm.invoke(q, retrieve=True) == short.content[: len("".join(deltas[:i]))]
    assert llm.invoke(q, retrieve=True, stop=["zzz"]) == short.content  # a call's stop replaces the model's


def test_langchain_unknown_or_conflicting_constructor_parameters_are_refused(rag):
    from pydantic import ValidationError

    for bad in ({"max_token": 8}, {"api_key": "sk-x"}, {"max_tokens": 8, "max_new_tokens": 9}, {"top_p": 0}):
        with pytest.raises(ValidationError):
            ChatRagkv(rag=rag, **bad)
        with pytest.raises(ValidationError):
            RagkvLLM(rag=rag, **bad)
    with pytest.raises(ValidationError):
        RagkvRetriever(rag=rag, kk=1)


def test_langchain_tracing_parameters(rag):
    from langchain_core.callbacks import BaseCallbackHandler

    seen: list[dict] = []

    class Metadata(BaseCallbackHandler):
        def on_chat_model_start(self, serialized, messages, *, metadata=None, **kwargs):
            seen.append(dict(metadata or {}))

        def on_llm_start(self, serialized, prompts, *, metadata=None, **kwargs):
            seen.append(dict(metadata or {}))

    name = rag.model.name
    ChatRagkv(rag=rag, max_tokens=4, stop=["\n\n"], temperature=0.5, seed=1).invoke(
        "Once", config={"callbacks": [Metadata()]}
    )
    RagkvLLM(rag=rag, max_tokens=3).invoke("Once", config={"callbacks": [Metadata()]})
    chat, llm = seen
    assert (
        chat["ls_provider"] == "ragkv" and chat["ls_model_name"] == name and chat["ls_model_type"] == "chat"
    )
    assert chat["ls_max_tokens"] == 4 and chat["ls_stop"] == ["\n\n"] and chat["ls_temperature"] == 0.5
    assert llm["ls_model_type"] == "llm" and llm["ls_max_tokens"] == 3 and llm["ls_model_name"] == name


def test_langchain_retriever_k_per_call(rag, samples):
    q = samples[0]["question"]
    retriever = RagkvRetriever(rag=rag, k=3)
    assert len(retriever.invoke(q)) == 3
    assert len(retriever.invoke(q, k=1)) == 1  # was 3 (k was dropped)
    assert len(asyncio.run(retriever.ainvoke(q, k=2))) == 2
    with pytest.raises(TypeError, match="kk"):
        retriever.invoke(q, kk=1)


def test_langchain_timeout_and_max_retries(rag):
    import socket
    import threading
    import time

    from integrations.vllm.client import VllmClient, VllmGenerator, VllmUnavailableError

    with pytest.raises(TimeoutError):
        ChatRagkv(rag=rag, max_tokens=32, timeout=1e-6).invoke("Once upon a time")
    # a "server" that accepts and hangs up at once: every attempt is one connection
    srv = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(time.monotonic())
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    remote = rag.using(VllmGenerator(VllmClient(url, model="m", timeout=5, connect_timeout=5)))
    try:
        with pytest.raises(VllmUnavailableError):
            ChatRagkv(rag=remote, max_tokens=4, max_retries=2).invoke("Once upon a time")
        assert len(accepted) == 3
        with pytest.raises(VllmUnavailableError):
            ChatRagkv(rag=remote, max_tokens=4).invoke("Once upon a time")
        assert len(accepted) == 4
    finally:
        srv.close()


# ---- stop strings: never emitted, finish_reason from the generation ----------------------------------
STOP_MAX = 24


def test_python_api_rag_answer_stop_strings(rag, samples):
    q = samples[0]["question"]
    chunks = rag.retrieve(q)

    def complete(stop, n, streamed):
        items = list(rag.answer_stream(q, chunks=chunks, max_new_tokens=n, stop=(stop,)))
        events, ans = items[:-1], items[-1]
        text = (
            "".join(e.text for e in events)
            if streamed
            else rag.answer(q, chunks=chunks, max_new_tokens=n, stop=(stop,)).text
        )
        assert ans.text == "".join(e.text for e in events)
        return text, events[-1].finish_reason

    pieces = [e.text for e in list(rag.answer_stream(q, chunks=chunks, max_new_tokens=STOP_MAX))[:-1]]
    check_stop_strings(pieces, STOP_MAX, complete)


def test_langchain_stop_strings_never_leak(rag, samples):
    q = samples[0]["question"]

    def chat(stop, n, streamed):
        model = ChatRagkv(rag=rag, max_tokens=n, stop=[stop])
        if not streamed:
            msg = model.invoke(q, retrieve=True)
            return msg.content, msg.response_metadata["finish_reason"]
        msg = functools.reduce(operator.add, model.stream(q, retrieve=True))
        return msg.content, msg.response_metadata["finish_reason"]

    def llm(stop, n, streamed):
        model = RagkvLLM(rag=rag, max_tokens=n)
        gen = model.generate([q], stop=[stop], retrieve=True).generations[0][0]
        if streamed:
            text = "".join(model.stream(q, stop=[stop], retrieve=True))
            assert text == gen.text
        return gen.text, gen.generation_info["finish_reason"]

    pieces = [c.content for c in ChatRagkv(rag=rag, max_tokens=STOP_MAX).stream(q, retrieve=True)]
    assert len([p for p in pieces if p]) > STOP_MAX // 2
    check_stop_strings(pieces, STOP_MAX, chat)
    pieces = list(RagkvLLM(rag=rag, max_tokens=STOP_MAX).stream(q, retrieve=True))
    check_stop_strings(pieces, STOP_MAX, llm)


def test_langchain_structured_output_over_chunks_and_its_formats(rag, samples):
    """``with_structured_output`` over chunks (the RAG prompt, stored KV reused): a Pydantic object, a
    streamed dict; ``response_format`` per call in OpenAI's shape; refused formats and schemas."""
    pytest.importorskip("llguidance")
    from pydantic import BaseModel, Field

    from integrations.common import format_constraint
    from ragkv.constrain import ConstraintError, JsonConstraint

    class Answer(BaseModel):
        answer: str = Field(max_length=60)
        sure: bool

    chat = ChatRagkv(rag=rag, retrieve=True, k=2, max_tokens=100)
    q = samples[0]["question"]
    out = chat.with_structured_output(Answer).invoke(q)
    assert isinstance(out, Answer)
    parts = list(chat.with_structured_output(Answer.model_json_schema()).stream(q))
    assert parts[-1] == out.model_dump() and all(isinstance(p, dict) for p in parts)
    raw = chat.invoke(q, response_format={"type": "json_object"})
    assert raw.content.startswith("{") and raw.response_metadata["ragkv"]["num_reused_rows"] > 0
    assert format_constraint({"type": "text"}) is None and format_constraint(None) is None
    assert isinstance(
        format_constraint({"type": "json_schema", "json_schema": {"schema": {}}}), JsonConstraint
    )
    with pytest.raises(ValueError, match="response_format must be"):
        format_constraint({"type": "xml"})
    with pytest.raises(ConstraintError, match="objectx"):
        chat.invoke(
            q, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}
        )
    with pytest.raises(ValueError, match="stop strings"):
        chat.invoke(q, stop=["}"], response_format={"type": "json_object"})
