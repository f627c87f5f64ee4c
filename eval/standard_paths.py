"""The frameworks' own standard RAG paths, driven as their users write them, and the explicit form
they are compared with (issue 26). ``python -m eval.standard_paths`` measures them on the real
model (what ``python -m eval.bench_flat_reuse --via framework`` runs).

* LlamaIndex: ``VectorStoreIndex(...).as_query_engine(llm=RagkvLlamaLLM(...)).query(q)`` (sync,
  ``streaming=True``, ``aquery``): LlamaIndex formats the retrieved nodes into its own question-
  answering template and hands the LLM one flat conversation.
* LangChain: the standard LCEL chain ``{"context": retriever | format_docs, "question":
  RunnablePassthrough()} | prompt | ChatRagkv(...) | StrOutputParser()`` with ``format_docs``
  joining ``page_content`` by blank lines (``invoke``, ``stream``, ``ainvoke``).

What the framework handed ragkv's wrapper is recorded with the framework's own observation hooks,
not a mock: LlamaIndex's instrumentation events (:class:`LlamaCalls`, the LLM call's start event
carries its messages or prompt, its end event the response with ``raw["ragkv"]``) and a LangChain
callback handler (:class:`LangChainCalls`: ``on_chat_model_start`` / ``on_llm_start`` and
``on_llm_end``). The flat prompt text the wrapper completed is then what the wrapper's own
rendering makes of it (:meth:`RagkvLlamaLLM.chat_prompt`, :meth:`ChatRagkv.chat_prompt` ...).

The explicit form (:func:`explicit_text`) is that same prompt text with each stored chunk of the
retrieved documents given as the stored chunk (its own token ids, the text around them tokenized
apart; where the framework trimmed a chunk's edge, the rows whose text is there), completed through
``RAG.job(..., locate=False)`` with the wrapper's mode, ratio and sampling. It is built here from the
documents the framework retrieved, by text, apart from the wrappers' own segmentation of the flat
prompt (``RAG.segment_text``, from the chunk locator): ``same_job`` says whether the two agree. The
answer the framework returned must equal the explicit one, and the wrapper's statistics say how
much of the prompt's context came from stored KV (``num_reused_rows`` over the tokens of the
documents the framework formatted in).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragkv.blend.locate import Located
from ragkv.fidelity.plan import RequestSettings
from ragkv.rag import RAG, ChunkRecord
from ragkv.rag.generation import Generated

#: LangChain's standard RAG prompt (the LangChain hub's ``rlm/rag-prompt``, one human message)
LC_RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
    "to answer the question. If you don't know the answer, just say that you don't know. Use three "
    "sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"
)
KINDS = ("sync", "stream", "async")


@dataclass
class Call:
    """One LLM call as the framework made it: chat ``messages`` or a ``prompt`` (with LlamaIndex's
    ``formatted`` flag), and the wrapper's reuse statistics from the response it returned."""

    messages: list | None = None
    prompt: str | None = None
    formatted: bool = False
    info: dict = field(default_factory=dict)


# ---- recording what the framework hands the LLM ------------------------------------------------------
def llama_calls():
    """A :class:`LlamaCalls` event handler (LlamaIndex imported only when asked for)."""
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import (
        LLMChatEndEvent,
        LLMChatStartEvent,
        LLMCompletionEndEvent,
        LLMCompletionStartEvent,
    )
    from pydantic import Field

    class LlamaCalls(BaseEventHandler):
        """LlamaIndex instrumentation handler recording each LLM call (start: input; end: ``raw``)."""

        calls: list = Field(default_factory=list)
        open_: dict = Field(default_factory=dict)

        @classmethod
        def class_name(cls) -> str:
            return "RagkvLlamaCalls"

        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, LLMChatStartEvent):
                self.open_[event.span_id] = Call(messages=list(event.messages))
            elif isinstance(event, LLMCompletionStartEvent):
                formatted = bool((event.additional_kwargs or {}).get("formatted", False))
                self.open_[event.span_id] = Call(prompt=event.prompt, formatted=formatted)
            elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
                call = self.open_.pop(event.span_id, None)
                if call is not None and event.response is not None:
                    call.info = dict((event.response.raw or {}).get("ragkv", {}))
                    self.calls.append(call)

        def prompt_of(self, llm: Any, call: Call) -> str:
            """The flat prompt text ``llm`` (a ``RagkvLlamaLLM``) completed for ``call``."""
            if call.messages is not None:
                return llm.chat_prompt(call.messages)
            return llm.completion_prompt(call.prompt, call.formatted)

    return LlamaCalls()


