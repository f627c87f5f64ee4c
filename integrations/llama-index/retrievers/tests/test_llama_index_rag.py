"""LlamaIndex's LLM, retriever and query engine with the real library on the tiny model: retrieved nodes
reach the model as chunks whose stored KV is reused; chat keeps the chunk options; one collection at a
time."""

import asyncio

import pytest
from llama_index.core import Document as LlamaDocument
from llama_index.core.llms import ChatMessage
from llama_index.llms.ragkv import RagkvLlamaLLM
from llama_index.retrievers.ragkv import RagkvLlamaRetriever, RagkvNodeParser, RagkvQueryEngine

from ragkv.testing import assert_chunks_reused, two_collections_rag

NEW = 8  # tokens per answer: enough to see streaming, cheap on 2 cores


def test_llama_index_llm_retriever_and_chat(tiny_rag, samples):
    rag = tiny_rag
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
    assert_chunks_reused(done.raw["ragkv"], 3)
    deltas = [r.delta for r in llm.stream_complete(q, chunk_ids=[n.node.node_id for n in nodes])]
    assert len([d for d in deltas if d]) > 1 and "".join(deltas) == done.text
    # chat() keeps the chunk options (CustomLLM's derived chat would render them away)
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=q)]
    chat = llm.chat(msgs, chunk_ids=[n.node.node_id for n in nodes])
    assert_chunks_reused(chat.raw["ragkv"], 3)
    streamed = list(llm.stream_chat(msgs, chunks=nodes))
    assert streamed[-1].message.content == chat.message.content
    assert_chunks_reused(streamed[-1].raw["ragkv"], 3)
    assert llm.complete("Once upon a time").raw["ragkv"]["num_chunks"] == 0


def test_llama_index_query_engine_answers_with_reused_kv(tiny_rag, samples):
    rag = tiny_rag
    q = samples[1]["question"]
    engine = RagkvQueryEngine(
        retriever=RagkvLlamaRetriever(rag, k=3), llm=RagkvLlamaLLM(rag=rag, max_new_tokens=NEW)
    )
    resp = engine.query(q)
    assert resp.response and len(resp.source_nodes) == 3
    assert_chunks_reused(resp.metadata["ragkv"], 3)
    assert resp.metadata["ragkv"]["chunk_ids"] == [
        n.node.metadata["ragkv_chunk_id"] for n in resp.source_nodes
    ]
    aresp = asyncio.run(engine.aquery(q))
    assert aresp.response == resp.response
    assert_chunks_reused(aresp.metadata["ragkv"], 3)


def test_the_llama_index_classes_work_inside_one_collection(tmp_path, one_thread, embedder, samples):
    """``collection=`` on the LlamaIndex classes (issue 24): the retriever searches only it, a chunk id of
    another collection is unknown (KeyError, as a missing id), the node parser gives its chunks and
    ingests nothing into another collection that holds the same text."""
    two = two_collections_rag(tmp_path / "data", embedder)
    r, texts, a_ids, b_ids = two.rag, two.texts, two.a_ids, two.b_ids
    try:
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
