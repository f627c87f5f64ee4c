"""A retrieval chain that hands the retrieved documents to a ragkv model *as chunks*."""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough


def rag_chain(retriever: Runnable, llm: Runnable, **llm_kwargs: Any) -> Runnable:
    """``question -> {"question", "docs", "answer"}``: retrieve with any LangChain retriever, then
    ``llm.invoke(question, chunks=docs)`` so the documents' KV is reused (documents ragkv has never
    seen are ingested on first use). ``llm`` is a :class:`RagkvLLM` or :class:`ChatRagkv`."""

    def answer(x: dict) -> Any:
        return llm.invoke(x["question"], chunks=x["docs"], **llm_kwargs)

    async def aanswer(x: dict) -> Any:
        return await llm.ainvoke(x["question"], chunks=x["docs"], **llm_kwargs)

    return RunnableParallel(docs=retriever, question=RunnablePassthrough()).assign(
        answer=RunnableLambda(answer, afunc=aanswer, name="ragkv_answer_with_chunks")
    )
