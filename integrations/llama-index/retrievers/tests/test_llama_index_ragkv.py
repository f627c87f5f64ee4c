"""The LlamaIndex retrieval side over ragkv: nodes of another LlamaIndex index resolving to the chunks
ragkv already holds instead of being ingested again, the node parser's nodes as the stored chunks, and
LlamaIndex's standard query engine answering as the explicit chunks do. (The LLM's own conventions:
llama-index-llms-ragkv's tests.)"""

from __future__ import annotations

import pytest

from ragkv.blend import (
    DEFAULT_RATIO,  # tests of blending mechanics: an explicit ratio (outside the fidelity gate)
)

pytest.importorskip("llama_index.core")

from llama_index.core import Document as LlamaDocument  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402
from llama_index.llms.ragkv import RagkvLlamaLLM  # noqa: E402
from llama_index.retrievers.ragkv import RagkvLlamaEmbedding  # noqa: E402

from ragkv import LLM  # noqa: E402
from ragkv.rag import RAG  # noqa: E402
from ragkv.testing import checkout_harness, musique_samples, stories_path, texts_rag  # noqa: E402


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


# ---- async: generation in a worker thread, the loop runs meanwhile ------------------------------------


# ---- prompt hooks ---------------------------------------------------------------------------------------


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
    # the reuse paths at an explicit ratio (the gate's default on this model is exact prefill)
    r = texts_rag(
        tmp_path_factory.mktemp("li-real") / "data", texts, embedder, DEFAULT_MODEL, chunk_tokens=128
    )
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


@pytest.mark.slow
def test_standard_query_engine_answers_as_the_explicit_chunks_do(real_rag, embedder, one_thread):
    """``VectorStoreIndex.from_documents(docs).as_query_engine(llm=RagkvLlamaLLM(...))``: LlamaIndex
    formats the retrieved nodes into its own chat template and hands the LLM one flat conversation
    (recorded by LlamaIndex's instrumentation, not a mock). For sync, streaming and async queries:
    >= 90% of the context's tokens come from stored KV, and the answer equals the explicit form's
    (the same prompt text, each stored chunk in it given as that chunk, ``RAG.job(locate=False)``)."""
    standard = checkout_harness("standard_paths")
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

    standard = checkout_harness("standard_paths")
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