class _Registered:
    """``with recording(handler):`` LlamaIndex's root dispatcher sends its events to ``handler``."""

    def __init__(self, handler: Any):
        from llama_index.core.instrumentation import get_dispatcher

        self.handler, self.dispatcher = handler, get_dispatcher()

    def __enter__(self):
        self.dispatcher.add_event_handler(self.handler)
        return self.handler

    def __exit__(self, *exc) -> None:
        self.dispatcher.event_handlers.remove(self.handler)


def recording(handler: Any) -> _Registered:
    return _Registered(handler)


def langchain_calls():
    """A :class:`LangChainCalls` callback handler (LangChain imported only when asked for)."""
    from langchain_core.callbacks import BaseCallbackHandler

    class LangChainCalls(BaseCallbackHandler):
        """LangChain callback handler recording each chat-model / LLM call and its response metadata."""

        def __init__(self) -> None:
            self.calls: list[Call] = []
            self.open_: dict = {}
            self.retrieved: list[list] = []  # each retrieval's documents

        def on_retriever_end(self, documents, *, run_id, **kwargs) -> None:
            self.retrieved.append(list(documents))

        def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs) -> None:
            self.open_[run_id] = Call(messages=list(messages[0]))

        def on_llm_start(self, serialized, prompts, *, run_id, **kwargs) -> None:
            self.open_[run_id] = Call(prompt=prompts[0])

        def on_llm_end(self, response, *, run_id, **kwargs) -> None:
            call = self.open_.pop(run_id, None)
            if call is None:
                return
            gen = response.generations[0][0]
            msg = getattr(gen, "message", None)
            meta = msg.response_metadata if msg is not None else (gen.generation_info or {})
            call.info = dict(meta.get("ragkv", {}))
            self.calls.append(call)

        @staticmethod
        def prompt_of(llm: Any, call: Call) -> str:
            """The flat prompt text ``llm`` (``ChatRagkv`` / ``RagkvLLM``) completed for ``call``."""
            return llm.chat_prompt(call.messages) if call.messages is not None else call.prompt

    return LangChainCalls()


# ---- the standard paths -------------------------------------------------------------------------------
def llamaindex_answer(
    index: Any, llm: Any, question: str, kind: str, top_k: int = 2
) -> tuple[str, list[str]]:
    """``index.as_query_engine(llm=llm)`` answering ``question`` the LlamaIndex way ``kind``:
    ``(the answer, the retrieved nodes)``."""
    engine = index.as_query_engine(llm=llm, similarity_top_k=top_k, streaming=kind == "stream")
    if kind == "sync":
        resp = engine.query(question)
        text = str(resp.response)
    elif kind == "stream":
        resp = engine.query(question)
        text = "".join(resp.response_gen)
    else:
        resp = asyncio.run(engine.aquery(question))
        text = str(resp.response)
    return text, list(resp.source_nodes)


def format_docs(docs: Sequence[Any]) -> str:
    """LangChain's usual ``format_docs``: page contents joined by blank lines (no ragkv markers)."""
    return "\n\n".join(d.page_content for d in docs)


