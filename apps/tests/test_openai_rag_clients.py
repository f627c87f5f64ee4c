"""Issue 39 on the real default model: the RAG code users already have, pointed at a live ragkv
service (``python -m ragkv_server.server``, the first MuSiQue question's first 4 passages ingested).

* LangChain's stuff chain ``ChatPromptTemplate([system, "Context:\\n{context}\\n\\nQuestion: {question}"])
  | ChatOpenAI(base_url=...)`` with 2 and 4 passages (~1.2K and ~2.4K tokens: stored chunks side by side,
  ~600 tokens each; ``python -m eval.bench_openai_rag`` runs 2, 4, 6 and 10, up to ~6K tokens,
  with timings): every request is
  accepted, at least 90% of the passages' tokens come from stored KV, and the answer is the explicit
  path's: the same prompt token ids completed through the Python API (``RAG.job``) with the passages'
  stored chunks given explicitly (``locate=False``) in the RAG's default mode.
* LlamaIndex's ``OpenAILike`` LLM (``llama-index-llms-openai-like``) in a standard
  ``VectorStoreIndex(...).as_query_engine()`` over the same passages: the same three properties.

What the service answered (its ``ragkv`` statistics, ``prompt_token_ids``) is read with an httpx
response hook on the HTTP client the framework's OpenAI client uses: the frameworks keep only the
message. The explicit path runs in this process on the service's data folder, opened read-only.
"""

from __future__ import annotations

import pytest

from ragkv.blend import DEFAULT_RATIO
from ragkv.testing import checkout_harness

pytest.importorskip("langchain_openai")

# the benchmark's clients and service start (python -m eval.bench_openai_rag): a checkout's eval/, importable
# in a run from the repository's root; this module skips in a run from apps/
bench = checkout_harness("bench_openai_rag")
Recorder, chat_openai, musique_passages, start_service, stuff_chain = (
    bench.Recorder, bench.chat_openai, bench.musique_passages, bench.start_service, bench.stuff_chain
)  # fmt: skip
from ragkv.generate import SamplingParams  # noqa: E402
from ragkv.rag.generation import Generated  # noqa: E402
from ragkv.testing import worker_threads  # noqa: E402
from ragkv_server.testing import stop_server  # noqa: E402

pytestmark = pytest.mark.slow  # the real model behind a live service

