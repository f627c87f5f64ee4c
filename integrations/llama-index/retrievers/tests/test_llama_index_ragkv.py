"""LlamaIndex conventions of ``RagkvLlamaLLM``: async methods that leave the event loop free, the
prompt hooks (``system_prompt``, ``completion_to_prompt``, ``messages_to_prompt``, ``formatted``) and
the chat template for plain completions, and nodes of another LlamaIndex index resolving to the
chunks ragkv already holds instead of being ingested again."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ragkv.blend import (
    DEFAULT_RATIO,  # tests of blending mechanics: an explicit ratio (outside the fidelity gate)
)

pytest.importorskip("llama_index.core")

from llama_index.core import Document as LlamaDocument  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402
from llama_index.llms.ragkv import RagkvLlamaLLM  # noqa: E402
from llama_index.retrievers.ragkv import RagkvLlamaEmbedding, RagkvLlamaRetriever  # noqa: E402

from ragkv import LLM  # noqa: E402
from ragkv.generate import Detokenizer  # noqa: E402
from ragkv.rag import RAG  # noqa: E402
from ragkv.testing import check_stop_strings, musique_samples, stories_path  # noqa: E402

#: a ChatML template (SmolLM2's, without its default system turn) for the tiny model's tokenizer
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [c["text"][:160] for s in musique_samples(2) for c in s["ctxs"][:3]]


@pytest.fixture(scope="module")
def rag(tmp_path_factory, one_thread, embedder, texts):
    r = RAG(
        LLM(str(stories_path())),
        tmp_path_factory.mktemp("li") / "data",
        embedder=embedder,
        chunk_tokens=64,
        ratio=DEFAULT_RATIO,
    )
    r.ingest([{"id": f"d{i}", "text": t} for i, t in enumerate(texts)], show_progress=False)
    yield r
    r.close()


@pytest.fixture(scope="module")
def chat_rag(tmp_path_factory, one_thread, embedder):
    """The tiny model with a chat template on its (real) tokenizer: what an instruct model has."""
    llm = LLM(str(stories_path()))
    llm.model.tokenizer.chat_template = CHATML
    r = RAG(
        llm,
        tmp_path_factory.mktemp("li-chat") / "data",
        embedder=embedder,
        chunk_tokens=64,
        ratio=DEFAULT_RATIO,
    )
    yield r
    r.close()


# ---- async: generation in a worker thread, the loop runs meanwhile ------------------------------------
def _loop_runs_at_each_token(monkeypatch, make_coro) -> tuple[object, list[bool]]:
    """``make_coro()``'s result, and per generated token whether the event loop ran a callback the test
    scheduled from the generating thread while that token was being produced.

    At every token (``Detokenizer.accept``) the generating thread hands the loop a callback and waits
    for it: a free loop runs it at once; a token produced on the loop's own thread is recorded as
    False without waiting (it would wait forever); a loop blocked elsewhere leaves the wait to its
    generous deadline, False too. Ordering, not timing: no gap is measured."""
    ran_at: list[bool] = []
    accept = Detokenizer.accept

    async def run():
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()

        def witnessed_accept(self, tok):
            if threading.get_ident() == loop_thread:
                ran_at.append(False)
            else:
                ran = threading.Event()
                loop.call_soon_threadsafe(ran.set)
                ran_at.append(ran.wait(60))
            return accept(self, tok)

        monkeypatch.setattr(Detokenizer, "accept", witnessed_accept)
        try:
            return await make_coro()
        finally:
            monkeypatch.setattr(Detokenizer, "accept", accept)

    return asyncio.run(run()), ran_at


def test_async_methods_do_not_block_the_event_loop(rag, texts, monkeypatch):
    """Each async method generates off the loop: at every token, the loop runs a callback scheduled
    while that token is produced (it was: gaps between 10 ms ticks under 50 ms)."""
    llm = RagkvLlamaLLM(rag=rag, max_tokens=150)
    nodes = RagkvLlamaRetriever(rag, k=3).retrieve("Who wrote it?")
    sync = llm.complete("Who wrote it?", chunks=nodes)

    async def collect(agen_coro):
        return [r async for r in await agen_coro]

    msgs = [ChatMessage(role="user", content="Who wrote it?")]
    for make in (
        lambda: llm.acomplete("Who wrote it?", chunks=nodes),
        lambda: collect(llm.astream_complete("Who wrote it?", chunks=nodes)),
        lambda: llm.achat(msgs, chunks=nodes),
        lambda: collect(llm.astream_chat(msgs, chunks=nodes)),
    ):
        out, ran_at = _loop_runs_at_each_token(monkeypatch, make)
        assert len(ran_at) >= 2 and all(ran_at), ran_at  # the loop ran while each token was generated
        last = out[-1] if isinstance(out, list) else out
        text = last.text if hasattr(last, "text") else last.message.content
        assert text == sync.text and last.raw["ragkv"]["kv_hits"] == 3


# ---- prompt hooks ---------------------------------------------------------------------------------------
def _prompt_tokens(resp) -> int:
    return resp.raw["ragkv"]["num_tokens"] if "num_tokens" in resp.raw["ragkv"] else -1


def test_plain_completion_uses_the_chat_template_and_system_prompt(chat_rag):
    model = chat_rag.model
    llm = RagkvLlamaLLM(rag=chat_rag, max_tokens=6, system_prompt="Be brief.")
    assert llm.metadata.is_chat_model
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert llm.completion_prompt("Hello") == rendered  # was: "Hello" as is (system prompt ignored)
    templated = llm.complete("Hello")
    assert templated.text == llm.complete(rendered, formatted=True).text
    assert templated.raw["ragkv"]["num_tokens"] == len(model.encode(rendered, add_bos=True))
    raw = llm.complete("Hello", formatted=True)  # formatted: sent as is
    assert raw.raw["ragkv"]["num_tokens"] == len(model.encode("Hello", add_bos=True))
    # a custom completion_to_prompt formats the (system-prefixed) prompt instead of the template
    custom = RagkvLlamaLLM(
        rag=chat_rag, max_tokens=6, system_prompt="Be brief.", completion_to_prompt=lambda p: f"Q: {p}\nA:"
    )
    assert custom.completion_prompt("Hello") == "Q: Be brief.\n\nHello\nA:"
    assert custom.complete("Hello").text == llm.complete("Q: Be brief.\n\nHello\nA:", formatted=True).text


def test_chat_uses_messages_to_prompt_or_the_template(chat_rag):
    msgs = [ChatMessage(role="user", content="Hello")]
    llm = RagkvLlamaLLM(rag=chat_rag, max_tokens=6, system_prompt="Be brief.")
    rendered = llm.completion_prompt("Hello")
    assert llm.chat_prompt(msgs) == rendered
    assert llm.chat(msgs).message.content == llm.complete(rendered, formatted=True).text
    custom = RagkvLlamaLLM(
        rag=chat_rag,
        max_tokens=6,
        system_prompt="Be brief.",
        messages_to_prompt=lambda ms: "".join(f"[{m.role.value}] {m.content}\n" for m in ms),
    )
    assert custom.chat_prompt(msgs) == "[system] Be brief.\n[user] Hello\n"
    assert custom.chat(msgs).message.content == llm.complete(custom.chat_prompt(msgs), formatted=True).text


def test_without_a_chat_template_the_system_prompt_is_prepended(rag):
    llm = RagkvLlamaLLM(rag=rag, max_tokens=4, system_prompt="Once upon a time")
    assert not llm.metadata.is_chat_model
    assert llm.completion_prompt("there was a cat") == "Once upon a time\n\nthere was a cat"
    # with chunks the system prompt goes with the question into ragkv's RAG prompt
    q = "Who wrote it?"
    nodes = RagkvLlamaRetriever(rag, k=2).retrieve(q)
    plain = RagkvLlamaLLM(rag=rag, max_tokens=4).complete(f"Once upon a time\n\n{q}", chunks=nodes)
    assert llm.complete(q, chunks=nodes).text == plain.text


def test_unknown_constructor_parameters_are_refused(rag):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        RagkvLlamaLLM(rag=rag, max_token=8)
    assert RagkvLlamaLLM(rag=rag, max_tokens=5).metadata.num_output == 5


def test_instruct_model_plain_completion_is_not_empty(tmp_path, embedder):
    """On the real instruct model a bare question used to come back empty (no chat template applied)."""
    from ragkv.model import DEFAULT_MODEL
    from ragkv.model.registry import ModelFetchError, pull

    try:
        pull(DEFAULT_MODEL, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    r = RAG(LLM(DEFAULT_MODEL), tmp_path / "data", embedder=embedder, ratio=DEFAULT_RATIO)
    try:
        llm = RagkvLlamaLLM(rag=r, max_tokens=12)
        out = llm.complete("What is the capital of France?")
        assert out.text.strip() and "Paris" in out.text
        # the ChatML template's first <|im_start|> (SmolLM2's BOS text, which its tokenizer does not
        # add) is kept: it was cut off as if the encoding would add it back
        rendered = llm.completion_prompt("What is the capital of France?")
        assert rendered.startswith("<|im_start|>system\n")
        ids = r.model.encode(rendered, add_bos=True, specials=True)  # a rendered template: its tokens parsed
        assert ids[0] == r.model.config.bos_token_id and out.raw["ragkv"]["num_tokens"] == len(ids)
    finally:
        r.close()


# ---- foreign nodes ---------------------------------------------------------------------------------------
def test_nodes_of_another_index_resolve_to_held_chunks(rag, texts, embedder):
    n_docs = len(rag.index.document_ids())
    other = VectorStoreIndex.from_documents(
        [LlamaDocument(text=t) for t in texts],
        embed_model=RagkvLlamaEmbedding(embedder),
        transformations=[SentenceSplitter(chunk_size=1024)],
    )
    q = musique_samples(1)[0]["question"]
    nodes = other.as_retriever(similarity_top_k=2, embed_model=RagkvLlamaEmbedding(embedder)).retrieve(q)
    assert len(nodes) == 2 and all("ragkv_chunk_id" not in n.node.metadata for n in nodes)
    llm = RagkvLlamaLLM(rag=rag, max_tokens=4)
    info = llm.complete(q, chunks=nodes).raw["ragkv"]
    assert info["ingested_documents"] == []  # was: both ingested again as ext-... documents
    assert len(rag.index.document_ids()) == n_docs
    held = [rag.index.chunk(c) for c in info["chunk_ids"]]
    assert {r.doc_id for r in held} == {f"d{texts.index(n.node.get_content())}" for n in nodes}
    assert info["kv_hits"] == len(held) == info["num_chunks"]
    # a node holding exactly one stored chunk's text resolves to that chunk (by its content key)
    rec = rag.index.chunks_of("d1")[1]
    one = llm.complete(q, chunks=[TextNode(text=rec.text)]).raw["ragkv"]
    assert one["chunk_ids"] == [rec.chunk_id] and one["ingested_documents"] == []
    # text ragkv does not hold is still ingested on first use, and found afterwards
    new = TextNode(text="Lily had a red ball. She played with it in the park every day.")
    first = llm.complete(q, chunks=[new]).raw["ragkv"]
    assert len(first["ingested_documents"]) == 1
    again = llm.complete(q, chunks=[new]).raw["ragkv"]
    assert again["ingested_documents"] == [] and again["chunk_ids"] == first["chunk_ids"]


def test_node_parser_nodes_are_the_stored_chunks(rag, texts):
    """``RagkvNodeParser``: each document's nodes are the chunks ragkv stores for it (text, ids in
    metadata kept out of prompts and embeddings, the document's own metadata, LlamaIndex's source and
    prev/next relations); documents ragkv holds are not ingested again, a new one is, once."""
    from llama_index.core.schema import MetadataMode, NodeRelationship
    from llama_index.retrievers.ragkv import RagkvNodeParser

    parser = RagkvNodeParser(rag=rag)
    before = set(rag.index.document_ids())
    n_docs = len(before)
    docs = [LlamaDocument(text=t, metadata={"i": i}) for i, t in enumerate(texts[:2])]
    nodes = parser.get_nodes_from_documents(docs)
    want = [r for i in range(2) for r in rag.index.chunks_of(f"d{i}")]
    assert len(want) >= 3 and [n.get_content() for n in nodes] == [r.text for r in want]
    assert [n.metadata["ragkv_chunk_id"] for n in nodes] == [r.chunk_id for r in want]
    assert [n.metadata["i"] for n in nodes] == [int(r.doc_id[1:]) for r in want]
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        assert "ragkv" not in nodes[0].get_content(metadata_mode=mode)
    assert nodes[0].relationships[NodeRelationship.SOURCE].node_id == docs[0].doc_id
    assert NodeRelationship.NEXT in nodes[0].relationships
    assert "ragkv_chunk_id" not in docs[0].excluded_llm_metadata_keys  # the document's lists untouched
    assert len(rag.index.document_ids()) == n_docs
    new = "Lily had a red ball. She played with it in the park every day. The ball was big and red."
    first = parser.get_nodes_from_documents([LlamaDocument(text=new)])
    again = parser.get_nodes_from_documents([LlamaDocument(text=new)])
    assert [n.metadata["ragkv_chunk_id"] for n in again] == [n.metadata["ragkv_chunk_id"] for n in first]
    (added,) = set(rag.index.document_ids()) - before
    assert added.startswith("ext-") and len(rag.index.document_ids()) == n_docs + 1
    rag.delete_document(added)


# ---- stop strings -----------------------------------------------------------------------------------------
def test_stop_strings_never_leak_and_finish_reason_is_right(rag):
    q = "Who wrote it?"
    nodes = RagkvLlamaRetriever(rag, k=3).retrieve(q)

    def complete(stop, n, streamed):
        llm = RagkvLlamaLLM(rag=rag, max_tokens=n, stop=[stop])
        if not streamed:
            r = llm.complete(q, chunks=nodes)
            return r.text, r.raw["finish_reason"]
        rs = list(llm.stream_complete(q, chunks=nodes))
        assert rs[-1].text == "".join(r.delta for r in rs)
        return "".join(r.delta for r in rs), rs[-1].raw["finish_reason"]

    pieces = [r.delta for r in RagkvLlamaLLM(rag=rag, max_tokens=24).stream_complete(q, chunks=nodes)]
    check_stop_strings(pieces, 24, complete)


# ---- the standard path: a LlamaIndex query engine over its own index ---------------------------------------
@pytest.fixture(scope="module")
def real_rag(tmp_path_factory, embedder):
    """The real default model over six MuSiQue passages (two or three stored chunks each): LlamaIndex's
    response synthesizer keeps 500 tokens of padding, more than the tiny model's whole context."""
    from ragkv.model import DEFAULT_MODEL
    from ragkv.model.registry import ModelFetchError, pull

    try:
        pull(DEFAULT_MODEL, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    texts = [c["text"].strip()[:700] for s in musique_samples(2) for c in s["ctxs"][:3]]
    r = RAG(  # the reuse paths at an explicit ratio (the gate's default on this model is exact prefill)
        LLM(DEFAULT_MODEL),
        tmp_path_factory.mktemp("li-real") / "data",
        embedder=embedder,
        chunk_tokens=128,
        ratio=DEFAULT_RATIO,
    )
    r.ingest([{"id": f"d{i}", "text": t} for i, t in enumerate(texts)], show_progress=False)
    r.texts = texts
    yield r
    r.close()


def _check_standard(res, rag) -> None:
    """Issue 26's goal for one standard-path answer: the context from stored KV, the answer the
    explicit form's, and the prompt what the wrapper completed (its first turn's BOS kept)."""
    row = res.row()
    assert res.reused_share >= 0.9, row
    assert res.equal, row
    assert res.chunks_given >= 2 and res.explicit_rows >= 0.99 * res.context_tokens, row  # all of it
    assert res.same_job and res.info["num_tokens"] == res.explicit_tokens, row


def _standard_paths():
    """The checkout's harness of the frameworks' standard paths (``eval/standard_paths.py``, shared with
    ``python -m eval.bench_flat_reuse``): importable in a run from the repository's root, where the core
    suite's ``tests`` package puts the checkout on the path; these two tests skip in a run from this folder."""
    return pytest.importorskip(
        "eval.standard_paths", reason="the checkout's eval/ (run from the repository root)"
    )


@pytest.mark.slow
def test_standard_query_engine_answers_as_the_explicit_chunks_do(real_rag, embedder, one_thread):
    """``VectorStoreIndex.from_documents(docs).as_query_engine(llm=RagkvLlamaLLM(...))``: LlamaIndex
    formats the retrieved nodes into its own chat template and hands the LLM one flat conversation
    (recorded by LlamaIndex's instrumentation, not a mock). For sync, streaming and async queries:
    >= 90% of the context's tokens come from stored KV, and the answer equals the explicit form's
    (the same prompt text, each stored chunk in it given as that chunk, ``RAG.job(locate=False)``)."""
    standard = _standard_paths()
    KINDS, compare, llama_calls, llamaindex_answer, recording = (
        standard.KINDS, standard.compare, standard.llama_calls, standard.llamaindex_answer, standard.recording
    )  # fmt: skip

    index = VectorStoreIndex.from_documents(
        [LlamaDocument(text=t) for t in real_rag.texts], embed_model=RagkvLlamaEmbedding(embedder)
    )
    llm = RagkvLlamaLLM(rag=real_rag, max_tokens=8)
    q = musique_samples(1)[0]["question"]
    for kind in KINDS:
        with recording(llama_calls()) as calls:
            answer, nodes = llamaindex_answer(index, llm, q, kind)
        (call,) = calls.calls
        assert call.messages is not None  # an instruct model: LlamaIndex's chat QA template
        prompt = calls.prompt_of(llm, call)
        assert prompt.startswith("<|im_start|>system\n")  # was: the first <|im_start|> dropped
        res = compare("llamaindex", kind, real_rag, llm, answer, call, prompt, nodes)
        _check_standard(res, real_rag)
        assert res.info["kv_hits"] == res.chunks_given


@pytest.mark.slow
def test_node_parser_makes_long_documents_nodes_the_stored_chunks(real_rag, embedder, one_thread):
    """LlamaIndex's own splitter cuts a long document elsewhere than ragkv, so parts of its nodes are
    not stored chunks; with ``RagkvNodeParser`` the nodes are the stored chunks, the query engine's
    context comes from stored KV and its answer equals the explicit form's. Documents ragkv holds
    are not ingested again; the nodes resolve to their chunks for ``chunks=`` too."""
    from llama_index.retrievers.ragkv import RagkvNodeParser

    standard = _standard_paths()
    compare, llama_calls, llamaindex_answer, recording = (
        standard.compare, standard.llama_calls, standard.llamaindex_answer, standard.recording
    )  # fmt: skip

    long_docs = [" ".join(real_rag.texts[:3]), " ".join(real_rag.texts[3:])]
    n_docs = len(real_rag.index.document_ids())
    parser = RagkvNodeParser(rag=real_rag)
    index = VectorStoreIndex.from_documents(
        [LlamaDocument(text=t, metadata={"source": f"long{i}"}) for i, t in enumerate(long_docs)],
        embed_model=RagkvLlamaEmbedding(embedder),
        transformations=[parser],
    )
    assert len(real_rag.index.document_ids()) == n_docs + 2  # ingested once, as ext-... documents
    nodes = list(index.docstore.docs.values())
    recs = [real_rag.index.chunk(n.metadata["ragkv_chunk_id"]) for n in nodes]
    assert [n.get_content() for n in nodes] == [r.text for r in recs] and len(recs) >= 6
    assert all(n.metadata["source"].startswith("long") for n in nodes)
    assert "ragkv_kv_key" not in nodes[0].get_content(metadata_mode="llm")  # ids kept out of prompts
    again = parser.get_nodes_from_documents([LlamaDocument(text=long_docs[0])])
    assert len(real_rag.index.document_ids()) == n_docs + 2  # held: not ingested again
    assert [n.metadata["ragkv_chunk_id"] for n in again] == [
        r.chunk_id for r in recs if r.doc_id == recs[0].doc_id
    ]

    llm = RagkvLlamaLLM(rag=real_rag, max_tokens=8)
    q = musique_samples(2)[1]["question"]
    with recording(llama_calls()) as calls:
        answer, got = llamaindex_answer(index, llm, q, "sync")
    (call,) = calls.calls
    _check_standard(
        compare("llamaindex", "sync", real_rag, llm, answer, call, calls.prompt_of(llm, call), got), real_rag
    )
    # the explicit chunks= form takes the nodes as the stored chunks they are (nothing ingested)
    info = llm.complete(q, chunks=got).raw["ragkv"]
    assert info["ingested_documents"] == [] and info["chunk_ids"] == [
        n.node.metadata["ragkv_chunk_id"] for n in got
    ]