def lcel_chain(retriever: Any, model: Any, template: str = LC_RAG_PROMPT):
    """The standard LCEL RAG chain: retriever | format_docs | prompt | model | StrOutputParser."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages([("human", template)])
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | model
        | StrOutputParser()
    )


def lcel_answer(chain: Any, question: str, kind: str, callbacks: list) -> str:
    """The chain answering ``question`` the LangChain way ``kind``, with ``callbacks`` attached."""
    config = {"callbacks": callbacks}
    if kind == "sync":
        return chain.invoke(question, config=config)
    if kind == "stream":
        return "".join(chain.stream(question, config=config))
    return asyncio.run(chain.ainvoke(question, config=config))


# ---- the explicit form --------------------------------------------------------------------------------
def explicit_text(
    model: Any, text: str, recs: Sequence[ChunkRecord], edge: int = 2
) -> tuple[list[int], list[Located], list]:
    """The explicit form of the flat prompt ``text`` as a ragkv wrapper completes it (BOS when the
    tokenizer adds one, then the text): each stored chunk of ``recs`` (in prompt order) whose text
    occurs in ``text`` after the previous one is given as that stored chunk, its own token ids; the
    text around the chunks is tokenized apart. Where the framework trimmed a chunk's edge
    (LlamaIndex strips each node's text: a chunk that starts with ``" word"`` appears as ``"word"``)
    the rows whose text is there are given (up to ``edge`` tokens off either end), the trimmed
    token's text tokenized with the text around it. Returns ``(ids, spans, chunks used)``."""
    ids, spans, used, pos = list(model.encode("", add_bos=True)), [], [], 0
    for r in recs:
        found = _find_slice(model, text, r, pos, edge)
        if found is None:
            continue  # not in the prompt (not even trimmed)
        at, lo, hi, piece = found
        ids += model.encode(text[pos:at], specials=True) if at > pos else []
        toks = tuple(int(t) for t in r.token_ids)
        spans.append(Located(r.kv_key, toks, len(ids), lo, hi))
        ids += toks[lo:hi]
        used.append(r)
        pos = at + len(piece)
    ids += model.encode(text[pos:], specials=True) if pos < len(text) else []
    return ids, spans, used


def _find_slice(model: Any, text: str, rec: ChunkRecord, pos: int, edge: int):
    """``(where, lo, hi, its text)`` of the longest slice ``[lo, hi)`` of ``rec``'s tokens (at most
    ``edge`` off either end) whose text occurs in ``text`` from ``pos``; None if none does."""
    n = len(rec.token_ids)

    def width(k: int) -> int:  # characters of the first k tokens of the chunk's text
        return len(model.tokenizer.decode(list(rec.token_ids[:k]), clean_up_tokenization_spaces=False))

    def tail(k: int) -> int:  # characters of its last k tokens
        return len(model.tokenizer.decode(list(rec.token_ids[n - k :]), clean_up_tokenization_spaces=False))

    cuts = sorted(
        ((lo, hi) for lo in range(min(edge, n - 1) + 1) for hi in range(n, max(lo, n - edge - 1), -1)),
        key=lambda c: (c[0] - c[1], c[0]),
    )
    for lo, hi in cuts:
        piece = rec.text[width(lo) : len(rec.text) - tail(n - hi)] if (lo, hi) != (0, n) else rec.text
        at = text.find(piece, pos) if piece.strip() else -1
        if at >= 0:
            return at, lo, hi, piece
    return None


def held_chunks(rag: RAG, docs: Sequence[Any]) -> list[ChunkRecord]:
    """The stored chunks that hold each of ``docs`` (a framework's retrieved documents or nodes), in
    order, as the wrappers' ``chunks=`` path resolves them (:meth:`RagkvRunner.lookup`: the chunk a
    ragkv-made document names, the chunk or document with its text), ingesting nothing."""
    from ragkv_frameworks import RagkvRunner

    runner = RagkvRunner(rag)
    return [r for d in docs for r in (runner.lookup(d) or [])]


def explicit_generation(rag: RAG, llm: Any, text: str, recs: Sequence[ChunkRecord]):
    """Complete :func:`explicit_text` of ``text`` with ``llm``'s (the wrapper's) mode, ratio and
    sampling, locating nothing else: ``(the generation, its job, the stored chunks given)``."""
    from ragkv_frameworks import SAMPLING_KEYS, make_params

    defaults = llm.call_defaults()
    ids, spans, used = explicit_text(rag.model, text, recs)
    params = make_params({k: defaults.get(k) for k in SAMPLING_KEYS})
    settings = RequestSettings(defaults.get("mode"), defaults.get("ratio"))
    job = rag.job(ids, spans, settings, params, locate=False)
    done = [x for x in rag.generate(job) if isinstance(x, Generated)]
    return done[-1], job, used


@dataclass
class PathResult:
    """One standard-path answer against its explicit form."""

    path: str
    kind: str
    answer: str  # what the framework returned
    explicit: str  # the explicit form's answer
    prompt: str  # the flat prompt text the wrapper completed
    info: dict  # the wrapper's statistics for it (``raw["ragkv"]`` / ``response_metadata["ragkv"]``)
    context_tokens: int  # the documents' texts the framework formatted in, in tokens
    chunks_given: int  # stored chunks the explicit form gives
    explicit_rows: int  # their rows it gives
    explicit_tokens: int  # the explicit form's prompt length
    ids_equal: bool  # the explicit form's token ids are the flat text tokenized as a whole
    same_job: bool  # the wrapper's segmentation of the flat text (RAG.segment_text) is the explicit form

    @property
    def equal(self) -> bool:
        return self.answer == self.explicit

    @property
    def reused_share(self) -> float:
        """Rows taken from stored KV over the prompt's context tokens."""
        return self.info.get("num_reused_rows", 0) / max(1, self.context_tokens)

    def row(self) -> dict:
        return {
            "path": self.path,
            "kind": self.kind,
            "prompt_tokens": self.info.get("num_tokens"),
            "context_tokens": self.context_tokens,
            "reused_rows": self.info.get("num_reused_rows", 0),
            "reused_share": round(self.reused_share, 5),
            "kv_hits": self.info.get("kv_hits", 0),
            "chunks_given": self.chunks_given,
            "explicit_rows": self.explicit_rows,
            "ids_equal": self.ids_equal,
            "same_job": self.same_job,
            "same_as_explicit": self.equal,
            "answer": self.answer,
            "explicit": self.explicit,
        }


def compare(
    path: str,
    kind: str,
    rag: RAG,
    llm: Any,
    answer: str,
    call: Call,
    prompt: str,
    context_docs: Sequence[Any],
) -> PathResult:
    """``answer`` (what the framework returned for ``call``, whose flat text is ``prompt``) against
    the explicit form over the stored chunks holding ``context_docs`` (the documents or nodes the
    framework formatted in, :func:`held_chunks`; their texts' tokens are the reuse share's
    denominator)."""
    from ragkv_frameworks import doc_fields

    model = rag.model
    gen, job, used = explicit_generation(rag, llm, prompt, held_chunks(rag, context_docs))
    flat_ids = model.encode("", add_bos=True) + model.encode(prompt)
    seg_ids, seg = rag.segment_text(prompt, add_bos=True)
    return PathResult(
        path=path,
        kind=kind,
        answer=answer,
        explicit=gen.text,
        prompt=prompt,
        info=call.info,
        context_tokens=sum(len(model.encode(doc_fields(d)[0])) for d in context_docs),
        chunks_given=len(used),
        explicit_rows=sum(c.hi - c.lo for c in job.chunks),
        explicit_tokens=len(job.prompt_ids),
        ids_equal=job.prompt_ids == flat_ids,
        same_job=seg_ids == job.prompt_ids and _spans(seg) == _spans(job.chunks),
    )


def _spans(chunks: Sequence[Located]) -> list[tuple]:
    return [(c.key, c.start, c.lo, c.hi) for c in chunks]


# ---- the measurement (eval.bench_flat_reuse --via framework) ----------------------------------------
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def main(argv: list[str] | None = None) -> int:
    """The frameworks' standard paths on the real model against the explicit form, per question and
    way of running; one JSON line at the end (``python -m eval.bench_flat_reuse --via framework``)."""
    import argparse
    import json
    import statistics
    import tempfile

    import torch

    from ragkv import LLM

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--format", choices=["langchain", "llamaindex", "both"], default="both")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--passages", type=int, default=5, help="passages per question (its corpus)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", choices=["passages", "joined"], default="passages")
    ap.add_argument("--split", choices=["default", "ragkv"], default="default")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--chunk-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    samples = json.loads((DATA_DIR / "musique_s.json").read_text())[: args.questions]
    kinds = [k for k in args.kinds.split(",") if k]
    formats = ["llamaindex", "langchain"] if args.format == "both" else [args.format]
    new = args.max_new_tokens
    rows = []
    with tempfile.TemporaryDirectory() as d:
        rag = RAG(LLM(), d, chunk_tokens=args.chunk_tokens)
        for i, s in enumerate(samples):
            texts = [f"{c['title']}\n{c['text']}".strip() for c in s["ctxs"][: args.passages]]
            if args.docs == "joined":
                texts = ["\n\n".join(texts)]
            rag.ingest([{"id": f"q{i}p{j}", "text": t} for j, t in enumerate(texts)], show_progress=False)
            for fmt in formats:
                if fmt == "llamaindex":
                    index, llm = _llama_index(rag, texts, args.split), _llama_llm(rag, new)
                    top_k = len(index.docstore.docs) if args.docs == "passages" else 2
                else:
                    retriever, llm = _lc_retriever(rag, texts, args.split, args.docs), _lc_chat(rag, new)
                    chain = lcel_chain(retriever, llm)
                for kind in kinds:
                    if fmt == "llamaindex":
                        with recording(llama_calls()) as calls:
                            answer, docs = llamaindex_answer(index, llm, s["question"], kind, top_k)
                    else:
                        calls = langchain_calls()
                        answer = lcel_answer(chain, s["question"], kind, [calls])
                        docs = calls.retrieved[-1]
                    call = calls.calls[-1]
                    res = compare(fmt, kind, rag, llm, answer, call, calls.prompt_of(llm, call), docs)
                    row = {"question": i, **res.row(), "ttft_s": call.info.get("timings", {}).get("ttft_s")}
                    rows.append(row)
                    print(
                        f"q{i} {fmt} {kind}: {row['prompt_tokens']} tokens, context {row['context_tokens']}, "
                        f"reused {row['reused_share']:.4f} ({row['kv_hits']} stored chunks; explicit gives "
                        f"{row['chunks_given']}), same job {row['same_job']}, same answer "
                        f"{row['same_as_explicit']} ({answer[:40]!r}), TTFT {row['ttft_s']:.2f} s",
                        flush=True,
                    )
        rag.close()
    summary: dict = {
        "via": "framework",
        "docs": args.docs,
        "split": args.split,
        "questions": len(samples),
        "passages": args.passages,
        "chunk_tokens": args.chunk_tokens,
    }
    for fmt in formats:
        mine = [r for r in rows if r["path"] == fmt]
        summary[fmt] = {
            "answers": len(mine),
            "reused_share_mean": round(statistics.fmean(r["reused_share"] for r in mine), 5),
            "reused_share_min": round(min(r["reused_share"] for r in mine), 5),
            "same_as_explicit": sum(r["same_as_explicit"] for r in mine),
            "same_job": sum(r["same_job"] for r in mine),
            "ids_equal_whole_tokenization": sum(r["ids_equal"] for r in mine),
            "ttft_median_s": round(statistics.median(r["ttft_s"] for r in mine), 3),
        }
    print(json.dumps(summary))
    return 0