NEW = 16
PASSAGES = 4  # each ingested passage is a real-model prefill: the longest prompts are the benchmark's


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``(base URL, served model id, question, passages, read-only RAG on the service's data)``."""
    from ragkv import DEFAULT_MODEL
    from ragkv.model.registry import ModelFetchError, pull
    from ragkv_server.config import load_settings
    from ragkv_server.service import build_rag

    try:
        pull(DEFAULT_MODEL, quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model not available: {e}")
    question, passages = musique_passages(PASSAGES)  # what the prompts use
    data = tmp_path_factory.mktemp("openai-rag") / "data"
    # the reuse path at an explicit ratio (the gate's default on this model is exact prefill: no reuse)
    proc, base = start_service(
        data, DEFAULT_MODEL, worker_threads(), passages, ratio=DEFAULT_RATIO, fork=True
    )
    rag = None
    try:
        settings = load_settings(None, model=DEFAULT_MODEL, data_dir=str(data), ratio=DEFAULT_RATIO)
        rag = build_rag(settings, collect_garbage=False)
        yield base, DEFAULT_MODEL, question, passages, rag
    finally:
        if rag is not None:
            rag.close()
        stop_server(proc, 60)
    assert "Traceback" not in (data.parent / "server.log").read_text()


def explicit_spans(ids: list[int], recs, edge: int = 2):
    """The stored chunks ``recs`` as they lie in ``ids``: for each, the longest slice of its tokens
    (at most ``edge`` off either end: tokens that merged with the text beside them) found in ``ids``
    after the previous one, by token comparison alone."""
    from ragkv.blend.locate import Located

    where: dict[int, list[int]] = {}
    for i, t in enumerate(ids):
        where.setdefault(t, []).append(i)
    out, pos = [], 0
    for r in recs:
        toks = list(r.token_ids)
        n = len(toks)
        best = None
        for lo in range(edge + 1):
            for hi in range(n, n - edge - 1, -1):
                piece = toks[lo:hi]
                at = next(
                    (i for i in where.get(piece[0], ()) if i >= pos and ids[i : i + len(piece)] == piece), -1
                )
                if at >= 0 and (best is None or hi - lo > best[2] - best[1]):
                    best = (at, lo, hi)
        if best is not None:
            out.append(Located(r.kv_key, tuple(toks), *best))
            pos = best[0] + best[2] - best[1]
    return out


def explicit_answer(rag, ids: list[int], texts: list[str]) -> tuple[str, int]:
    """The Python API's answer on ``ids`` with the stored chunks of ``texts`` given explicitly, in the
    RAG's default mode and ratio (``RAG.job`` decides them: the service's default operating point);
    and the rows it gives from stored KV."""
    index = rag.index
    recs = [
        r
        for t in texts
        for doc in index.documents_with_text(t, "default")
        for r in index.chunks_of(doc, "default")
    ]
    spans = explicit_spans(ids, recs)
    job = rag.job(ids, spans, None, SamplingParams(max_new_tokens=NEW), locate=False)
    done = [x for x in rag.generate(job) if isinstance(x, Generated)][-1]
    return done.text, sum(s.hi - s.lo for s in spans)


def _passage_tokens(rag, texts: list[str]) -> int:
    return sum(len(rag.model.encode(t)) for t in texts)


def test_langchain_stuff_chain_through_chat_openai(service):
    base, model, question, passages, rag = service
    rec = Recorder()
    chain = stuff_chain(chat_openai(base, model, rec, max_tokens=NEW, extra_body={"return_token_ids": True}))
    for n in (2, PASSAGES):  # two passages, then all: longer prompts add time, not a property
        texts = passages[:n]
        msg = chain.invoke({"context": "\n\n".join(texts), "question": question})  # accepted: no 400
        body = rec.last
        stats, ids = body["ragkv"]["stats"], body["prompt_token_ids"]
        share = stats["num_reused_rows"] / _passage_tokens(rag, texts)
        assert share >= 0.9, (n, share, stats)
        assert msg.usage_metadata["input_token_details"]["cache_read"] >= stats["num_reused_rows"]
        want, rows = explicit_answer(rag, ids, texts)
        assert rows == stats["num_reused_rows"], n  # the same stored rows in the same places
        assert msg.content == want, (n, msg.content, want)
        assert (stats["mode"], stats["ratio"]) == (rag.mode, rag.ratio)


def test_llamaindex_openai_like_query_engine(service):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.llms.openai_like import OpenAILike

    RagkvLlamaEmbedding = pytest.importorskip("llama_index.retrievers.ragkv").RagkvLlamaEmbedding

    base, model, question, passages, rag = service
    rec = Recorder()
    llm = OpenAILike(
        model=model,
        api_base=base + "/v1",
        api_key="unused",
        is_chat_model=True,
        context_window=8192,
        max_tokens=NEW,
        temperature=0,
        max_retries=0,
        timeout=600,  # the client's default 60 s is shorter than a loaded 2-core machine's prefill
        http_client=rec.client(),
        additional_kwargs={"extra_body": {"return_token_ids": True}},
    )
    texts = passages
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in texts], embed_model=RagkvLlamaEmbedding(rag.embedder)
    )
    resp = index.as_query_engine(llm=llm, similarity_top_k=len(texts)).query(question)
    body = rec.last
    stats, ids = body["ragkv"]["stats"], body["prompt_token_ids"]
    used = [n.node.get_content() for n in resp.source_nodes]
    assert sorted(used) == sorted(texts)  # each passage one node, all of them in the prompt
    share = stats["num_reused_rows"] / _passage_tokens(rag, texts)
    assert share >= 0.9, (share, stats)
    want, rows = explicit_answer(rag, ids, used)  # in the prompt's order: the nodes' order
    assert rows == stats["num_reused_rows"]
    assert str(resp.response).strip() == want.strip()
