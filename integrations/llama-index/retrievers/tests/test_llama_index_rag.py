"""LlamaIndex's LLM, retriever and query engine with the real library on the tiny model: retrieved nodes
reach the model as chunks whose stored KV is reused; chat keeps the chunk options; one collection at a
time."""

import asyncio

import pytest
from llama_index.core import Document as LlamaDocument
from llama_index.core.llms import ChatMessage
from llama_index.llms.ragkv import RagkvLlamaLLM
from llama_index.retrievers.ragkv import RagkvLlamaRetriever, RagkvNodeParser, RagkvQueryEngine

from ragkv import LLM
from ragkv.blend import DEFAULT_RATIO
from ragkv.rag import RAG
from ragkv.testing import musique_rag, musique_samples, stories_model

NEW = 8  # tokens per answer: enough to see streaming, cheap on 2 cores


@pytest.fixture(scope="module")
def samples():
    return musique_samples(2)


@pytest.fixture(scope="module")
def rag(tmp_path_factory, one_thread, embedder):
    """A RAG on the tiny model over six MuSiQue passages, each chunk's KV stored."""
    r = musique_rag(tmp_path_factory.mktemp("li") / "data", embedder)
    yield r
    r.close()


def _reused(info: dict, n_chunks: int) -> None:
    """The answer's prefill reused every chunk's stored KV (blend)."""
    assert info["mode"] == "blend"
    assert info["kv_hits"] == n_chunks == info["num_chunks"]
    assert info["num_reused_rows"] > 0
    assert info["recomputed_per_layer"][-1] < info["num_tokens"]


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


def test_the_llama_index_classes_work_inside_one_collection(tmp_path, one_thread, embedder, samples):
    """``collection=`` on the LlamaIndex classes (issue 24): the retriever searches only it, a chunk id of
    another collection is unknown (KeyError, as a missing id), the node parser gives its chunks and
    ingests nothing into another collection that holds the same text."""
    r = RAG(
        LLM(stories_model()),
        tmp_path / "data",
        embedder=embedder,
        chunk_tokens=64,
        top_k=2,
        ratio=DEFAULT_RATIO,
    )
    try:
        texts = [c["text"][:300] for s in samples for c in s["ctxs"][:2]]
        r.ingest(
            [{"id": "pa", "text": texts[0]}, {"id": "pa2", "text": texts[1]}],
            show_progress=False,
            collection="a",
        )
        r.ingest(
            [{"id": "pb", "text": texts[2]}, {"id": "pb2", "text": texts[3]}],
            show_progress=False,
            collection="b",
        )
        a_ids = {c.chunk_id for d in ("pa", "pa2") for c in r.index.chunks_of(d, "a")}
        b_ids = {c.chunk_id for d in ("pb", "pb2") for c in r.index.chunks_of(d, "b")}
        q = samples[0]["question"]
        nodes = RagkvLlamaRetriever(r, k=5, collection="b").retrieve(q)
        assert nodes and {n.node.metadata["ragkv_chunk_id"] for n in nodes} <= b_ids
        llm = RagkvLlamaLLM(rag=r, max_new_tokens=2, collection="a")
        with pytest.raises(KeyError):
            llm.complete(q, chunk_ids=[f"ragkv:{min(b_ids)}"])
        before_b = r.list_documents("b")
        nodes = RagkvNodeParser(rag=r, collection="a").get_nodes_from_documents(
            [LlamaDocument(text=texts[0])]
        )
        assert nodes and {n.metadata["ragkv_chunk_id"] for n in nodes} <= a_ids
        assert r.list_documents("b") == before_b  # the same text held by a: nothing ingested into b
    finally:
        r.close()