def _llama_llm(rag: RAG, max_new_tokens: int):
    from llama_index.llms.ragkv import RagkvLlamaLLM

    return RagkvLlamaLLM(rag=rag, max_tokens=max_new_tokens)


def _llama_index(rag: RAG, texts: list[str], split: str):
    """LlamaIndex's ``VectorStoreIndex.from_documents`` over ``texts`` (its default splitter, or
    ``RagkvNodeParser``)."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.retrievers.ragkv import RagkvLlamaEmbedding, RagkvNodeParser

    extra = {"transformations": [RagkvNodeParser(rag=rag)]} if split == "ragkv" else {}
    docs = [Document(text=t) for t in texts]
    return VectorStoreIndex.from_documents(docs, embed_model=RagkvLlamaEmbedding(rag.embedder), **extra)


def _lc_chat(rag: RAG, max_new_tokens: int):
    from langchain_ragkv import ChatRagkv

    return ChatRagkv(rag=rag, max_new_tokens=max_new_tokens)


def _lc_retriever(rag: RAG, texts: list[str], split: str, docs: str):
    """A plain LangChain ``InMemoryVectorStore`` over ``texts`` (whole, or ``RagkvTextSplitter``'s
    pieces) as a retriever of all of them (two with ``--docs joined``)."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from langchain_ragkv import RagkvEmbeddings, RagkvTextSplitter

    pieces = [Document(page_content=t) for t in texts]
    if split == "ragkv":
        pieces = RagkvTextSplitter(rag).split_documents(pieces)
    store = InMemoryVectorStore.from_documents(pieces, RagkvEmbeddings(rag.embedder))
    return store.as_retriever(search_kwargs={"k": len(pieces) if docs == "passages" else 2})


if __name__ == "__main__":
    raise SystemExit(main())
